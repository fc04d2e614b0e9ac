"""The controller's running account of bubbles and of how much backfill filled.

Fed with what every rank reports after each chunk of steps, all summed over every
stage and replica, kept per stage, and for the chunks that ran with backfill on
(the governor pauses it to measure its baseline):

- bubble fraction: time stages spent waiting on other stages / step time;
- fill fraction: executor busy time inside windows / window time (the waits long
  enough to signal, `window_s`); `bubble_fill_fraction` is the same busy time over
  the whole bubble (`wait_s`), short waits included;
- overrun: executor busy time during steps outside windows, per step and as a
  fraction of the step (`overrun_fraction`);
- `beyond_s`: time windows stayed open past their forecast end, where no unit may
  start (what an optimistic forecast would have to win back).

The trainer measures the busy time from the kernel or the device (see
`bubbles.channel`). Nothing is capped: a fill above 1 is a measurement bug, and
shows as one.
"""

from __future__ import annotations

from typing import Any

from spotline.bubbles.schedule import theory_fraction
from spotline.bubbles.trace import chrome_trace

_KEYS = (
    "steps",
    "step_s",
    "wait_s",
    "compute_s",
    "window_s",
    "windows",
    "open_s",
    "filled_s",
    "overrun_s",
    "beyond_s",
)
# Recorded steps each rank's timeline keeps for the trace (`spotline trace --steps`):
# every poll brings the latest few, which join the ones before up to this many.
TRACE_STEPS = 32


class BubbleBook:
    def __init__(self, stages: int):
        self.stages = stages
        self.micro_batches = 0
        self.per_stage: dict[int, dict[str, float]] = {}
        self.while_on = dict.fromkeys(_KEYS, 0.0)  # chunks run with backfill on
        self.latest: dict[int, dict[str, Any]] = {}  # rank -> its latest report
        self.last_chunk: dict[str, float] | None = None

    def add(
        self, reports: list[dict[str, Any]], micro_batches: int, backfill_on: bool = False
    ) -> None:
        if not reports:
            return
        self.micro_batches = micro_batches
        chunk = dict.fromkeys(_KEYS, 0.0)
        for r in reports:
            acc = self.per_stage.setdefault(r["stage"], dict.fromkeys(_KEYS, 0.0))
            for k in _KEYS:
                acc[k] += r.get(k, 0.0)
                chunk[k] += r.get(k, 0.0)
            if "steps_timeline" in r:  # the ranks the trace draws
                self.latest[r["rank"]] = _with_earlier_steps(r, self.latest.get(r["rank"]))
        self.last_chunk = _fractions(chunk) | {"theory": self.theory()}
        if backfill_on:
            for k in _KEYS:
                self.while_on[k] += chunk[k]

    def reset_ranks(self) -> None:
        """A new group: the old ranks' timelines no longer describe the job."""
        self.latest.clear()

    def theory(self) -> float | None:
        return theory_fraction(self.stages, self.micro_batches) if self.micro_batches else None

    def summary(self) -> dict[str, Any]:
        total = dict.fromkeys(_KEYS, 0.0)
        for acc in self.per_stage.values():
            for k in _KEYS:
                total[k] += acc[k]
        return {
            "stages": self.stages,
            "micro_batches": self.micro_batches,
            "theory": self.theory(),
            **_fractions(total),
            "per_stage": {s: _fractions(acc) for s, acc in sorted(self.per_stage.items())},
            "last_chunk": self.last_chunk,
            "while_backfill_on": _fractions(self.while_on),
        }

    def trace(self, job: str, slices: dict[int, list] | None = None) -> dict[str, Any]:
        ranks = [dict(r, slices=(slices or {}).get(rank, [])) for rank, r in self.latest.items()]
        return chrome_trace(ranks, job)


def stage_compute_s(reports: list[dict[str, Any]]) -> dict[int, float]:
    """Compute seconds per step of each stage in one poll's reports: the slowest replica
    of the stage (it sets the stage's pace)."""
    out: dict[int, float] = {}
    for r in reports:
        if r.get("steps"):
            per_step = r.get("compute_s", 0.0) / r["steps"]
            out[r["stage"]] = max(out.get(r["stage"], 0.0), per_step)
    return dict(sorted(out.items()))


def _with_earlier_steps(report: dict[str, Any], before: dict[str, Any] | None) -> dict[str, Any]:
    """`report` with the step timelines of the rank's report `before` that it does not
    carry itself, the newest `TRACE_STEPS` in step order."""
    if before is None:
        return report
    steps = {s["step"]: s for s in before.get("steps_timeline") or []}
    steps.update({s["step"]: s for s in report.get("steps_timeline") or []})
    kept = [steps[k] for k in sorted(steps)[-TRACE_STEPS:]]
    return {**report, "steps_timeline": kept}


def _fractions(acc: dict[str, float]) -> dict[str, float]:
    out = dict(acc)
    out["bubble_fraction"] = _ratio(acc["wait_s"], acc["step_s"])
    out["fill_fraction"] = _ratio(acc["filled_s"], acc["window_s"])
    out["bubble_fill_fraction"] = _ratio(acc["filled_s"], acc["wait_s"])
    out["overrun_fraction"] = _ratio(acc["overrun_s"], acc["step_s"])
    out["overrun_s_per_step"] = _ratio(acc["overrun_s"], acc["steps"])
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0
