"""Memory per device of each pipeline stage, predicted from the spec before launch.

Arithmetic on the spec and the model's layer list (counted on the meta device);
nothing is allocated and nothing starts on the cluster. The preflight refuses a job
whose largest stage cannot fit (`memory_problem`), `spotline plan` prints the
figures, and the balanced partition keeps each stage within its devices' memory
(`StageMemoryModel`).

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from spotline.config.schema import JobSpec
from spotline.models import ModelDef, layer_param_counts, model_def
from spotline.models.flops import model_width
from spotline.planning.partition import stage_bounds
from spotline.units import human_bytes

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
