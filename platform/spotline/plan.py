"""Predictions from the spec before launch: memory, bubble, step time, checkpoints, cost.

Arithmetic on the spec plus, optionally, a device's peak FLOP/s (a datasheet entry or a
short matmul probe); nothing starts on the cluster. The preflight refuses a job that
cannot fit with the field to change; `spotline plan` prints the whole prediction, and
the job's summary puts it beside what the run measured.

Memory per device, for the largest pipeline stage (P parameters), D replicas:
- weights w·P, gradients w·P (w = 4 bytes in fp32, 2 in bf16);
- the fp32 master copy 4·P (bf16, or any ZeRO stage >= 1) and Adam's two moments 8·P;
- ZeRO-1 splits master and moments over D, ZeRO-2 the gradients too, ZeRO-3 the weights;
- ZeRO-1/2's gradient-reduction bucket, fp32, sized to the stage (see
  `JobSpec.zero_bucket_elements`);
- activations: per micro-batch and layer 34·s·b·h bytes in 16-bit (Korthikanti et al.,
  2022; twice that in fp32); a block under activation checkpointing keeps only its
  input, s·b·h values, plus one block's whole activations while it is recomputed;
  times the micro-batches a 1F1B stage holds at once
  (p - stage), h a custom model's own width (what its embedding returns); plus, on the
  last stage, fp32 logits five times over (the loss's log-softmax, its gradient and the
  logits' gradient, and the two micro-batches' logits DeepSpeed's output buffers keep
  there). Their 5·a·s²·b term for the attention scores is left out: the built-in models
  use fused attention (`scaled_dot_product_attention`), which keeps no s x s matrix.
  Not counted: the optimizer step's temporaries, the allocator's cache, and what a
  block keeps beyond a GPT block (a Llama block keeps about 1.5x the 34·s·b·h); the
  plan says so under its figures.

Step time: each stage's training FLOPs per micro-batch (its blocks' 6·N + 12·T·d per
token, and the head's share on the last stage, the conventions of
`spotline.metrics.flops`) at the device's FLOP/s, played through the real 1F1B
schedule (`bubbles.schedule.simulate`, backward = 2 x forward). The simulated step
gives the bubble (time stages wait on each other) as well. Data-parallel collectives
and the optimizer step are not charged, so the step time is a lower bound at that rate.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from spotline.config.schema import JobSpec
from spotline.models import ModelDef, layer_param_counts, model_def, stage_bounds
from spotline.models.flops import layer_flops_per_token, model_width

ADAM_BYTES = 8  # exp_avg + exp_avg_sq, fp32
PIPE_BUFFERS = 2  # DeepSpeed's 1F1B keeps max(2, stages - stage) buffers: 2 on the last
MASTER_BYTES = 4  # fp32 master weights


def planned_device(spec: JobSpec) -> str:
    """'gpu' or 'cpu': resources.device, or for 'auto' this machine's kind (a GPU job
    planned on a machine without one is planned at fp32: the larger memory)."""
    if spec.resources.device != "auto":
        return spec.resources.device
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def precision(spec: JobSpec) -> str:
    """The precision the job trains at on its devices (`parallel.precision`, 'auto'
    resolved for `planned_device`)."""
    return spec.parallel.precision_on(planned_device(spec))


def stage_params(
    spec: JobSpec, model: ModelDef | None = None, bounds: list[int] | None = None
) -> list[int]:
    """Parameters held by each pipeline stage, cut at `bounds` (default: as DeepSpeed's
    uniform `type:` partition cuts the layer list)."""
    model = model or model_def(spec)
    counts = layer_param_counts(model)
    bounds = bounds or stage_bounds(model, spec.parallel.pipeline_stages)
    return [sum(counts[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]


@dataclass(frozen=True)
class StageMemory:
    stage: int
    params: int
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    """fp32 master weights and both Adam moments (this rank's ZeRO share)."""
    bucket_bytes: int
    """DeepSpeed's ZeRO gradient-reduction bucket(s), fp32."""
    activation_bytes: int
    """Activations of the micro-batches the stage holds at once (and the logits)."""
    micro_batches_in_flight: int

    @property
    def state_bytes(self) -> int:
        """Weights, gradients, master weights, optimizer state and the reduction bucket."""
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes + self.bucket_bytes

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes


class StageMemoryModel:
    """Predicted peak memory of one device of a stage holding any contiguous layers: what
    `memory_per_device` reports, and what the balanced partition keeps within each
    device's memory."""

    def __init__(self, spec: JobSpec, replicas: int | None = None, model: ModelDef | None = None):
        self.spec = spec
        d = replicas or spec.replica_counts()[0]
        p = spec.parallel
        z = p.zero_stage
        self.precision = precision(spec)
        w = 2 if self.precision == "bf16" else 4
        master = MASTER_BYTES if (self.precision == "bf16" or z >= 1) else 0
        self.weight = w / (d if z >= 3 else 1)
        self.grad = w / (d if z >= 2 else 1)
        self.optimizer = (master + ADAM_BYTES) / (d if z >= 1 else 1)
        self.model = model or model_def(spec)
        m = spec.model
        b, s = spec.micro_batch_size(), m.seq_len
        h = model_width(spec, self.model)
        self.per_layer = 34 * s * b * h * (w / 2)
        # A recomputed block keeps only its input (s·b·h values) until the backward
        # runs it again; then, one at a time, its whole activations are alive.
        self.recomputed_layer = s * b * h * w
        every = p.activation_checkpointing
        self.recomputed = [False] * len(self.model.layers)
        blocks = [i for i, ld in enumerate(self.model.layers) if ld.cls is self.model.block_class]
        for n, i in enumerate(blocks):
            self.recomputed[i] = bool(every) and n % every == 0
        # The last stage's logits, fp32: at the loss's backward the log-softmax output,
        # its gradient and the logits' gradient are alive at once; a pipeline's last
        # stage also keeps the logits of its last PIPE_BUFFERS micro-batches in
        # DeepSpeed's output buffers (it frees them only on the other stages).
        copies = 3 + (PIPE_BUFFERS if p.pipeline_stages > 1 else 0)
        self.logits = copies * b * s * self.model.vocab_size * 4
        self.counts = layer_param_counts(self.model)
        self.is_block = [ld.cls is self.model.block_class for ld in self.model.layers]
        self.stages = p.pipeline_stages
        self.micro = spec.grad_accum(d)

    def stage(self, stage: int, lo: int, hi: int) -> StageMemory:
        """One device of `stage` holding layers lo:hi."""
        params = sum(self.counts[lo:hi])
        in_flight = min(self.stages - stage, self.micro) if self.stages > 1 else 1
        kept = sum(
            b and not r for b, r in zip(self.is_block[lo:hi], self.recomputed[lo:hi], strict=True)
        )
        recomputed = sum(self.recomputed[lo:hi])
        act = (self.per_layer * kept + self.recomputed_layer * recomputed) * in_flight
        if recomputed:
            act += self.per_layer  # the block being recomputed in the backward
        if hi == len(self.counts):
            act += self.logits
        return StageMemory(
            stage,
            params,
            weight_bytes=math.ceil(params * self.weight),
            grad_bytes=math.ceil(params * self.grad),
            optimizer_bytes=math.ceil(params * self.optimizer),
            bucket_bytes=_bucket_bytes(self.spec, params),
            activation_bytes=math.ceil(act),
            micro_batches_in_flight=in_flight,
        )


def memory_per_device(
    spec: JobSpec, replicas: int | None = None, bounds: list[int] | None = None
) -> list[StageMemory]:
    """Predicted peak memory of one device of each stage, at `replicas` (default: the
    smallest replica count the job runs at, where ZeRO splits the least), with the
    stages cut at `bounds` (default: the uniform partition)."""
    mem = StageMemoryModel(spec, replicas)
    bounds = bounds or stage_bounds(mem.model, spec.parallel.pipeline_stages)
    return [mem.stage(s, a, b) for s, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))]


def _bucket_bytes(spec: JobSpec, params: int) -> int:
    bucket = spec.zero_bucket_elements(params)
    if bucket is None:
        return 0
    overlap = (spec.deepspeed.get("zero_optimization") or {}).get("overlap_comm", False)
    return bucket * 4 * (2 if overlap else 1)  # double-buffered when overlapping comms


def human_bytes(n: float) -> str:
    """1.2 GB, 340.0 MB, 12.0 kB: decimal units, one decimal."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


def memory_problem(spec: JobSpec, capacity: int, source: str) -> str | None:
    """Why the job's largest stage cannot fit a device of `capacity` bytes (None if it
    fits), naming the fields that would make it fit."""
    worst = max(memory_per_device(spec), key=lambda m: m.total_bytes)
    if worst.total_bytes <= capacity:
        return None
    return (
        f"model: stage {worst.stage} holds {worst.params:,} parameters and needs about "
        f"{human_bytes(worst.total_bytes)} per device ({human_bytes(worst.state_bytes)} of "
        f"weights, gradients and Adam state under ZeRO-{spec.parallel.zero_stage}, "
        f"{human_bytes(worst.activation_bytes)} of activations), but a device has "
        f"{human_bytes(capacity)} ({source}); lower model.d_model or model.n_layers, add "
        "parallel.pipeline_stages, raise parallel.zero_stage, use parallel.precision: bf16, "
        "turn on parallel.activation_checkpointing (1: every block), or lower "
        "train.global_batch_size"
    )


# --- step time and bubble -------------------------------------------------------------


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
) -> StepPrediction:
    """One step at `replicas`, each device running `flops_per_s` (the relative stage
    costs alone give the bubble when no rate is known), the stages cut at `bounds`
    (default: the uniform partition)."""
    from spotline.bubbles.detector import bubble_fraction
    from spotline.bubbles.schedule import simulate_passes, theory_fraction

    p, m = spec.parallel.pipeline_stages, spec.grad_accum(replicas)
    stage = stage_flops_per_token(spec, bounds=bounds)
    tokens = spec.micro_batch_size() * spec.model.seq_len
    micro_s = stage_micro_s(spec, flops_per_s or 1.0, bounds, flops=stage)
    if p > 1:
        timelines = simulate_passes(p, m, micro_s)
        spans = [tl[-1].end - tl[0].start for tl in timelines]
        bubble = sum(bubble_fraction(tl) * sp for tl, sp in zip(timelines, spans, strict=True))
        bubble /= sum(spans)
        step = max(spans)
    else:
        bubble, step = 0.0, m * micro_s[0]
    devices = p * replicas
    known = flops_per_s is not None
    util = None
    if known and peak_flops:
        total = sum(stage) * tokens * m * replicas
        util = total / step / (devices * peak_flops)
    return StepPrediction(
        step_s=step if known else None,
        bubble_fraction=bubble,
        theory=theory_fraction(p, m) if p > 1 else 0.0,
        backfill_s_per_step=bubble * step * devices if known else None,
        mfu=util,
    )


def checkpoint_bytes(spec: JobSpec) -> int:
    """Bytes of one committed checkpoint: full fp32 weights and both Adam moments of every
    parameter, once (per-rank RNG files are a few KB)."""
    return sum(stage_params(spec)) * (MASTER_BYTES + ADAM_BYTES)


# --- just-in-time checkpoints ------------------------------------------------------

SAVE_FIXED_S = 1.0  # host copy set-up, the receipt, the commit poll and the manifest


def save_bytes_per_rank(spec: JobSpec, replicas: int) -> int:
    """Bytes the busiest rank writes per checkpoint: its ZeRO share of the largest
    stage's fp32 master and moments (all of them at ZeRO-0, on replica 0), plus that
    stage's bf16 module weights, which replica 0 writes once per stage."""
    p = spec.parallel
    biggest = max(stage_params(spec))
    share = (MASTER_BYTES + ADAM_BYTES) * biggest / (replicas if p.zero_stage >= 1 else 1)
    if precision(spec) == "bf16":
        share += 2 * biggest
    return math.ceil(share)


def predicted_save_s(spec: JobSpec, replicas: int, bytes_per_s: float | None = None) -> float:
    """Seconds from a save request to the commit, before the job has measured its own:
    the busiest rank's bytes at `bytes_per_s` (default SPOTLINE_ASSUMED_SAVE_MB_PER_S,
    capped by checkpoint.upload_max_mb_per_s), plus a fixed part."""
    from spotline import constants

    rate = bytes_per_s or constants.SPOTLINE_ASSUMED_SAVE_MB_PER_S * 1e6
    cap = spec.checkpoint.upload_max_mb_per_s
    if cap is not None:
        rate = min(rate, cap * 1e6)
    return save_bytes_per_rank(spec, replicas) / rate + SAVE_FIXED_S


def notice_deadlines(spec: JobSpec) -> list[tuple[str, float]]:
    """(source kind, seconds) of each notice source of the job: its default_deadline_s,
    else its protocol's usual notice (aws 120 s; gcp, azure, ray-drain, sigterm 30 s)."""
    from spotline.registry import NOTICE_SOURCES

    return [
        (s.kind, float(s.default_deadline_s or NOTICE_SOURCES.load(s.kind).default_deadline_s))
        for s in spec.preemption.sources
    ]


def shortest_notice(spec: JobSpec) -> tuple[str, float] | None:
    """(source kind, seconds) of the shortest notice the job's sources give, or None
    without sources."""
    return min(notice_deadlines(spec), key=lambda n: n[1], default=None)


def jit_fit_problem(
    spec: JobSpec, replicas: int, save_s: float | None = None, step_s: float = 0.0
) -> str | None:
    """Why a just-in-time checkpoint may not commit before the shortest notice ends
    (None when it fits, or there are no sources). `save_s`/`step_s`: measured figures;
    without them, the prediction from the state size."""
    from spotline import constants

    notice = shortest_notice(spec)
    if notice is None:
        return None
    kind, deadline = notice
    margin = constants.SPOTLINE_JIT_MARGIN_S
    measured = save_s is not None
    if save_s is None:
        save_s = predicted_save_s(spec, replicas)
    need = save_s + step_s
    if need <= deadline - margin:
        return None
    mb = save_bytes_per_rank(spec, replicas) / 1e6
    how = (
        "measured"
        if measured
        else (
            f"predicted: {mb:,.0f} MB from the busiest rank at "
            f"{constants.SPOTLINE_ASSUMED_SAVE_MB_PER_S:.0f} MB/s"
        )
    )
    return (
        f"a just-in-time checkpoint at {replicas} replica(s) takes about {need:.0f}s ({how}"
        f"{f', plus a {step_s:.1f}s step' if step_s else ''}), and a {kind} notice gives "
        f"{deadline:.0f}s less a {margin:.0f}s margin: it may not commit before the node "
        "goes, and the job would resume from the previous checkpoint. Write less per rank "
        "(more replicas, or parallel.zero_stage >= 1), lift checkpoint.upload_max_mb_per_s, "
        "or lower checkpoint.interval_steps so that a lost notice costs fewer steps"
    )


# --- the whole plan ---------------------------------------------------------------------

BUBBLE_WARN_FRACTION = 0.25


@dataclass(frozen=True)
class NoticeFit:
    source: str
    deadline_s: float
    save_s: float
    """Predicted seconds from the save request to the commit (plus one step)."""
    fits: bool


@dataclass(frozen=True)
class Plan:
    """What the job will need and do, predicted before launch (`spotline plan`)."""

    name: str
    replica_counts: list[int]
    """Replica counts the batch policy allows, with their global batch and micro-batches."""
    batches: dict[int, dict[str, int]]
    replicas: int
    """The count the per-device figures below are for: the smallest, where ZeRO splits
    state the least."""
    stages: list[StageMemory]
    device_bytes: int | None
    device_source: str | None
    step: StepPrediction
    rate_source: str | None
    """Where the FLOP/s came from (a datasheet peak, a probe, --peak-tflops); None: none."""
    tokens_per_step: int
    checkpoint_bytes: int
    save_bytes_per_rank: int
    notices: list[NoticeFit]
    usd_per_1b_tokens: dict[str, float | None]
    """'spot' and 'on_demand' dollars for 1e9 tokens at the predicted step time."""
    warnings: list[str]
    adaptive_max_batch: int | None = None
    """train.adaptive.max_batch_size under the adaptive batch schedule."""
    precision: str = "fp32"
    """The precision the figures are for (parallel.precision, 'auto' resolved), whose
    peak the MFU is against."""
    activation_checkpointing: int = 0

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for st, mem in zip(out["stages"], self.stages, strict=True):
            st.update(state_bytes=mem.state_bytes, total_bytes=mem.total_bytes)
            if self.device_bytes:
                st["headroom_bytes"] = self.device_bytes - mem.total_bytes
        return out

    def render(self) -> str:
        gb = 1e9
        lines = [f"Spotline plan for {self.name}"]
        lines.append(
            "  replicas          "
            + ", ".join(
                f"{d} (batch {b['global_batch']}, {b['micro_batches']} micro-batches)"
                for d, b in self.batches.items()
            )
        )
        have = (
            f"device {self.device_bytes / gb:,.2f} GB ({self.device_source})"
            if self.device_bytes
            else "device memory unknown (set resources.device_memory_gb)"
        )
        lines.append(f"  memory per device at {self.replicas} replica(s); {have}")
        recompute = (
            f", activations recomputed in every {self.activation_checkpointing}-th block"
            if self.activation_checkpointing > 1
            else ", activations recomputed in every block"
            if self.activation_checkpointing == 1
            else ""
        )
        lines.append(f"  precision         {self.precision}{recompute}")
        for m in self.stages:
            room = (
                f", headroom {(self.device_bytes - m.total_bytes) / gb:,.2f} GB"
                if self.device_bytes
                else ""
            )
            lines.append(
                f"    stage {m.stage}: {m.params:,} params; weights {m.weight_bytes / gb:.3f}, "
                f"grads {m.grad_bytes / gb:.3f}, optimizer {m.optimizer_bytes / gb:.3f}, "
                f"bucket {m.bucket_bytes / gb:.3f}, "
                f"activations {m.activation_bytes / gb:.3f} ({m.micro_batches_in_flight} "
                f"micro-batch(es) in flight) = {m.total_bytes / gb:.3f} GB{room}"
            )
        lines.append(
            "    (not counted: the optimizer step's temporaries, the allocator's cache, and "
            "activations a block keeps beyond a GPT block's 34·s·b·h, e.g. about 1.5x for "
            "a Llama block)"
        )
        st = self.step
        if self.stages and len(self.stages) > 1:
            free = (
                f"; {st.backfill_s_per_step:.3g} device-s per step left for backfill"
                if st.backfill_s_per_step is not None
                else ""
            )
            lines.append(
                f"  bubble            {st.bubble_fraction:.1%} of each step (equal stages: "
                f"{st.theory:.1%}){free}"
            )
        if st.step_s is not None:
            mfu = f", MFU {st.mfu:.1%}" if st.mfu is not None else ""
            lines.append(
                f"  step time         {st.step_s:.3g} s at {self.rate_source}{mfu}; "
                f"{self.tokens_per_step / st.step_s:,.0f} tokens/s"
            )
        else:
            lines.append("  step time         unknown: no device FLOP/s (pass --peak-tflops)")
        if self.adaptive_max_batch is not None:
            lines.append(
                f"  adaptive batch    grows to at most {self.adaptive_max_batch} sequences: "
                "memory per device stays (the micro-batch is fixed); the step time above is "
                f"at {self.batches[self.replicas]['global_batch']} sequences and grows with "
                "the batch, the cost per token stays"
            )
        lines.append(
            f"  checkpoint        {self.checkpoint_bytes / gb:,.3f} GB; the busiest rank "
            f"writes {self.save_bytes_per_rank / gb:,.3f} GB"
        )
        for n in self.notices:
            lines.append(
                f"    {n.source} notice {n.deadline_s:.0f}s: just-in-time save about "
                f"{n.save_s:.1f}s, {'fits' if n.fits else 'does NOT fit'}"
            )
        usd = self.usd_per_1b_tokens
        if any(v is not None for v in usd.values()):
            parts = [f"${v:,.2f} {k.replace('_', '-')}" for k, v in usd.items() if v is not None]
            lines.append(f"  cost of 1B tokens {', '.join(parts)}")
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def make_plan(
    spec: JobSpec,
    device: tuple[int, str] | None = None,
    rate: tuple[float, float | None, str] | None = None,
) -> Plan:
    """The plan of `spec`. `device`: (bytes, where that figure comes from) of one device;
    `rate`: (FLOP/s a device runs at, its peak FLOP/s for MFU, where they come from)."""
    from spotline import constants
    from spotline.plan_bubble import bubble_warning, planned_bounds

    counts = spec.replica_counts()
    d = counts[0]
    flops_per_s, peak, rate_source = rate if rate else (None, None, None)
    bounds = planned_bounds(spec, d)
    step = predict_step(spec, d, flops_per_s, peak, bounds)
    tokens = spec.global_batch(d) * spec.model.seq_len
    warnings = []
    if device is not None:
        problem = memory_problem(spec, *device)
        if problem:
            warnings.append(problem)
    if step.bubble_fraction > BUBBLE_WARN_FRACTION:
        warnings.append(bubble_warning(spec, d, step, bounds))
    save_s = predicted_save_s(spec, d)
    margin = constants.SPOTLINE_JIT_MARGIN_S
    notices = []
    for kind, deadline in notice_deadlines(spec):
        need_s = save_s + (step.step_s or 0.0)
        notices.append(NoticeFit(kind, deadline, need_s, need_s <= deadline - margin))
    problem = jit_fit_problem(spec, d, step_s=step.step_s or 0.0)
    if problem:
        warnings.append(problem)
    m = spec.metrics
    usd: dict[str, float | None] = {"spot": None, "on_demand": None}
    if step.step_s is not None:
        hours = 1e9 / tokens * step.step_s * d * spec.parallel.pipeline_stages / 3600
        for key, price in (
            ("spot", m.spot_usd_per_device_hour),
            ("on_demand", m.on_demand_usd_per_device_hour),
        ):
            usd[key] = None if price is None else hours * price
    return Plan(
        name=spec.name,
        replica_counts=counts,
        batches={
            r: {"global_batch": spec.global_batch(r), "micro_batches": spec.grad_accum(r)}
            for r in counts
        },
        replicas=d,
        stages=memory_per_device(spec, d, bounds),
        device_bytes=device[0] if device else None,
        device_source=device[1] if device else None,
        step=step,
        rate_source=rate_source,
        tokens_per_step=tokens,
        checkpoint_bytes=checkpoint_bytes(spec),
        save_bytes_per_rank=save_bytes_per_rank(spec, d),
        notices=notices,
        usd_per_1b_tokens=usd,
        warnings=warnings,
        adaptive_max_batch=(
            spec.train.adaptive.max_batch_size if spec.train.batch_schedule == "adaptive" else None
        ),
        precision=precision(spec),
        activation_checkpointing=spec.parallel.activation_checkpointing,
    )


# --- stage partitions ------------------------------------------------------------------


def balanced_partition(
    spec: JobSpec,
    layer_s: list[list[float]] | list[float],
    stage_speeds: list[float],
    capacities: list[float | None] | None = None,
    replicas: int | None = None,
) -> list[int]:
    """The layer bounds whose slowest stage is fastest, with stage s running layer l in
    layer_s[s][l] / stage_speeds[s] seconds (one list: the same for every stage), holding at most capacities[s] bytes (None:
    unchecked) under `StageMemoryModel`. SpecError naming the fields when none fits."""
    from spotline.config.loader import SpecError
    from spotline.models.partition import NoPartitionFits, balanced_bounds

    mem = StageMemoryModel(spec, replicas)
    caps = capacities or [None] * len(stage_speeds)

    def fits(stage: int, lo: int, hi: int) -> bool:
        cap = caps[stage]
        return cap is None or mem.stage(stage, lo, hi).total_bytes <= cap

    try:
        return balanced_bounds(layer_s, stage_speeds, fits)
    except NoPartitionFits:
        have = ", ".join("?" if c is None else f"{c / 1e9:.1f} GB" for c in caps)
        raise SpecError(
            f"parallel.partition: no contiguous split of the {len(mem.counts)} layers over "
            f"{len(stage_speeds)} stages fits the devices' memory ({have} per stage); add "
            "parallel.pipeline_stages, raise parallel.zero_stage, use parallel.precision: "
            "bf16, turn on parallel.activation_checkpointing, lower train.global_batch_size, "
            "or give the stages more memory "
            "(resources.stages[].device_memory_gb)"
        ) from None


def choose_partition(
    spec: JobSpec,
    replicas: int,
    probes: list[dict[str, Any]] | None = None,
    pinned: list[int] | None = None,
) -> dict[str, Any]:
    """The stage partition a group of `replicas` runs, and what it was chosen from.

    `pinned` (a resumed job's recorded bounds, or a re-partition) wins; then an explicit
    parallel.partition; then, for 'balanced', the cut of the measured `probes` (one per
    rank, rank = stage x replicas + replica, from `spotline.train.profile.probe`): stage
    s's layer costs are those its replica 0 measured on its own device, its speed its
    slowest replica's matmul speed over replica 0's (devices of a stage may differ too),
    its memory the smallest device of the stage (or resources.stages[s].device_memory_gb). Else the uniform cut. SpecError naming
    parallel.partition when the bounds do not partition the model's layers.
    """
    from spotline.config.loader import SpecError
    from spotline.models.partition import (
        bounds_from_sizes,
        check_bounds,
        imbalance,
        stage_times,
    )

    p = spec.parallel
    pp = p.pipeline_stages
    model = model_def(spec)
    uniform = stage_bounds(model, pp)
    out: dict[str, Any] = {"method": p.partition if isinstance(p.partition, str) else "explicit"}
    if pinned is not None:
        bounds, out["pinned"] = list(pinned), True
    elif isinstance(p.partition, list):
        bounds = bounds_from_sizes(p.partition)
    else:
        bounds = uniform
    if probes:
        layer_s: list[list[float]] = []
        speeds: list[float] = []
        caps: list[float | None] = []
        for stage in range(pp):
            mine = [probes[stage * replicas + r] for r in range(replicas)]
            layer_s.append(mine[0]["layer_s"])
            speeds.append(min(q["flops"] for q in mine) / mine[0]["flops"])
            given = spec.resources.stage(stage).device_memory_gb
            held = [q.get("memory_bytes") for q in mine]
            caps.append(given * 1e9 if given else (None if None in held else min(held)))
        if pinned is None:
            bounds = balanced_partition(spec, layer_s, speeds, caps, replicas)
        out.update(
            layer_s=layer_s,
            stage_speeds=speeds,
            worker_flops=[q["flops"] for q in probes],
            predicted_imbalance=imbalance(stage_times(layer_s, speeds, bounds)),
            predicted_uniform_imbalance=imbalance(stage_times(layer_s, speeds, uniform)),
        )
    problem = check_bounds(bounds, len(model.layers), pp)
    if problem:
        raise SpecError(f"parallel.partition: {problem}; fix the layers per stage")
    out.update(bounds=bounds, sizes=[b - a for a, b in zip(bounds, bounds[1:], strict=False)])
    return out
