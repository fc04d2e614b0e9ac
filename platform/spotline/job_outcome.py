"""How a driver tells the end of a job: what it did (`JobResult`), the errors it raises,
and where running the job again resumes. Apart from `spotline.job`, so that a command
that runs no job (`spotline status`, `report`, `--help`) loads neither torch nor the
planner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class JobResult:
    name: str
    state: str
    steps: int
    losses: dict[int, float]
    final_train_loss: float | None
    heldout_loss: float | None
    steps_per_s: float
    tokens_per_s: float
    checkpoint_uri: str
    committed_steps: list[int]
    failures: int
    wall_s: float
    attempts: list[dict[str, Any]] = field(default_factory=list)
    checkpoint_blocked_s: list[float] = field(default_factory=list)
    checkpoint_upload_s: list[float] = field(default_factory=list)
    checkpoint_bytes: list[int] = field(default_factory=list)
    skipped_saves: list[int] = field(default_factory=list)
    """Periodic checkpoints skipped because an earlier one was still uploading."""
    error: str | None = None
    notices: list[dict[str, Any]] = field(default_factory=list)
    """Preemption notices and what came of each (JIT step, notice-to-commit seconds)."""
    node_losses: int = 0
    resizes: list[dict[str, Any]] = field(default_factory=list)
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    """Each restart: why, and seconds from the interruption to the first step after it."""
    waited_s: float = 0.0
    """Seconds spent below elastic.min_replicas waiting for capacity."""
    bubbles: dict[str, Any] | None = None
    """Pipelines: measured bubble fraction vs (p-1)/(m+p-1), and the fill, overall and
    per stage. None when pipeline_stages = 1."""
    backfill: dict[str, Any] | None = None
    """Backfill tasks with their results, and the governor's baseline and slowdown."""
    ledger: dict[str, Any] | None = None
    """Goodput ledger: device-seconds by part (useful, bubble, stall, recovery, ...)."""
    cost: dict[str, Any] | None = None
    """Dollars on spot, and for the same steps on-demand (metrics.*_usd_per_device_hour)."""
    alerts: list[str] = field(default_factory=list)
    """Sustained performance deviations the controller warned about."""
    plan: dict[str, Any] | None = None
    """The plan's predictions (memory per stage, bubble, step time, MFU) beside the
    measured values, at the replica count measured (see `spotline.planning`)."""
    batch: dict[str, Any] | None = None
    """The global batch at the end: schedule, global_batch_size, noise_scale (adaptive),
    and history ([[first_step, global_batch], ...])."""
    partition: dict[str, Any] | None = None
    """Pipelines: the stage partition in force (layer bounds, how they were chosen, the
    measured stage compute times and their imbalance) and every re-partition."""
    tracking: list[dict[str, Any]] = field(default_factory=list)
    """Per experiment tracker of `tracking:`: kind, run key, errors and dropped updates."""
    health: dict[str, Any] | None = None
    """The last group's ranks (heartbeat, phase, compute per step), its stragglers, the
    hangs declared and the nodes cordoned."""
    peer_memory: dict[str, Any] | None = None
    """Peer copies (`recovery`): every how many steps and why, their cost and share of
    training, the newest step copied, and each restore from them."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobResult:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def summary(self) -> str:
        def fmt(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.4f}"

        last = self.committed_steps[-1] if self.committed_steps else None
        where = f"{self.checkpoint_uri}/step_{last:08d}" if last is not None else "none committed"
        blocked = (
            f"{sum(self.checkpoint_blocked_s) / len(self.checkpoint_blocked_s):.2f}s"
            if self.checkpoint_blocked_s
            else "n/a"
        )
        return "\n".join(
            [
                f"Spotline job {self.name}: {self.state}",
                f"  steps             {self.steps}",
                f"  throughput        {self.steps_per_s:.2f} steps/s, {self.tokens_per_s:,.0f} tokens/s",
                f"  train loss        {fmt(self.final_train_loss)} (first step: "
                f"{fmt(self.losses[min(self.losses)] if self.losses else None)})",
                f"  held-out loss     {fmt(self.heldout_loss)}",
                f"  worker failures   {self.failures}",
                f"  spot              {len(self.notices)} notice(s), {self.node_losses} node(s) "
                f"lost, {len(self.resizes)} resize(s)",
                f"  checkpoint save   {blocked} blocked per checkpoint (upload runs in background)",
                f"  checkpoints       {where}",
                f"  committed steps   {self.committed_steps}",
                *self._bubble_lines(),
                *self._goodput_lines(),
                *self._plan_lines(),
            ]
        )

    def _plan_lines(self) -> list[str]:
        if not self.plan or not self.plan.get("predicted"):
            return []
        pred, meas = self.plan["predicted"], self.plan["measured"]

        def pair(key: str, fmt) -> str:
            a, b = pred.get(key), meas.get(key)
            return f"{fmt(a) if a is not None else 'n/a'} planned, {fmt(b) if b is not None else 'n/a'} measured"

        lines = [f"  plan vs run       at {self.plan['replicas']} replica(s):"]
        for stage, planned in pred["memory_bytes"].items():
            got = meas["memory_bytes"].get(stage) or meas["memory_bytes"].get(str(stage))
            lines.append(
                f"    stage {stage} memory  {planned / 1e9:.3f} GB planned, "
                + (f"{got / 1e9:.3f} GB measured" if got else "not measured")
            )
        lines.append(f"    step time       {pair('step_s', lambda x: f'{x:.3g}s')}")
        if pred.get("step_basis"):
            lines.append(f"      planned from  {pred['step_basis']}")
        lines.append(f"    bubble          {pair('bubble_fraction', lambda x: f'{x:.1%}')}")
        lines.append(f"    MFU             {pair('mfu', lambda x: f'{x:.1%}')}")
        return lines

    def _goodput_lines(self) -> list[str]:
        if not self.ledger:
            return []
        line = f"  goodput           {self.ledger['goodput']:.1%} of device time was useful compute"
        if self.cost and self.cost.get("spot") is not None:
            line += f"; ${self.cost['spot']:.2f} on spot"
            if self.cost.get("on_demand_same_steps") is not None:
                line += f" vs ${self.cost['on_demand_same_steps']:.2f} on-demand"
        return [line, *[f"  alert             {a}" for a in self.alerts]]

    def _bubble_lines(self) -> list[str]:
        lines = []
        b = self.bubbles
        if b and b.get("theory") is not None:
            line = (
                f"  pipeline bubble   {b['bubble_fraction']:.1%} measured vs "
                f"{b['theory']:.1%} (p-1)/(m+p-1)"
            )
            if self.backfill:
                line += f"; {b['fill_fraction']:.1%} filled by backfill"
            lines.append(line)
        bf = self.backfill
        if bf:
            slow = bf.get("slowdown")
            lines.append(
                f"  backfill          {bf['done']} task(s) done, {bf['failed']} failed; "
                f"step slowdown {'n/a' if slow is None else f'{slow:+.1%}'}"
            )
            for t in bf["tasks"]:
                r = t.get("result") or {}
                if t["state"] == "done" and r.get("kind") == "eval":
                    lines.append(
                        f"    eval @ step {r['step']}: loss {r['loss']:.4f}, "
                        f"perplexity {r['perplexity']:.2f}"
                    )
        return lines


def resume_hint(latest: int | None, seen: bool = False) -> str:
    """Where running a job again starts, given the newest step this run committed
    (`seen`: as far as the driver saw it, so a newer one may have landed since)."""
    if latest is None:
        return "this run committed no step: running the job again starts where this run did"
    if seen:
        return (
            f"the latest commit seen is step {latest}: running the job again resumes there "
            "(or from a newer commit)"
        )
    return f"the latest commit is step {latest}: running the job again resumes there"


class StopTimedOut(RuntimeError):
    """A stop asked with a grace (`JobRun.stop_soon`) did not end the job in time; the
    driver ended it at once."""


class JobFailed(RuntimeError):
    """The job ended in FAILED. `.result` holds what it did before failing."""

    def __init__(self, message: str, result: JobResult):
        super().__init__(message)
        self.result = result
