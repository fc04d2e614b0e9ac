"""The one retry policy (spotline.storage.retry), on fake time."""

from __future__ import annotations

import pytest

from spotline.registry import UserCodeError
from spotline.storage.retry import is_users, poll, retrying, try_again

pytestmark = pytest.mark.unit


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def test_an_error_in_the_users_code_is_never_tried_again_whatever_the_rule() -> None:
    theirs = UserCodeError("error in your code, not in Spotline: ValueError: bad")
    wrapped = RuntimeError("task failed")
    wrapped.cause = theirs  # as a Ray task error carries it
    chained = RuntimeError("while loading")
    chained.__cause__ = theirs
    for e in (theirs, wrapped, chained):
        assert is_users(e)
        assert not try_again(e, 1, 3, transient=lambda _: True)
    assert try_again(RuntimeError("executor died"), 1, 3, transient=lambda _: True)
    assert not try_again(RuntimeError("executor died"), 3, 3, transient=lambda _: True)

    tries: list[int] = []

    def fail() -> None:
        tries.append(1)
        raise theirs

    with pytest.raises(UserCodeError):
        retrying(fail, 5, lambda _: True, sleep=FakeTime().sleep)
    assert tries == [1]


def test_retrying_waits_as_told_says_each_retry_and_raises_the_last_error() -> None:
    fake, said, tries = FakeTime(), [], []

    def flaky() -> str:
        tries.append(1)
        if len(tries) < 3:
            raise ConnectionResetError(f"reset {len(tries)}")
        return "ok"

    on_retry = lambda n, e: said.append((n, str(e)))  # noqa: E731
    assert retrying(flaky, 3, wait_s=1.0, sleep=fake.sleep, on_retry=on_retry) == "ok"
    assert said == [(1, "reset 1"), (2, "reset 2")] and fake.slept == [1.0, 1.0]
    tries.clear()
    with pytest.raises(ConnectionResetError, match="reset 2"):
        retrying(flaky, 2, wait_s=1.0, sleep=fake.sleep)


def test_poll_reads_until_done_or_the_time_is_up_on_the_callers_clock() -> None:
    fake = FakeTime()
    readings = iter([1, 2, 3, 4])
    got = poll(lambda: next(readings), lambda v: v >= 3, within_s=5, every_s=0.5, **_on(fake))
    assert got == 3 and fake.slept == [0.5, 0.5]

    fake = FakeTime()
    got = poll(lambda: 0, bool, within_s=1.0, every_s=0.25, **_on(fake))
    assert got == 0 and fake.slept == [0.25] * 4  # read at 0, .25, .5, .75 and 1.0

    fake = FakeTime()
    assert poll(lambda: set(), bool, within_s=0.0, every_s=0.25, **_on(fake)) == set()
    assert fake.slept == []  # no time given: one reading


def _on(fake: FakeTime) -> dict:
    return {"clock": fake.clock, "sleep": fake.sleep}
