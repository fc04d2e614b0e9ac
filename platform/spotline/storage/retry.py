"""The one retry policy of Spotline: what is worth another try, and how it is tried.

A call is tried again only when its error is transient by its caller's rule (storage's
is `is_transient`: a dropped or refused connection, a timeout, a throttle, a server
error), and never when the error is in the user's own code: the same code fails the
same way on the next try. The waits come from tenacity: exponential backoff with
jitter unless the caller names a fixed wait. The last error goes up as it was raised.

- `retrying(fn, attempts)`: call `fn` until it passes, tries run out, or the error is
  not worth another try.
- `try_again(error, attempt, attempts)`: the same decision for a caller that queues the
  work again instead of waiting for it (the backfill pool).
- `poll(read, done, within_s, every_s)`: read again until the value is what the caller
  waits for, or the time is up (capacity after a teardown, a name Ray frees).

s3fs and botocore retry inside a single call on their own; this policy is the one
above them. Sleeps and clocks are injectable, so a policy's callers test on fake time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import tenacity

T = TypeVar("T")

# Errors (by class name, anywhere in the class's MRO) that a dropped or refused
# connection raises in fsspec's backends: aiohttp (http, s3fs, gcsfs), botocore, the OS.
NETWORK_ERRORS = frozenset(
    {
        "ClientConnectorError",
        "ConnectionError",
        "EndpointConnectionError",
        "ServerDisconnectedError",
        "TimeoutError",
        "ClientOSError",
        "ClientPayloadError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "IncompleteReadError",
        "ResponseStreamingError",
        "HTTPClientError",
    }
)
# S3 error codes that ask the client to come back later.
_RETRY_LATER_CODES = frozenset(
    {"SlowDown", "Throttling", "RequestTimeout", "InternalError", "ServiceUnavailable", "503"}
)
# The class of an error raised in the user's own code (`registry.UserCodeError`).
_USER_CODE_ERROR = "UserCodeError"
BACKOFF = tenacity.wait_random_exponential(multiplier=0.2, max=5.0)
"""The wait before each new try, unless a caller names a fixed one: exponential, with
jitter so that ranks retrying together do not retry in step, at most 5 s."""


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then its causes and contexts (each once)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _class_names(obj: object) -> set[str]:
    return {c.__name__ for c in type(obj).__mro__}


def network_cause(e: BaseException) -> BaseException | None:
    """The dropped or refused connection behind `e` (itself, or what it was raised
    from: fsspec's HTTP filesystem reports one as a missing file), or None."""
    for link in exception_chain(e):
        if _class_names(link) & NETWORK_ERRORS:
            return link
    return None


def is_transient(e: BaseException) -> bool:
    """Whether a storage call that raised `e` is worth another try: a dropped or refused
    connection, a timeout, a throttle or a server error. Never a missing file, a denied
    access, bad credentials or bad content."""
    if network_cause(e) is not None:
        return True
    response = getattr(e, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    return code in _RETRY_LATER_CODES


def is_users(e: BaseException) -> bool:
    """Whether `e` is an error in the user's own code (`registry.UserCodeError`, told by
    its class name as this room imports no other; a Ray task error carries it as its
    `cause`), which no retry can mend."""
    return any(
        _USER_CODE_ERROR in _class_names(link)
        or _USER_CODE_ERROR in _class_names(getattr(link, "cause", None))
        for link in exception_chain(e)
    )


def worth_another_try(e: BaseException, transient: Callable[[BaseException], bool]) -> bool:
    """`transient(e)`, and never for an error in the user's code or an interrupt."""
    return isinstance(e, Exception) and not is_users(e) and transient(e)


def retrying(
    fn: Callable[[], T],
    attempts: int | None,
    transient: Callable[[BaseException], bool] = is_transient,
    *,
    wait_s: float | None = None,
    within_s: float | None = None,
    sleep: Callable[[float], Any] = time.sleep,
    on_retry: Callable[[int, BaseException], Any] | None = None,
) -> T:
    """`fn()`, tried again while its error is worth another try (`transient`, never the
    user's), up to `attempts` tries in all (None: no limit) and, with `within_s`, no new
    try after that many seconds, `wait_s` apart (default: `BACKOFF`). `on_retry(attempt, error)` is told
    of each failed try before the wait. The last error is raised as it is."""
    stop = (
        tenacity.stop_never if attempts is None else tenacity.stop_after_attempt(max(1, attempts))
    )
    if within_s is not None:
        stop = stop | tenacity.stop_after_delay(within_s)

    def before_sleep(state: tenacity.RetryCallState) -> None:
        if on_retry is not None and state.outcome is not None:
            on_retry(state.attempt_number, state.outcome.exception())

    return tenacity.Retrying(
        stop=stop,
        wait=BACKOFF if wait_s is None else tenacity.wait_fixed(wait_s),
        retry=tenacity.retry_if_exception(lambda e: worth_another_try(e, transient)),
        sleep=sleep,
        before_sleep=before_sleep,
        reraise=True,
    )(fn)


def try_again(
    e: BaseException,
    attempt: int,
    attempts: int,
    transient: Callable[[BaseException], bool] = is_transient,
) -> bool:
    """Whether work whose try number `attempt` failed with `e` gets another of its
    `attempts` tries, by the same rule as `retrying`."""
    return attempt < attempts and worth_another_try(e, transient)


def poll(
    read: Callable[[], T],
    done: Callable[[T], bool],
    *,
    within_s: float,
    every_s: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Any] = time.sleep,
) -> T:
    """`read()`, read again every `every_s` until `done(value)` or `within_s` have passed
    on `clock`; the last value. An error of `read` goes up at once."""
    deadline = clock() + within_s
    return tenacity.Retrying(
        stop=lambda state: clock() >= deadline,
        wait=tenacity.wait_fixed(every_s),
        retry=tenacity.retry_if_result(lambda value: not done(value)),
        sleep=sleep,
        retry_error_callback=lambda state: state.outcome.result(),
    )(read)
