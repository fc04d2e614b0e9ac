"""Keeps backfill's cost to training under `backfill.max_slowdown`, measured.

The baseline is the controller's own measurement: the step times of chunks run with
backfill paused, for `baseline_steps` steps at the start and again every
`rebaseline_every_steps` (the step time drifts with the data, the lr, the machine).
With backfill on, the slowdown is the mean step time of the chunks run at the
current margin over the baseline's.

Step times are noisy (a shared host, the data, the collectives), far more than the
few percent the bound allows, so the governor moves only on evidence: the slowdown's
standard error comes from the spread of both samples, and the margin changes only
when the slowdown is over or under the bound by `Z` standard errors. Until then it
holds and keeps measuring. Surely over: the margin grows (a unit must fit margin x
its measured cost into what is left of a window), and at the widest margin backfill
pauses until the next baseline. Surely under: the margin shrinks back toward 1, so
more of each window is used. A governor that answered every noisy reading would
ratchet the margin up on noise alone (it doubles on "too slow" and shrinks by a
quarter on "room") and pause backfill for nothing: on simulated chunks with 8%
noise and no slowdown at all, that one spent a third of the time paused.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from statistics import fmean, variance

MIN_MARGIN = 1.0
MAX_MARGIN = 8.0
START_MARGIN = 1.5
Z = 2.0
"""Standard errors by which the slowdown must clear a threshold before the margin moves."""
MAX_ON_CHUNKS = 40
"""The most recent chunks at one margin that the slowdown is measured over."""


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
        self.min_chunks = window_chunks  # chunks at a margin before it may move
        self._base: list[float] = []  # per-step seconds of the baseline being measured
        self._base_steps = 0
        self._baseline: list[float] = []  # those of the last measured baseline
        self.baseline_s: float | None = None
        self._on: deque[float] = deque(maxlen=MAX_ON_CHUNKS)  # chunks at this margin
        self._since_baseline = 0
        self.slowdown: float | None = None
        self.slowdown_se: float | None = None
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
                self._baseline, self.baseline_s = self._base, fmean(self._base)
                self._base, self._base_steps = [], 0
                self._since_baseline = 0
                self._on.clear()
                self._set("on", self.margin, "baseline measured")
            return self.decision()
        self._since_baseline += steps
        if self.phase == "on":
            self._on.append(per_step)
            self.slowdown, self.slowdown_se = self._estimate()
            if len(self._on) >= self.min_chunks:
                low = self.slowdown - Z * self.slowdown_se
                high = self.slowdown + Z * self.slowdown_se
                if low > self.max_slowdown:
                    if self.margin >= MAX_MARGIN:
                        self._set("paused", self.margin, "slowdown at the widest margin")
                    else:
                        self._set("on", min(MAX_MARGIN, self.margin * 2), "too slow")
                    self._on.clear()
                elif high < self.max_slowdown and self.margin > MIN_MARGIN:
                    self._set("on", max(MIN_MARGIN, self.margin / 1.25), "room to spare")
                    self._on.clear()
        if self._since_baseline >= self.rebaseline_every:
            self._set("baseline", self.margin, "periodic re-baseline")
        return self.decision()

    def _estimate(self) -> tuple[float, float]:
        """The slowdown at this margin against the baseline, and its standard error
        (a sample of one chunk borrows the other sample's spread)."""
        on, base = list(self._on), self._baseline
        assert self.baseline_s is not None
        var_on = variance(on) if len(on) > 1 else None
        var_base = variance(base) if len(base) > 1 else None
        var_on = var_on if var_on is not None else (var_base or 0.0)
        var_base = var_base if var_base is not None else var_on
        se = math.sqrt(var_on / len(on) + var_base / len(base)) / self.baseline_s
        return fmean(on) / self.baseline_s - 1.0, se

    def _set(self, phase: str, margin: float, why: str) -> None:
        self.phase, self.margin = phase, margin
        self.history.append(
            {
                "phase": phase,
                "margin": margin,
                "why": why,
                "slowdown": self.slowdown,
                "slowdown_se": self.slowdown_se,
            }
        )
