"""Predictions from the spec alone: memory per device and bytes per checkpoint.

Pure arithmetic on the spec (no Ray, no torch), so the preflight can refuse a job that
cannot fit before anything starts, and name the field to change.

Memory per device, for the largest pipeline stage (P parameters), D replicas:
- weights w·P, gradients w·P (w = 4 bytes in fp32, 2 in bf16);
- the fp32 master copy 4·P (bf16, or any ZeRO stage >= 1) and Adam's two moments 8·P;
- ZeRO-1 splits master and moments over D, ZeRO-2 the gradients too, ZeRO-3 the weights;
- activations: per micro-batch and layer s·b·h·(34 + 5·a·s/h) bytes in 16-bit
  (Korthikanti et al., 2022; twice that in fp32), times the micro-batches a 1F1B stage
  holds at once (p - stage), plus the logits on the last stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from spotline.config.schema import JobSpec
from spotline.models import ModelDef, layer_param_counts, model_def, stage_bounds

ADAM_BYTES = 8  # exp_avg + exp_avg_sq, fp32
MASTER_BYTES = 4  # fp32 master weights


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
    state_bytes: int
    """Weights, gradients, master weights and optimizer state on one device."""
    activation_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes


class StageMemoryModel:
    """Predicted peak memory of one device of a stage holding any contiguous layers: what
    `memory_per_device` reports, and what the balanced partition keeps within each
    device's memory."""

    def __init__(self, spec: JobSpec, replicas: int | None = None, model: ModelDef | None = None):
        d = replicas or spec.replica_counts()[0]
        p = spec.parallel
        z = p.zero_stage
        w = 2 if p.precision == "bf16" else 4
        master = MASTER_BYTES if (p.precision == "bf16" or z >= 1) else 0
        self.per_param = (
            w / (d if z >= 3 else 1)
            + w / (d if z >= 2 else 1)
            + (master + ADAM_BYTES) / (d if z >= 1 else 1)
        )
        self.model = model or model_def(spec)
        m = spec.model
        b, s = spec.micro_batch_size(), m.seq_len
        # Width and heads of the built-in kinds; a custom model is charged as if d = 1024.
        h, heads = getattr(m, "d_model", 1024), getattr(m, "n_heads", 16)
        self.per_layer = s * b * h * (34 + 5 * heads * s / h) * (w / 2)
        self.logits = 2 * b * s * self.model.vocab_size * 4  # fp32 logits and their gradient
        self.counts = layer_param_counts(self.model)
        self.is_block = [ld.cls is self.model.block_class for ld in self.model.layers]
        self.stages = p.pipeline_stages
        self.micro = spec.grad_accum(d)

    def stage(self, stage: int, lo: int, hi: int) -> StageMemory:
        """One device of `stage` holding layers lo:hi."""
        params = sum(self.counts[lo:hi])
        in_flight = min(self.stages - stage, self.micro) if self.stages > 1 else 1
        act = self.per_layer * sum(self.is_block[lo:hi]) * in_flight
        if hi == len(self.counts):
            act += self.logits
        return StageMemory(stage, params, math.ceil(params * self.per_param), math.ceil(act))


def memory_per_device(
    spec: JobSpec, replicas: int | None = None, bounds: list[int] | None = None
) -> list[StageMemory]:
    """Predicted peak memory of one device of each stage, at `replicas` (default: the
    smallest replica count the job runs at, where ZeRO splits the least), with the
    stages cut at `bounds` (default: the uniform partition)."""
    mem = StageMemoryModel(spec, replicas)
    bounds = bounds or stage_bounds(mem.model, spec.parallel.pipeline_stages)
    return [mem.stage(s, a, b) for s, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))]


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
    if p.precision == "bf16":
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


def shortest_notice(spec: JobSpec) -> tuple[str, float] | None:
    """(source kind, seconds) of the shortest notice the job's sources give, or None
    without sources. A source's default_deadline_s, else its protocol's usual notice
    (aws 120 s; gcp, azure, ray-drain and sigterm 30 s)."""
    from spotline.registry import NOTICE_SOURCES

    out = None
    for s in spec.preemption.sources:
        d = s.default_deadline_s or NOTICE_SOURCES.load(s.kind).default_deadline_s
        if out is None or d < out[1]:
            out = (s.kind, float(d))
    return out


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
            "bf16, lower train.global_batch_size, or give the stages more memory "
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
