"""How fast the job runs and what a restart costs it, as the decisions weigh them.

The grow, re-partition and just-in-time decisions all ask the same questions: how
many steps per second does the job make at D replicas, how long does a step take on
the wall clock now, and how long does starting a group (or restarting one) take.
`Pace` keeps those measurements across groups; it decides nothing and does no I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

RATE_WEIGHT = 0.2  # of a new chunk in a size's moving-average rate
# Steps over which the wall-clock step time is measured (the JIT plan's, and its check).
RECENT_STEPS = 32


@dataclass
class Pace:
    sps: dict[int, float] = field(default_factory=dict)
    """Steps per second by replica count: a moving average over warm chunks."""
    warm: set[int] = field(default_factory=set)  # sizes whose rate comes from warm chunks
    recent: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    """(step, wall clock at its end) of the live group's latest steps."""
    start_s: float | None = None
    """Measured: a group's start to its first step. It stands in for the restart cost
    until a restart has been measured (a restart costs that plus the teardown)."""
    restart_s: float | None = None  # measured: teardown to the first step after it
    restart_from: tuple[float, str] | None = None  # (clock, why) until training again
    starting_since: float | None = None  # clock, while a new group has no step
    group_started: float = 0.0  # clock: when the live group was set running

    def note_rate(self, replicas: int, steps_per_s: float, warm: bool) -> None:
        """The steps per second this job runs at `replicas` replicas, as the grow and
        shrink decisions weigh it: a moving average over warm chunks, so that one chunk
        slowed by a save, a warm-up or a neighbour does not decide for the rest of the
        job that a size is not worth returning to."""
        prev = self.sps.get(replicas)
        if prev is None or (warm and replicas not in self.warm):
            self.sps[replicas] = steps_per_s  # a cold figure until a warm one
        elif warm:
            self.sps[replicas] = prev + RATE_WEIGHT * (steps_per_s - prev)
        if warm:
            self.warm.add(replicas)

    def wall_step_s(self) -> float | None:
        """Wall-clock seconds per step over the latest steps (everything between steps
        included), or None before two steps of the live group."""
        recent = self.recent
        if len(recent) < 2 or recent[-1][0] == recent[0][0]:
            return None
        return (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0])

    def restart_cost_s(self) -> float | None:
        return self.restart_s if self.restart_s is not None else self.start_s

    def starting(self, now: float) -> None:
        """A new group is being started: its step times start afresh."""
        self.starting_since = now
        self.recent.clear()

    def stepped(self, now: float) -> tuple[str, float] | None:
        """The live group reported steps. The first ones after a start measure the start;
        the first ones after a restart measure the restart: (why, seconds) then."""
        if self.starting_since is not None:
            self.start_s = now - self.starting_since
            self.starting_since = None
        if self.restart_from is None:
            return None
        since, why = self.restart_from
        self.restart_from = None
        self.restart_s = now - since
        return why, self.restart_s
