"""The controller's one clock.

Every duration, deadline and stamp the controller and its rooms take comes from here,
so that a test drives them all from one fake: `monotonic` for durations and the
deadlines the job sets itself, `wall` for stamps people and other processes read (and
for a preemption notice's deadline, which arrives as wall time), `sleep` to wait.
Nothing else in `spotline.controller` reads the time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Clock:
    monotonic: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep

    def __call__(self) -> float:
        """The monotonic reading: what a duration is measured by."""
        return self.monotonic()
