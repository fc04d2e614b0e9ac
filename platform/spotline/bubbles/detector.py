"""Bubble windows from measured instruction timings, and the next step's forecast.

A window is a stretch of a stage's step spent blocked on another stage: one or
more consecutive wait instructions (receives, sends, the end-of-step syncs) with
no compute between them. The measured bubble fraction of a step is its wait
time over its length, to be read against (p-1)/(m+p-1).

The forecast is keyed by the instruction's index in the step. With a fixed p
and m, DeepSpeed runs the same instruction list every step, so index i is the
same receive of the same slot each time, and an exponential average of what it
waited is the prediction for the next step (the schedule gives the where, recent
timings give the how long). Before any step is measured, `seed` predicts from
the schedule simulated at estimated stage costs; the first measured step then
replaces that guess outright.
"""

from __future__ import annotations

from dataclasses import dataclass

from spotline.bubbles.schedule import WAITS, Instr


@dataclass(frozen=True)
class Window:
    """An idle window of one stage's step, times relative to the step's start."""

    start: float
    end: float
    first: int
    """Index, in the step's instruction list, of the wait that opens the window."""

    @property
    def seconds(self) -> float:
        return self.end - self.start


def windows(timeline: list[Instr], min_s: float = 0.0) -> list[Window]:
    """The idle windows of one step, in time order, longer than `min_s`."""
    out: list[Window] = []
    first = None
    start = end = 0.0
    for i, ins in enumerate(timeline):
        if ins.name in WAITS:
            if first is None:
                first, start = i, ins.start
            end = ins.end
        elif ins.seconds > 0 and first is not None:
            out.append(Window(start, end, first))
            first = None
    if first is not None:
        out.append(Window(start, end, first))
    return [w for w in out if w.seconds > min_s]


def bubble_fraction(timeline: list[Instr]) -> float:
    """Share of the step this stage spent waiting on others."""
    if not timeline:
        return 0.0
    span = timeline[-1].end - timeline[0].start
    waited = sum(i.seconds for i in timeline if i.name in WAITS)
    return waited / span if span > 0 else 0.0


class Forecast:
    """Exponential averages of each wait instruction's duration, by index in the step.

    `remaining(i)` is what the window that instruction i is part of should still
    last when i starts: the averaged waits of i and of the waits right after it.
    """

    def __init__(self, alpha: float = 0.3):
        self.alpha = alpha
        self._wait: dict[int, float] = {}
        self._run: dict[int, float] = {}
        self._offsets: dict[int, float] = {}
        self._names: list[str] = []
        self.seeded = False
        """True while the forecast is `seed`'s and no step has been measured."""

    def seed(self, timeline: list[Instr]) -> None:
        """Predict `timeline` (a simulated step) until the first measured step, which
        replaces it rather than being averaged with it."""
        self._names = []
        self.update(timeline)
        self.seeded = True

    def update(self, timeline: list[Instr]) -> None:
        names = [i.name for i in timeline]
        if names != self._names or self.seeded:  # another schedule, or only a guess so far
            self._wait.clear()
            self._offsets.clear()
            self._names = names
            self.seeded = False
        a = self.alpha
        for i, ins in enumerate(timeline):
            if ins.name not in WAITS:
                continue
            old = self._wait.get(i)
            self._wait[i] = ins.seconds if old is None else (1 - a) * old + a * ins.seconds
            off = self._offsets.get(i)
            self._offsets[i] = ins.start if off is None else (1 - a) * off + a * ins.start
        self._run.clear()
        acc = 0.0
        for i in range(len(names) - 1, -1, -1):
            acc = acc + self._wait[i] if names[i] in WAITS else 0.0
            if names[i] in WAITS:
                self._run[i] = acc

    def remaining(self, index: int) -> float:
        """Predicted seconds from the start of wait `index` to the end of its window."""
        return self._run.get(index, 0.0)

    def next_step(self, min_s: float = 0.0) -> list[Window]:
        """The windows the next step should have, by predicted offset and length."""
        out = []
        prev_wait = False
        for i, name in enumerate(self._names):
            is_wait = name in WAITS
            if is_wait and not prev_wait and self._run.get(i, 0.0) > min_s:
                start = self._offsets[i]
                out.append(Window(start, start + self._run[i], i))
            prev_wait = is_wait
        return out
