"""One training step predicted from the spec: its time, its bubble and its MFU.

Each stage's training FLOPs per micro-batch (its blocks' 6·N + 12·T·d per token, and
the head's share on the last stage, the conventions of `spotline.metrics.mfu`; per
layer from `spotline.models.flops`) at the device's FLOP/s, played through the real
1F1B schedule (`bubbles.schedule.simulate`, backward = 2 x forward). The simulated step
gives the bubble (time stages wait on each other) as well. At a device's rate (a GPU),
data-parallel collectives and the optimizer step are not charged, so the step time is
a lower bound at that rate. A CPU job's step is played through the same schedule from
what its parts take on this host (`planning.host_step`), optimizer step and
per-pass overheads included. The trainer takes its stages' expected micro-batch times
from `stage_micro_s`.
"""

from __future__ import annotations

from dataclasses import dataclass

from spotline.config.schema import JobSpec
from spotline.metrics.mfu import mfu
from spotline.models import ModelDef, model_def
from spotline.models.flops import layer_flops_per_token
from spotline.planning.host_step import HostStep, pass_overheads, ranks_on_host
from spotline.planning.partition import stage_bounds


def stage_flops_per_token(
    spec: JobSpec, model: ModelDef | None = None, bounds: list[int] | None = None
) -> list[float]:
    """Training FLOPs per token of each pipeline stage (`layer_flops_per_token`)."""
    model = model or model_def(spec)
    per_layer = layer_flops_per_token(spec, model)
    bounds = bounds or stage_bounds(model, spec.parallel.pipeline_stages)
    return [sum(per_layer[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]


def stage_micro_s(
    spec: JobSpec,
    flops_per_s: float,
    bounds: list[int] | None = None,
    model: ModelDef | None = None,
    flops: list[float] | None = None,
) -> list[float]:
    """Seconds each pipeline stage spends on the forward and backward of one micro-batch
    at `flops_per_s` (`flops`: its `stage_flops_per_token`, when already known)."""
    flops = flops or stage_flops_per_token(spec, model, bounds)
    tokens = spec.micro_batch_size() * spec.model.seq_len
    return [f * tokens / flops_per_s for f in flops]


@dataclass(frozen=True)
class StepPrediction:
    step_s: float | None
    """Seconds per optimizer step at `flops_per_s` (None without a rate)."""
    bubble_fraction: float
    """Share of the step the stages wait on each other (0 without a pipeline)."""
    theory: float
    """(p - 1)/(m + p - 1): the bubble with equal stages."""
    backfill_s_per_step: float | None
    """Device-seconds per step the bubbles leave for backfill, over all devices."""
    mfu: float | None
    """Model FLOP/s over `peak_flops` at that step time."""


def predict_step(
    spec: JobSpec,
    replicas: int,
    flops_per_s: float | None = None,
    peak_flops: float | None = None,
    bounds: list[int] | None = None,
    host: HostStep | None = None,
) -> StepPrediction:
    """One step at `replicas`, each device running `flops_per_s` (the relative stage
    costs alone give the bubble when no rate is known), the stages cut at `bounds`
    (default: the uniform partition). `host`: a CPU job's parts measured on this host,
    which then set the stages' passes, the optimizer step and the overheads."""
    from spotline.bubbles.schedule import theory_fraction

    p, m = spec.parallel.pipeline_stages, spec.grad_accum(replicas)
    stage = stage_flops_per_token(spec, bounds=bounds)
    tokens = spec.micro_batch_size() * spec.model.seq_len
    micro_s = stage_micro_s(spec, flops_per_s or 1.0, bounds, flops=stage)
    bubble, step = _schedule(p, m, micro_s)
    if host is not None:
        # The bubble stays the stages' work played through the schedule (what the
        # partition decides); the host's measured passes set the step's time.
        share = host.share(ranks_on_host(spec, replicas))
        pass_s, step_s = pass_overheads()
        _, step = _schedule(p, m, [t / share + pass_s for t in host.micro_s])
        step += max(host.optimizer_s) / share + step_s
    devices = p * replicas
    known = flops_per_s is not None or host is not None
    util = None
    if known and peak_flops:
        util = mfu(tokens * m * replicas / step, sum(stage), devices, peak_flops)
    return StepPrediction(
        step_s=step if known else None,
        bubble_fraction=bubble,
        theory=theory_fraction(p, m) if p > 1 else 0.0,
        backfill_s_per_step=bubble * step * devices if known else None,
        mfu=util,
    )


def _schedule(p: int, m: int, micro_s: list[float]) -> tuple[float, float]:
    """(bubble fraction, seconds) of one step of `m` micro-batches through `p` stages
    whose forward and backward of one micro-batch take `micro_s`, in DeepSpeed's 1F1B."""
    from spotline.bubbles.detector import bubble_fraction
    from spotline.bubbles.schedule import simulate_passes

    if p == 1:
        return 0.0, m * micro_s[0]
    timelines = simulate_passes(p, m, micro_s)
    spans = [tl[-1].end - tl[0].start for tl in timelines]
    bubble = sum(bubble_fraction(tl) * sp for tl, sp in zip(timelines, spans, strict=True))
    return bubble / sum(spans), max(spans)
