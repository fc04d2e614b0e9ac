"""Keeps backfill's cost to training under `backfill.max_slowdown`, measured.

The baseline is the controller's own measurement: the mean step time of chunks
run with backfill paused, for `baseline_steps` steps at the start and again
every `rebaseline_every_steps` (the step time drifts with the data, the lr, the
machine). With backfill on, the slowdown is the mean step time of the recent
chunks over that baseline. Too slow: the margin grows (a unit must fit margin x
its measured cost into what is left of a window), and at the widest margin
backfill pauses until the next baseline. Comfortably fast: the margin shrinks
back toward 1, so more of each window is used.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from statistics import median

MIN_MARGIN = 1.0
MAX_MARGIN = 8.0
START_MARGIN = 1.5


@dataclass(frozen=True)
class BackfillDecision:
    paused: bool
    margin: float
    phase: str  # "baseline", "on", "paused"


class SlowdownGovernor:
    def __init__(
        self,
        max_slowdown: float,
        baseline_steps: int,
        rebaseline_every_steps: int,
        window_chunks: int = 3,
    ):
        self.max_slowdown = max_slowdown
        self.baseline_steps = baseline_steps
        self.rebaseline_every = rebaseline_every_steps
        self.margin = START_MARGIN
        self.phase = "baseline"
        self._base: list[float] = []  # per-step seconds of baseline chunks
        self._base_steps = 0
        self.baseline_s: float | None = None
        self._on: deque[float] = deque(maxlen=window_chunks)
        self._since_baseline = 0
        self.slowdown: float | None = None
        self.history: list[dict] = []  # one row per decision that changed something

    def decision(self) -> BackfillDecision:
        return BackfillDecision(self.phase != "on", self.margin, self.phase)

    def observe(self, steps: int, seconds: float, warm: bool = True) -> BackfillDecision:
        """Feed one chunk's step count and seconds (run under the current decision)."""
        if steps <= 0 or not warm:
            return self.decision()
        per_step = seconds / steps
        if self.phase == "baseline":
            self._base.append(per_step)
            self._base_steps += steps
            if self._base_steps >= self.baseline_steps:
                self.baseline_s = median(self._base)
                self._base, self._base_steps = [], 0
                self._since_baseline = 0
                self._on.clear()
                self._set("on", self.margin, "baseline measured")
            return self.decision()
        self._since_baseline += steps
        if self.phase == "on":
            self._on.append(per_step)
            assert self.baseline_s is not None
            self.slowdown = median(self._on) / self.baseline_s - 1.0
            if len(self._on) == self._on.maxlen:
                if self.slowdown > self.max_slowdown:
                    if self.margin >= MAX_MARGIN:
                        self._set("paused", self.margin, "slowdown at the widest margin")
                    else:
                        self._set("on", min(MAX_MARGIN, self.margin * 2), "too slow")
                    self._on.clear()
                elif self.slowdown < self.max_slowdown / 2 and self.margin > MIN_MARGIN:
                    self._set("on", max(MIN_MARGIN, self.margin / 1.25), "room to spare")
                    self._on.clear()
        if self._since_baseline >= self.rebaseline_every:
            self._set("baseline", self.margin, "periodic re-baseline")
        return self.decision()

    def _set(self, phase: str, margin: float, why: str) -> None:
        self.phase, self.margin = phase, margin
        self.history.append(
            {"phase": phase, "margin": margin, "why": why, "slowdown": self.slowdown}
        )
