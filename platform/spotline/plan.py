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

from spotline.config.schema import JobSpec
from spotline.models import ModelDef, layer_param_counts, model_def, stage_bounds

ADAM_BYTES = 8  # exp_avg + exp_avg_sq, fp32
MASTER_BYTES = 4  # fp32 master weights


def stage_params(spec: JobSpec, model: ModelDef | None = None) -> list[int]:
    """Parameters held by each pipeline stage, cut as DeepSpeed cuts the layer list."""
    model = model or model_def(spec)
    counts = layer_param_counts(model)
    bounds = stage_bounds(model, spec.parallel.pipeline_stages)
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


def memory_per_device(spec: JobSpec, replicas: int | None = None) -> list[StageMemory]:
    """Predicted peak memory of one device of each stage, at `replicas` (default: the
    smallest replica count the job runs at, where ZeRO splits the least)."""
    d = replicas or spec.replica_counts()[0]
    p = spec.parallel
    z = p.zero_stage
    w = 2 if p.precision == "bf16" else 4
    master = MASTER_BYTES if (p.precision == "bf16" or z >= 1) else 0
    per_param = (
        w / (d if z >= 3 else 1)
        + w / (d if z >= 2 else 1)
        + (master + ADAM_BYTES) / (d if z >= 1 else 1)
    )
    model = model_def(spec)
    m = spec.model
    b, s = spec.micro_batch_size(), m.seq_len
    # Width and heads of the built-in kinds; a custom model is charged as if d = 1024.
    h, heads = getattr(m, "d_model", 1024), getattr(m, "n_heads", 16)
    per_layer = s * b * h * (34 + 5 * heads * s / h) * (w / 2)
    bounds = stage_bounds(model, p.pipeline_stages)
    is_block = [ld.cls is model.block_class for ld in model.layers]
    micro = spec.grad_accum(d)
    out = []
    for stage, params in enumerate(stage_params(spec, model)):
        in_flight = min(p.pipeline_stages - stage, micro) if p.pipeline_stages > 1 else 1
        blocks = sum(is_block[bounds[stage] : bounds[stage + 1]])
        act = per_layer * blocks * in_flight
        if stage == p.pipeline_stages - 1:
            act += 2 * b * s * model.vocab_size * 4  # fp32 logits and their gradient
        out.append(StageMemory(stage, params, math.ceil(params * per_param), math.ceil(act)))
    return out


def checkpoint_bytes(spec: JobSpec) -> int:
    """Bytes of one committed checkpoint: full fp32 weights and both Adam moments of every
    parameter, once (per-rank RNG files are a few KB)."""
    return sum(stage_params(spec)) * (MASTER_BYTES + ADAM_BYTES)
