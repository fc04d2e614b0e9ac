"""Deviation alerts: a sustained change of step time or tokens/s against the baseline.

After `warmup_steps`, the next `baseline_steps` steps set the job's baseline step
time and tokens/s (and the replica count they were measured at). A step time
more than `threshold` above its baseline, or tokens/s that far below, for
`sustain_steps` consecutive steps raises one alert per metric, with the likely
cause when the controller can tell (fewer replicas, backfill, a slow stage); it
re-arms when the job is back within the threshold.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median


@dataclass(frozen=True)
class Alert:
    metric: str
    baseline: float
    current: float
    change: float  # relative change in the bad direction, e.g. 0.2 = 20% worse
    cause: str
    steps: int

    def message(self) -> str:
        return (
            f"{self.metric} has been {self.change:.0%} worse than its baseline for "
            f"{self.steps} steps ({self.current:.4g} vs {self.baseline:.4g}); "
            f"likely cause: {self.cause}"
        )


class DeviationMonitor:
    def __init__(
        self, threshold: float, sustain_steps: int, warmup_steps: int, baseline_steps: int = 20
    ):
        self.threshold = threshold
        self.sustain = sustain_steps
        self.warmup = warmup_steps
        self.baseline_steps = baseline_steps
        self.baseline: dict[str, float] = {}  # "step_s", "tokens_per_s"
        self.baseline_replicas: int | None = None
        self._collect: list[tuple[int, float, float]] = []
        self._seen = 0
        self._bad: dict[str, int] = {"step_s": 0, "tokens_per_s": 0}
        self._alerted: dict[str, bool] = {"step_s": False, "tokens_per_s": False}
        self.alerts: list[Alert] = []

    def observe(
        self, steps: int, seconds: float, tokens: float, replicas: int, cause: str
    ) -> list[Alert]:
        """One chunk of `steps` steps and `tokens` tokens in `seconds`; new alerts."""
        if steps <= 0 or seconds <= 0:
            return []
        self._seen += steps
        if self._seen <= self.warmup:
            return []
        now = {"step_s": seconds / steps, "tokens_per_s": tokens / seconds}
        if not self.baseline:
            self._collect.append((steps, now["step_s"], now["tokens_per_s"]))
            if sum(n for n, _, _ in self._collect) >= self.baseline_steps:
                self.baseline = {
                    "step_s": median(s for _, s, _ in self._collect),
                    "tokens_per_s": median(t for _, _, t in self._collect),
                }
                self.baseline_replicas = replicas
            return []
        worse = {
            "step_s": now["step_s"] / self.baseline["step_s"] - 1.0,
            "tokens_per_s": 1.0 - now["tokens_per_s"] / self.baseline["tokens_per_s"],
        }
        if self.baseline_replicas is not None and replicas < self.baseline_replicas:
            cause = f"fewer replicas ({replicas}, baseline measured at {self.baseline_replicas})"
        new = []
        for metric, change in worse.items():
            if change <= self.threshold:
                self._bad[metric] = 0
                self._alerted[metric] = False
                continue
            self._bad[metric] += steps
            if self._bad[metric] >= self.sustain and not self._alerted[metric]:
                self._alerted[metric] = True
                name = "step time (s)" if metric == "step_s" else "tokens/s"
                alert = Alert(
                    name, self.baseline[metric], now[metric], change, cause, self._bad[metric]
                )
                self.alerts.append(alert)
                new.append(alert)
        return new


def likely_cause(
    backfill_slowdown: float | None,
    max_slowdown: float | None,
    stage_compute_s: dict[int, float] | None,
    uploading: bool = False,
) -> str:
    """The controller's best guess from what it measures (fewer replicas is checked by
    the monitor itself, against the replica count of its baseline)."""
    if (
        backfill_slowdown is not None
        and max_slowdown is not None
        and backfill_slowdown > max_slowdown
    ):
        return f"backfill (slowing steps by {backfill_slowdown:.1%}; its governor narrows it)"
    if stage_compute_s and len(stage_compute_s) > 1:
        slowest = max(stage_compute_s, key=lambda s: stage_compute_s[s])
        others = [v for k, v in stage_compute_s.items() if k != slowest]
        if stage_compute_s[slowest] > 1.3 * median(others):
            return (
                f"a slow stage (stage {slowest} computes {stage_compute_s[slowest]:.3g}s per "
                f"step, the others {median(others):.3g}s)"
            )
    if uploading:
        return (
            "checkpoint uploads running beside training (checkpoint.upload_max_mb_per_s caps them)"
        )
    return "unknown (the machine, the data, or other work on the same devices)"
