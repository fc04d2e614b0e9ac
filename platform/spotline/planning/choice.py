"""Which cut of the layers a job runs at, and which `spotline plan` predicts at.

`choose_partition` is the runtime's choice for a worker group (a pinned cut wins, then
the spec's layer counts, then, for `partition: balanced`, the cut of the layer times
the ranks measured at start-up, within each stage's memory); `planned_bounds` is the
plan's (the FLOP-balanced cut stands in for the measurement). The arithmetic of the
cuts is `spotline.planning.partition`'s.
"""

from __future__ import annotations

from typing import Any

from spotline.config.loader import SpecError
from spotline.config.schema import JobSpec
from spotline.models import model_def
from spotline.planning.memory_model import StageMemoryModel
from spotline.planning.partition import (
    NoPartitionFits,
    balanced_bounds,
    bounds_from_sizes,
    check_bounds,
    imbalance,
    sizes_from_bounds,
    stage_bounds,
    stage_times,
)
from spotline.planning.step import stage_flops_per_token


def balanced_partition(
    spec: JobSpec,
    layer_s: list[list[float]] | list[float],
    stage_speeds: list[float],
    capacities: list[float | None] | None = None,
    replicas: int | None = None,
) -> list[int]:
    """The layer bounds whose slowest stage is fastest, with stage s running layer l in
    layer_s[s][l] / stage_speeds[s] seconds (one list: the same for every stage),
    holding at most capacities[s] bytes (None: unchecked) under `StageMemoryModel`.
    SpecError naming the fields when none fits."""
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
    its memory the smallest device of the stage (or resources.stages[s].device_memory_gb).
    Else the uniform cut. SpecError naming parallel.partition when the bounds do not
    partition the model's layers.
    """
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
    out.update(bounds=bounds, sizes=sizes_from_bounds(bounds))
    return out


def planned_bounds(spec: JobSpec, replicas: int) -> list[int]:
    """The stage bounds the job is planned at: parallel.partition's layer counts, the
    cut that evens out the stages' FLOPs for 'balanced' (what its start-up measurement
    finds on equal devices), else DeepSpeed's uniform cut."""
    if spec.parallel.partition == "balanced" and spec.parallel.pipeline_stages > 1:
        return flops_balanced_bounds(spec)
    return choose_partition(spec, replicas)["bounds"]


def flops_balanced_bounds(spec: JobSpec) -> list[int]:
    """The contiguous cut of the layers whose busiest stage does the least work."""
    model = model_def(spec)
    per_layer = stage_flops_per_token(spec, model, list(range(len(model.layers) + 1)))
    return balanced_bounds(per_layer, [1.0] * spec.parallel.pipeline_stages)
