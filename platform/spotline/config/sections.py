"""The sections of a job spec that its batch policy and identity read: data, parallel,
elastic and train. `JobSpec` (`config.schema`) composes them with the rest; the batch
policy (`config.batch`) and the identity rules (`config.identity`) sit between them.
Pure data: no side effects."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from spotline.config.urls import check_http_url
from spotline.registry import DATASETS

_ENDPOINT_EXAMPLE = "http://127.0.0.1:9000 or https://s3.eu-west-1.amazonaws.com"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataSourceSpec(_Section):
    """One prepared token dataset of a mixture."""

    uri: str
    """Where `spotline prepare` wrote it (a directory or fsspec URI holding index.json)."""
    weight: float = Field(1.0, gt=0.0)
    """Share of the sequences drawn from this source (weights are normalised)."""
    index_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    """The dataset's identity: sha256 of its index.json. Filled in by the preflight; if
    you set it, the index must match."""


class DataSpec(_Section):
    """Where training tokens come from and how they are sampled.

    kind 'tokens' trains on datasets `spotline prepare` wrote (sharded uint16/uint32
    token files and an index), memory-mapped from a node-local cache that fills on
    demand: no process ever holds a dataset in RAM, and the preflight reads only the
    index. kind 'text' (the quickstart) reads a small text corpus whole at start-up and
    tokenizes it with the job's tokenizer.
    """

    kind: str = "text"
    """'text' or 'tokens' (or 'package.module:attr')."""
    corpus: str = "stdlib"
    """text: 'stdlib' (the source of Python's own standard library: no network needed),
    a local directory or file, or an fsspec URI (file://, s3://) of text files."""
    max_bytes: int = Field(8_000_000, gt=0)
    """text: read at most this many bytes of the corpus (files in sorted order)."""
    file_suffixes: list[str] = Field(default_factory=lambda: [".py", ".txt", ".md", ".rst"])
    """text: only files with these suffixes are read from a directory corpus."""
    uri: str | None = None
    """tokens: one prepared dataset, shorthand for sources: [{uri: ...}] (it is stored as
    that)."""
    sources: list[DataSourceSpec] = Field(default_factory=list)
    """tokens: a weighted mixture of prepared datasets."""

    @model_validator(mode="before")
    @classmethod
    def _uri_is_one_source(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and raw.get("uri") is not None:
            if raw.get("sources"):
                raise ValueError("data: give data.uri or data.sources, not both")
            raw = {**raw, "sources": [{"uri": raw["uri"]}], "uri": None}
        return raw

    cache_dir: str = "/tmp/spotline-data"
    """tokens: node-local directory the shards are cached in (shared by the ranks of a
    node; each shard is downloaded once and verified against its sha256)."""
    prefetch: bool = True
    """Build the next step's micro-batches on a background thread while a step runs."""
    heldout_fraction: float = Field(0.05, gt=0.0, lt=0.5)
    """Tail fraction of every source (or the corpus) kept out of training, for held-out
    loss."""
    seed: int = 1234
    """Seed of the sampler. Batch k depends only on (seed, k), so sampling resumes exactly."""
    endpoint_url: str | None = None
    """s3:// corpora only: endpoint of an S3-compatible service (MinIO, on-prem, a test
    server). Independent of checkpoint.endpoint_url: data and checkpoints may live in
    different places."""
    storage_options: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for the corpus's fsspec filesystem (s3:// only), e.g.
    {profile: data-reader}. Never logged: every value is masked in messages."""

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        return None if v is None else check_http_url(v, "data.endpoint_url", _ENDPOINT_EXAMPLE)

    @model_validator(mode="after")
    def _kind_fields(self) -> DataSpec:
        DATASETS.check(self.kind, "data.kind")
        if self.kind == "tokens":
            if not self.sources:
                raise ValueError(
                    "data.uri is required for data.kind 'tokens': where `spotline prepare` "
                    "wrote the dataset (or data.sources for a mixture)"
                )
        elif self.sources:
            raise ValueError(
                f"data.uri / data.sources are for data.kind 'tokens' (this is {self.kind!r}); "
                "set data.kind: tokens, or use data.corpus for text"
            )
        return self

    def token_sources(self) -> list[DataSourceSpec]:
        """The prepared datasets of a 'tokens' job (data.uri is stored as one source)."""
        return list(self.sources)


class ParallelSpec(_Section):
    """How one replica of the model is laid out on devices."""

    pipeline_stages: int = Field(1, ge=1)
    """Pipeline stages (p) per replica. p > 1 uses DeepSpeed's PipelineModule with a 1F1B
    schedule and ZeRO-1."""
    micro_batches: int = Field(4, ge=1)
    """Micro-batches per step (m) at elastic.max_replicas: the 1F1B schedule depth when
    p > 1, gradient accumulation steps when p = 1. The micro-batch size is fixed at
    global_batch_size / (m x max_replicas); with fewer replicas the constant batch policy
    runs more micro-batches per step (see elastic.batch_policy)."""
    zero_stage: Literal[0, 1, 2, 3] = 1
    """ZeRO stage. Pipelines allow 0 or 1; pp=1 allows 0-3."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Training precision. bf16 keeps fp32 master weights in the optimizer. 'auto': bf16
    on GPUs (where fp32 runs on CUDA cores, about 10x below the bf16 tensor-core peak;
    TF32 is on there for any fp32 matmul left), fp32 on CPU. Decided at every group
    start, with the device (see resources.device); checkpoints load at either."""
    activation_checkpointing: int = Field(0, ge=0)
    """Recompute activations in the backward instead of keeping them: every k-th block
    of the whole model (blocks 0, k, 2k, ...) keeps only its input. 0: off; 1: every
    block (the least memory, about a third more compute). Works at any pipeline cut and
    ZeRO stage, and does not change the losses (beyond floating-point rounding)."""
    compile: bool = False
    """`torch.compile` each block. Off by default: it costs a compilation at every group
    start, and its gain on a GPU is measured by benchmarks/gpu_check.py before it is
    made the default there. Does not change the losses beyond floating-point rounding."""
    partition: Literal["uniform", "balanced"] | list[int] = "uniform"
    """Which layers each pipeline stage holds (the layer list counts the embedding and the
    head too: a GPT of n_layers blocks has n_layers + 2). 'uniform': blocks split evenly,
    as DeepSpeed's `type:` partition cuts them. 'balanced': at start-up every worker's
    speed and every layer's forward + backward time are measured, and the layers are cut
    so that the slowest stage is as fast as it can be within each device's memory; while
    the job runs, a stage imbalance above rebalance_threshold re-partitions it at a
    checkpoint boundary when the restart pays for itself; a resume keeps the bounds its
    checkpoint recorded. A list: layers per stage, e.g. [3, 3] (never re-partitioned by
    itself). Every checkpoint records the bounds it was trained at; any checkpoint loads
    at any partition."""
    rebalance_threshold: float = Field(0.10, gt=0.0)
    """Re-partition a 'balanced' pipeline when the slowest stage's compute time exceeds the
    mean stage's by more than this fraction (max / mean - 1) for rebalance_window_steps."""
    rebalance_window_steps: int = Field(20, gt=0)
    """Steps the imbalance must stay above rebalance_threshold before re-partitioning."""

    def precision_on(self, device: str) -> Literal["fp32", "bf16"]:
        """The precision in force on `device` ('gpu' or 'cpu')."""
        if self.precision != "auto":
            return self.precision
        return "bf16" if device == "gpu" else "fp32"

    @field_validator("partition", mode="before")
    @classmethod
    def _partition_sizes(cls, v: Any) -> Any:
        listed = isinstance(v, list) and all(isinstance(n, int) for n in v)
        if not listed and v not in ("uniform", "balanced"):
            raise ValueError(
                f"parallel.partition must be 'uniform', 'balanced' or a list of layers per "
                f"stage such as [3, 3] (got {v!r})"
            )
        if listed and (not v or any(n < 1 for n in v)):
            raise ValueError(
                f"parallel.partition {v} must list at least one layer per stage, e.g. [3, 3]; "
                "or use 'uniform' or 'balanced'"
            )
        return v


class ElasticSpec(_Section):
    """Data-parallel replicas (each is pipeline_stages devices). A fixed size is min = max."""

    min_replicas: int = Field(1, ge=1)
    """Never run with fewer replicas than this; wait for capacity instead."""
    max_replicas: int = Field(1, ge=1)
    """Never run with more replicas than this."""
    batch_policy: Literal["constant", "scaled"] = "constant"
    """How the global batch follows the replica count D. 'constant': every step trains on
    train.global_batch_size sequences at any D, by running (m x max_replicas / D)
    micro-batches per step of a fixed size, so the training math does not depend on how
    many replicas survive; the job runs only at the D that divide m x max_replicas (the
    largest that fits), e.g. 1, 2, 4, 8, 16 for m=4, max_replicas=16. 'scaled': every
    replica runs m micro-batches, so the global batch is global_batch_size x D /
    max_replicas, and the learning rate follows the square-root rule for Adam:
    lr x sqrt(D / max_replicas)."""
    wait_for_capacity_s: float = Field(600.0, gt=0.0)
    """Below min_replicas, wait this long for capacity to come back, then fail."""


class AdaptiveBatchSpec(_Section):
    """Bounds and smoothing of train.batch_schedule 'adaptive'.

    The global batch starts at min_batch_size and, at each checkpoint boundary
    (every checkpoint.interval_steps), grows toward the gradient noise scale B_simple,
    in whole micro-batches at every replica count, at most doubling per boundary and
    never shrinking, up to max_batch_size. The learning rate follows the square-root
    rule for Adam: lr x sqrt(batch / min_batch_size).
    """

    min_batch_size: int | None = Field(None, gt=0)
    """Sequences per step to start at. None: train.global_batch_size."""
    max_batch_size: int | None = Field(None, gt=0)
    """Sequences per step never to exceed (required with batch_schedule 'adaptive')."""
    ema_decay: float = Field(0.95, gt=0.0, lt=1.0)
    """Decay of the moving averages of the |G|^2 and tr(Sigma) estimates, per step."""


class TrainSpec(_Section):
    """The optimisation run."""

    steps: int = Field(300, gt=0)
    """Optimizer steps in the whole job."""
    global_batch_size: int = Field(16, gt=0)
    """Sequences per optimizer step, over all replicas and micro-batches. It also sets
    the micro-batch size (global_batch_size / (parallel.micro_batches x
    elastic.max_replicas)), under either batch_schedule."""
    batch_schedule: Literal["fixed", "adaptive"] = "fixed"
    """'fixed': every step trains on the batch the elastic.batch_policy gives. 'adaptive':
    the batch grows from the gradient noise scale at checkpoint boundaries, within
    train.adaptive's bounds (needs elastic.batch_policy 'constant' and
    parallel.zero_stage 1)."""
    adaptive: AdaptiveBatchSpec = Field(default_factory=AdaptiveBatchSpec)
    """Bounds and smoothing of the adaptive schedule."""
    lr: float = Field(3e-3, gt=0.0)
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """Cosine decay ends at lr * min_lr_ratio."""
    warmup_steps: int = Field(20, ge=0)
    """Linear warm-up steps before the cosine decay."""
    weight_decay: float = Field(0.1, ge=0.0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, ge=0.0)
    """Gradient-norm clip; 0 disables it."""
    seed: int = 42
    """Seed of the model initialisation and of every rank's RNG."""
    log_every: int = Field(10, gt=0)
    """Report progress every this many steps."""
    eval_batches: int = Field(4, gt=0)
    """Held-out batches evaluated for the final held-out loss."""
