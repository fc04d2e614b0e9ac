"""A call into a communication backend that may never return, run where it cannot hold
the rank: on a thread of its own, waited on for at most a deadline.

An NCCL abort (`ncclCommAbort`) or a process group's destroy can block forever in the
driver or the network: a GPU that stopped answering, a peer stuck halfway. Run on the
thread that asked, such a call would hold that thread (the rank's training thread, or
the thread its controller's calls run on) and everything queued behind it. `Watch`
runs it on a daemon thread of its own; whoever waits gets its result, its error, or,
once the deadline passed, the news that it hung. A hung call stays stuck on its thread:
the process is then never trusted to train again (`CommsHung`): its replica is ended
and its node cordoned.

Never here: Ray, a decision about which ranks are kept.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class CommsHung(RuntimeError):
    """A rank could not let go of its communicators: `what` (an abort, a destroy) did not
    return within `timeout_s` (the constant `knob`). The process holds a thread stuck in
    the backend, so it is never kept for a next group, and the controller cordons its
    node. `step_error`: what ended the rank's step before, when there was something."""

    def __init__(
        self,
        rank: int,
        node: str,
        what: str,
        timeout_s: float,
        knob: str,
        step_error: str = "",
    ):
        self.rank, self.node, self.what = rank, node, what
        self.timeout_s, self.knob, self.step_error = timeout_s, knob, step_error
        super().__init__(self._text())

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray as the rank's error
        args = (self.rank, self.node, self.what, self.timeout_s, self.knob, self.step_error)
        return (CommsHung, args)

    @property
    def short(self) -> str:
        """Why its rank is not kept, for the restart's list."""
        return f"{self.what} did not return within {self.timeout_s:.0f}s ({self.knob})"

    def after(self, step_error: BaseException) -> CommsHung:
        """The same hang, naming the error that ended the step before it."""
        first = str(step_error).strip().splitlines()
        said = f"{type(step_error).__name__}: {first[0] if first else ''}"
        return CommsHung(self.rank, self.node, self.what, self.timeout_s, self.knob, said)

    def _text(self) -> str:
        where = f" on node {self.node[:12]}" if self.node else ""
        before = f" after its step failed ({self.step_error})" if self.step_error else ""
        return (
            f"rank {self.rank}{where}: {self.short}{before}. A thread of its process is "
            "stuck in the communication backend, so the process is ended with its group "
            "and the node is cordoned (failure.cordon). If the node hangs again once "
            "its cordon expires, drain it and check its GPUs and network"
        )


class Watch:
    """`fn` called once, on a daemon thread named `name`, that any number of callers wait
    on (`wait`) for at most `timeout_s` from the call's start."""

    def __init__(self, fn: Callable[[], Any], timeout_s: float, name: str):
        self._fn = fn
        self.timeout_s = timeout_s
        self._name = name
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._deadline: float | None = None
        self._late = False
        self.value: Any = None
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            self.value = self._fn()
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            self.error = e
        finally:
            self._done.set()

    def start(self) -> None:
        """Call `fn` now, unless it was called before."""
        with self._lock:
            if self._deadline is not None:
                return
            self._deadline = time.monotonic() + self.timeout_s
        try:
            threading.Thread(target=self._run, name=self._name, daemon=True).start()
        except BaseException as e:  # noqa: BLE001 - no thread to be had: the call failed
            self.error = e
            self._done.set()

    def wait(self) -> bool:
        """Start it if it has not started; True once it returned or raised (`value`,
        `error`), False when its deadline passed first: it hung."""
        self.start()
        assert self._deadline is not None
        if self._done.wait(max(0.0, self._deadline - time.monotonic())):
            return True
        self._late = True
        return False

    @property
    def hung(self) -> bool:
        """A wait saw its deadline pass before it returned (it stays so: what was said
        of the process when it hung holds, even if the call returns later)."""
        return self._late


def watched(fn: Callable[[], Any], timeout_s: float, name: str) -> Watch:
    """`fn` run under a `Watch`, waited on: check `hung`, then `error` and `value`."""
    w = Watch(fn, timeout_s, name)
    w.wait()
    return w
