"""Stage re-partition: when a pipeline's measured imbalance justifies new stage bounds.

`RebalancePolicy` decides from plain figures (no Ray, no I/O) whether re-partitioning
pays; `PartitionBook` keeps what the decision reads and what the job reports about
partitions: the bounds the next group starts with, each stage's measured compute
time over the latest polls, and every re-partition with its outcome. The controller
carries a decision out: it saves at the next checkpoint boundary and restarts there.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

from spotline.bubbles.book import stage_compute_s
from spotline.controller.policies import next_boundary, restart_pays
from spotline.planning.partition import imbalance

# How often a running job looks at its stages' imbalance.
CHECK_S = 2.0


@dataclass(frozen=True)
class Repartition:
    """Restart the group at the next checkpoint boundary with these stage bounds."""

    bounds: list[int]
    measured_imbalance: float
    predicted_imbalance: float
    speedup: float


class RebalancePolicy:
    """Whether to re-partition a pipeline whose stages take unequal compute time.

    The imbalance (slowest stage / mean - 1, see `spotline.planning.partition.imbalance`)
    must have stayed above `threshold` over the latest `window_steps` steps. Each stage's
    speed is then what its measured compute time says it is: the measured cost of its
    layers / its measured seconds. `cut(speeds)` gives the bounds that balance those
    speeds (memory included); the step is expected to speed up by the slowest stage's
    time now over the slowest stage's predicted time, and the restart must pay for
    itself under `restart_pays`, the same rule a grow obeys.
    """

    def __init__(self, threshold: float, window_steps: int):
        self.threshold = threshold
        self.window_steps = window_steps

    def decide(
        self,
        *,
        window: list[tuple[int, float]],
        stage_s: list[float],
        bounds: list[int],
        layer_s: list[list[float]] | list[float],
        cut,
        steps_left: int,
        steps_per_s: float,
        restart_s: float,
        running_s: float,
    ) -> Repartition | None:
        """`window`: (step, imbalance) of the latest polls, oldest first; `stage_s`: each
        stage's measured compute seconds per step over that window."""
        from spotline.planning.partition import cost_rows, stage_times

        if not window or window[-1][0] - window[0][0] < self.window_steps:
            return None
        recent = [imb for step, imb in window if step > window[-1][0] - self.window_steps]
        if min(recent) <= self.threshold or min(stage_s) <= 0:
            return None
        rows = cost_rows(layer_s, len(stage_s))
        work = [sum(rows[s][a:b]) for s, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))]
        speeds = [w / t for w, t in zip(work, stage_s, strict=True)]
        new = list(cut(speeds))
        if new == list(bounds):
            return None
        predicted = stage_times(layer_s, speeds, new)
        speedup = max(stage_s) / max(predicted)
        if not restart_pays(steps_left, steps_per_s, steps_per_s * speedup, restart_s, running_s):
            return None
        return Repartition(new, imbalance(stage_s), imbalance(predicted), speedup)


@dataclass(frozen=True)
class Leave:
    """Save at `step` (a checkpoint boundary), then restart the group at `bounds`."""

    step: int
    bounds: list[int]
    detail: str


def sizes(bounds: list[int]) -> list[int]:
    return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]


class PartitionBook:
    def __init__(self, spec, event):
        self.spec = spec
        self._event = event
        self.repartitions: list[dict[str, Any]] = []
        """Each re-partition: at which step, from and to which bounds, the imbalance
        measured before it and predicted after (the group after it measures the rest)."""
        self.current: dict[str, Any] = {}
        """The partition the live (or latest) group runs: bounds, how they were chosen,
        and the stage compute time it measured. Replaced whole, never changed in place."""
        p = spec.parallel
        self.policy = (
            RebalancePolicy(p.rebalance_threshold, p.rebalance_window_steps)
            if p.partition == "balanced" and p.pipeline_stages > 1
            else None
        )
        # The stage bounds the next group starts with (a restart keeps the live group's,
        # a re-partition sets new ones); None: the group chooses by parallel.partition.
        self.pin: list[int] | None = None
        self._read = False  # the newest checkpoint's recorded bounds were read
        # (step, imbalance, per-stage compute s/step) of the live group's latest polls.
        self.window: deque[tuple[int, float, list[float]]] = deque(maxlen=256)
        self._checked = 0.0

    def for_start(self, recorded) -> list[int] | None:
        """The bounds a new group starts with. A resumed balanced job trains at the
        bounds its checkpoint was trained at (a uniform or explicit partition is the
        spec's own, whatever was recorded); `recorded()` reads them, once."""
        if not self._read and self.spec.parallel.partition == "balanced":
            self._read = True
            self.pin = self.pin or recorded()
        return self.pin

    def started(self, info: dict[str, Any]) -> None:
        """Note the partition a new group runs (`info`: the group's)."""
        part = dict(info)
        last = self.repartitions[-1] if self.repartitions else None
        if last is not None and last["outcome"] == "restarting":
            self.update(-1, outcome="done")
            part["repartition"] = len(self.repartitions) - 1
        self.current = part
        self.window.clear()
        if not info.get("bounds") or self.spec.parallel.pipeline_stages < 2:
            return
        how = info.get("method", "?") + (" (kept from before)" if info.get("pinned") else "")
        predicted = info.get("predicted_imbalance")
        extra = (
            f"; predicted stage imbalance {predicted:.1%} (uniform: "
            f"{info['predicted_uniform_imbalance']:.1%})"
            if predicted is not None
            else ""
        )
        self._event(f"stage partition {how}: layers per stage {info['sizes']}{extra}")

    def measure(self, reports: list[dict[str, Any]], step: int) -> None:
        """Each stage's compute seconds per step in this poll, and their imbalance."""
        per_stage = stage_compute_s(reports)
        pp = self.spec.parallel.pipeline_stages
        if len(per_stage) != pp or not self.current:
            return
        stage_s = [per_stage[s] for s in range(pp)]
        steps = max(int(r.get("steps", 0)) for r in reports)
        self.window.append((step, imbalance(stage_s), stage_s))
        old = self.current.get("measured", {"steps": 0, "stage_s": [0.0] * pp})
        total = [a + s * steps for a, s in zip(old["stage_s"], stage_s, strict=True)]
        n = old["steps"] + steps
        measured = {
            "steps": n,
            "stage_s": total,
            "stage_s_per_step": [a / n for a in total],
            "imbalance": imbalance(total),
        }
        self.current = {**self.current, "measured": measured}
        if "repartition" in self.current:  # a re-partitioned group: the imbalance after
            self.update(self.current["repartition"], measured_imbalance_after=measured["imbalance"])

    def update(self, index: int, **fields: Any) -> None:
        """Replace (never change in place: status() reads from another thread)."""
        self.repartitions[index] = {**self.repartitions[index], **fields}

    def rebalance(
        self,
        *,
        now: float,
        step: int,
        replicas: int,
        restart_s: float | None,
        steps_per_s: float,
        running_s: float,
    ) -> Leave | None:
        """Leave for a re-partition at the next checkpoint boundary when the measured stage
        imbalance stayed over parallel.rebalance_threshold and the restart pays."""
        policy = self.policy
        if policy is None or now - self._checked < CHECK_S:
            return None
        self._checked = now
        info = self.current
        if restart_s is None or "layer_s" not in info or not self.window:
            return None
        from spotline.planning.choice import balanced_partition

        window = [(s, imb) for s, imb, _ in self.window]
        first = window[-1][0] - policy.window_steps
        rows = [s for at, _, s in self.window if at > first]
        stage_s = [sum(col) / len(rows) for col in zip(*rows, strict=True)]
        decision = policy.decide(
            window=window,
            stage_s=stage_s,
            bounds=info["bounds"],
            layer_s=info["layer_s"],
            cut=lambda speeds: balanced_partition(
                self.spec, info["layer_s"], speeds, replicas=replicas
            ),
            steps_left=self.spec.train.steps - step,
            steps_per_s=steps_per_s,
            restart_s=restart_s,
            running_s=running_s,
        )
        if decision is None:
            return None
        return self.leave(
            decision.bounds,
            step,
            steps_per_s=steps_per_s,
            why=f"stage imbalance {decision.measured_imbalance:.1%} over "
            f"{policy.window_steps} steps > parallel.rebalance_threshold "
            f"{policy.threshold:.0%}; predicted imbalance {decision.predicted_imbalance:.1%}, "
            f"{decision.speedup:.2f}x faster stages (restart cost {restart_s:.1f}s)",
            measured_imbalance=decision.measured_imbalance,
            predicted_imbalance=decision.predicted_imbalance,
            predicted_speedup=decision.speedup,
            restart_cost_s=restart_s,
        )

    def asked(self, asked: list[int] | None, step: int) -> Leave | None:
        """A re-partition asked for (`request_repartition`), at the next boundary."""
        if asked is None:
            return None
        from spotline.planning.partition import bounds_from_sizes, check_bounds

        bounds = bounds_from_sizes(asked)
        current = self.current.get("bounds") or []
        problem = check_bounds(
            bounds, current[-1] if current else 0, self.spec.parallel.pipeline_stages
        )
        if problem or bounds == current:
            self._event(
                f"re-partition to layers per stage {asked} ignored: "
                + (problem or "that is the partition in force"),
                logging.WARNING,
            )
            return None
        window = [imb for _, imb, _ in self.window]
        return self.leave(
            bounds, step, "asked for", measured_imbalance=window[-1] if window else None
        )

    def leave(
        self, bounds: list[int], step: int, why: str, steps_per_s: float = 0.0, **figures: Any
    ) -> Leave:
        """Record a re-partition to `bounds` at the checkpoint boundary after `step` (the
        ranks run ahead of it at `steps_per_s`: `policies.next_boundary`)."""
        interval = self.spec.checkpoint.interval_steps
        boundary = next_boundary(step, interval, steps_per_s, self.spec.train.steps)
        before = self.current.get("bounds") or []
        self.repartitions.append(
            {
                "step": boundary,
                "from_bounds": list(before),
                "to_bounds": list(bounds),
                "why": why,
                **figures,
                "outcome": "waiting for the checkpoint boundary",
            }
        )
        detail = f"re-partition, layers per stage {sizes(before)} -> {sizes(bounds)}: {why}"
        return Leave(boundary, list(bounds), detail)

    def restarting(self, bounds: tuple[int, ...] | None, step: int) -> str:
        """The group saved at the boundary: the next one starts at `bounds`."""
        self.pin = list(bounds or ())
        self.update(-1, step=step, outcome="restarting")
        return f"re-partition to layers per stage {sizes(self.pin)}"

    def summary(self) -> dict[str, Any] | None:
        """The partition in force (the live or latest group's), with its measured
        imbalance, and every re-partition so far."""
        if not self.current or self.spec.parallel.pipeline_stages < 2:
            return None
        now = self.current
        measured = now.get("measured", {})
        return {
            "method": now.get("method"),
            "bounds": now.get("bounds"),
            "sizes": now.get("sizes"),
            "predicted_imbalance": now.get("predicted_imbalance"),
            "predicted_uniform_imbalance": now.get("predicted_uniform_imbalance"),
            "measured_imbalance": measured.get("imbalance"),
            "stage_compute_s": measured.get("stage_s_per_step"),
            "repartitions": list(self.repartitions),
        }
