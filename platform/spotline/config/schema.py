"""The typed job spec: one pydantic model per section, docs next to each field.

Everything a worker needs is derived from a validated `JobSpec`. Checks that need
only the spec live here (cross-field rules), with the batch policy (`config.batch`),
identity and resume rules (`config.identity`) and the DeepSpeed keys the spec decides
(`config.deepspeed_keys`) beside it. Checks that touch the outside world (storage,
credentials, the corpus) live in `spotline.preflight`. Validation has no side effect.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from spotline.config.backfill import BackfillSpec
from spotline.config.batch import BatchPolicy
from spotline.config.deepspeed_keys import check_deepspeed_keys, zero_bucket_elements
from spotline.config.failure import FailureSpec
from spotline.config.identity import SpecIdentity
from spotline.config.model import GptModelSpec, ModelSpec, TokenizerSpec
from spotline.config.preemption import PreemptionSpec
from spotline.config.recovery import RecoverySpec
from spotline.config.resources import ResourcesSpec
from spotline.config.tracking import TrackerSpec, check_kinds
from spotline.config.urls import CHECKPOINT_SCHEMES, READ_SCHEMES, check_http_url, check_scheme
from spotline.registry import DATASETS

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
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


class ResumeFromSpec(_Section):
    """A committed checkpoint of another job (or another URI) to start this job from."""

    uri: str
    """Checkpoint root URI of the source (the source job's resolved checkpoint.uri),
    read with this job's endpoint_url and storage_options."""
    step: int | None = Field(None, gt=0)
    """The committed step to start from; None: the newest committed step there."""


class CheckpointSpec(_Section):
    """Where and how often checkpoints are committed."""

    uri: str = "file://./spotline-runs/{job}/checkpoints"
    """Any fsspec URI: file:// (default) or s3://bucket/prefix. '{job}' is replaced by the job
    name. A URI that already holds committed checkpoints of this job is resumed from."""
    interval_steps: int = Field(100, gt=0)
    """Commit a checkpoint every this many steps (and always at the end)."""
    keep_last: int = Field(3, ge=1)
    """Committed checkpoints to keep; older ones are deleted after a newer one commits."""
    upload_max_mb_per_s: float | None = Field(None, gt=0.0)
    """Cap on each rank's background upload rate (MB/s), so checkpoint uploads leave
    network for training's collectives on a shared NIC. None: no cap."""
    staging_dir: str = "/tmp/spotline-staging"
    """Node-local directory where ranks save before the background upload."""
    endpoint_url: str | None = None
    """S3 only: endpoint of an S3-compatible service (MinIO, on-prem, a test server)."""
    storage_options: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for the S3 filesystem (s3fs), e.g. {profile: ckpt-writer}
    or {key: ..., secret: ...}. Local paths take none. Never logged: every value is
    masked in messages, and `spotline submit` hands them to the job as environment
    variables, not on its command line."""
    signing_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Name of an environment variable holding a key (at least 16 bytes) to sign every
    manifest with HMAC-SHA256. A restore then refuses a manifest whose signature does
    not verify, before it reads any file: whoever can write the bucket but not read the
    key cannot make the job load their files. The key itself never goes into the spec
    or the bucket; set the variable on every node (and in the driver)."""
    resume_from: ResumeFromSpec | None = None
    """Start from this committed checkpoint when checkpoint.uri holds none of its own (a
    branch of a run, or a PBT exploit): weights, optimizer state, step and data position
    come from it; the model, tokenizer and data must be the same (the spec hash), and
    only `RETUNABLE_FIELDS` may differ. Once this job commits, it resumes from its own."""

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        return (
            None if v is None else check_http_url(v, "checkpoint.endpoint_url", _ENDPOINT_EXAMPLE)
        )

    @field_validator("uri")
    @classmethod
    def _uri_shape(cls, v: str) -> str:
        if not v.strip():
            raise ValueError(
                "checkpoint.uri is empty; use e.g. file:///data/ckpt or s3://bucket/prefix"
            )
        return v


class RuntimeEnvSpec(_Section):
    """User code the job's actors need (a custom model provider, a custom tokenizer or
    dataset): shipped with Ray's runtime_env to the controller, every worker and every
    backfill executor, on every path (SDK, CLI and `ray job submit`)."""

    working_dir: str | None = None
    """A local directory uploaded with the job and put on every actor's sys.path (also
    on the driver's, for the preflight's import)."""
    py_modules: list[str] = Field(default_factory=list)
    """Local package directories (or wheels) uploaded with the job and importable by it."""
    excludes: list[str] = Field(default_factory=list)
    """Patterns of files in working_dir not to upload (gitignore syntax)."""

    def ray(self) -> dict[str, Any] | None:
        """The runtime_env dict Ray takes (absolute paths), or None when empty."""
        import os

        env: dict[str, Any] = {}
        if self.working_dir:
            env["working_dir"] = os.path.abspath(os.path.expanduser(self.working_dir))
        if self.py_modules:
            env["py_modules"] = [os.path.abspath(os.path.expanduser(m)) for m in self.py_modules]
        if self.excludes and env:
            env["excludes"] = list(self.excludes)
        return env or None


class MetricsSpec(_Section):
    """Cost figures of the goodput ledger, and deviation alerts."""

    spot_usd_per_device_hour: float | None = Field(None, ge=0.0)
    """What one device-hour costs on the spot capacity this job runs on. None: the
    ledger reports device-hours only."""
    on_demand_usd_per_device_hour: float | None = Field(None, ge=0.0)
    """What one device-hour would cost on-demand, to price the same steps without
    preemptions. None: not priced."""
    deviation_threshold: float = Field(0.15, gt=0.0)
    """Alert when step time is this much above its baseline (or tokens/s this much below)."""
    deviation_sustain_steps: int = Field(20, gt=0)
    """...for at least this many consecutive steps."""
    deviation_warmup_steps: int = Field(20, ge=0)
    """Steps ignored at the start (compilation, caches, warm-up lr) before the baseline."""
    deviation_baseline_steps: int = Field(20, gt=0)
    """Steps that set the baseline after the warm-up."""


class JobSpec(_Section, BatchPolicy, SpecIdentity):
    """A whole Spotline job.

    Its batch arithmetic comes from `BatchPolicy` (spotline.config.batch), its hash and
    resume rules from `SpecIdentity` (spotline.config.identity); the DeepSpeed config
    a group runs with is `spotline.train.ds_config.deepspeed_config(spec, replicas)`.
    """

    name: str = "spotline-job"
    """Job name: names the controller actor (spotline:<name>:controller) and the checkpoint path."""
    model: ModelSpec = Field(default_factory=GptModelSpec)
    tokenizer: TokenizerSpec = Field(default_factory=TokenizerSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    elastic: ElasticSpec = Field(default_factory=ElasticSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    failure: FailureSpec = Field(default_factory=FailureSpec)
    recovery: RecoverySpec = Field(default_factory=RecoverySpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    preemption: PreemptionSpec = Field(default_factory=PreemptionSpec)
    backfill: BackfillSpec = Field(default_factory=BackfillSpec)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)
    runtime_env: RuntimeEnvSpec = Field(default_factory=RuntimeEnvSpec)
    tracking: list[TrackerSpec] = Field(default_factory=list)
    """Experiment trackers the job's run appears in: {kind: tensorboard, dir},
    {kind: mlflow, tracking_uri, experiment}, {kind: wandb, project, entity, mode, dir}.
    Credentials come from the environment only. Not part of the training math."""
    deepspeed: dict[str, Any] = Field(default_factory=dict)
    """Extra DeepSpeed config keys merged over the derived config (advanced)."""

    @field_validator("name")
    @classmethod
    def _name_shape(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError(
                f"name {v!r} must be 1-63 letters, digits, '_', '.' or '-', starting with a "
                "letter or digit (it names an actor and a storage path)"
            )
        return v

    @field_validator("tracking", mode="before")
    @classmethod
    def _tracker_kinds(cls, v: Any) -> Any:
        return check_kinds(v)

    @model_validator(mode="after")
    def _uri_schemes(self) -> JobSpec:
        """Every URI of the spec in a scheme Spotline reads (or writes), checked here so
        that `hdfs://...` is one line at load, not a failure deep in a library."""
        d, c = self.data, self.checkpoint
        uris = [("checkpoint.uri", c.uri, CHECKPOINT_SCHEMES)]
        if c.resume_from is not None:
            uris.append(("checkpoint.resume_from.uri", c.resume_from.uri, CHECKPOINT_SCHEMES))
        if d.kind == "text":
            uris.append(("data.corpus", d.corpus, READ_SCHEMES))
        for i, src in enumerate(d.sources):
            field = "data.uri" if len(d.sources) == 1 else f"data.sources[{i}].uri"
            uris.append((field, src.uri, READ_SCHEMES))
        if self.tokenizer.path:
            uris.append(("tokenizer.path", self.tokenizer.path, READ_SCHEMES))
        if getattr(self.model, "init_from", None):
            uris.append(("model.init_from", self.model.init_from, READ_SCHEMES))
        for field, value, schemes in uris:
            check_scheme(value, field, schemes)
        return self

    @model_validator(mode="after")
    def _cross_checks(self) -> JobSpec:
        p = self.parallel
        e = self.elastic
        if e.min_replicas > e.max_replicas:
            raise ValueError(
                f"elastic.min_replicas ({e.min_replicas}) must be <= elastic.max_replicas "
                f"({e.max_replicas}); raise max_replicas or lower min_replicas"
            )
        n_layers = getattr(self.model, "n_layers", None)  # a custom provider's: preflight
        if n_layers is not None and p.pipeline_stages > n_layers:
            raise ValueError(
                f"parallel.pipeline_stages ({p.pipeline_stages}) must be <= model.n_layers "
                f"({n_layers}): each stage needs at least one transformer block; "
                "lower pipeline_stages or add layers"
            )
        if getattr(self.model, "tie_embeddings", False) and p.pipeline_stages > 1:
            raise ValueError(
                f"model.tie_embeddings needs parallel.pipeline_stages: 1 (got "
                f"{p.pipeline_stages}): the embedding and the head would sit on different "
                "stages; set model.tie_embeddings: false (the head gets its own weights)"
            )
        given, known = getattr(self.model, "vocab_size", None), self.tokenizer.vocab_size
        if given is not None and known is not None and given < known:
            raise ValueError(
                f"model.vocab_size ({given}) is smaller than the tokenizer's vocabulary "
                f"({known}); raise model.vocab_size or leave it out to take the tokenizer's"
            )
        if isinstance(p.partition, list):
            layers = n_layers + 2 if n_layers is not None else None  # embedding and head
            if len(p.partition) != p.pipeline_stages or (
                layers is not None and sum(p.partition) != layers
            ):
                raise ValueError(
                    f"parallel.partition {p.partition} must give the layers of each of the "
                    f"{p.pipeline_stages} pipeline stage(s)"
                    + (
                        f", summing to the model's {layers} layers (embedding, model.n_layers "
                        f"blocks, head)"
                        if layers is not None
                        else ""
                    )
                    + "; fix the list, or use 'uniform' or 'balanced'"
                )
        if self.resources.stages and len(self.resources.stages) != p.pipeline_stages:
            raise ValueError(
                f"resources.stages has {len(self.resources.stages)} entries but "
                f"parallel.pipeline_stages is {p.pipeline_stages}: give one per stage, or none"
            )
        if p.pipeline_stages > 1 and p.zero_stage > 1:
            raise ValueError(
                f"parallel.zero_stage={p.zero_stage} cannot be combined with "
                f"parallel.pipeline_stages={p.pipeline_stages}: DeepSpeed pipelines support "
                "ZeRO stage 0 or 1 only; set zero_stage: 1, or pipeline_stages: 1 for ZeRO-2/3"
            )
        self._check_batch()
        check_deepspeed_keys(self)
        bf = self.backfill
        if bf.enabled and p.pipeline_stages < 2:
            raise ValueError(
                "backfill.enabled needs parallel.pipeline_stages >= 2: backfill fills the "
                "idle windows of a pipeline, and a job with one stage has none; set "
                "pipeline_stages: 2 or more, or backfill.enabled: false"
            )
        for i, task in enumerate(bf.tasks):
            if task.kind == "speculative" and task.max_new_tokens >= self.model.seq_len:
                raise ValueError(
                    f"backfill.tasks[{i}].max_new_tokens ({task.max_new_tokens}) must be < "
                    f"model.seq_len ({self.model.seq_len}): prompt and completion must fit "
                    "in the model's context; lower max_new_tokens"
                )
        return self

    # --- derived -----------------------------------------------------------------

    def vocab_size(self) -> int:
        """The model's vocabulary: model.vocab_size, else the tokenizer's."""
        given = getattr(self.model, "vocab_size", None)
        if given is not None:
            return given
        if self.tokenizer.vocab_size is not None:
            return self.tokenizer.vocab_size
        if self.tokenizer.kind == "byte":
            return 256
        raise ValueError(
            "the vocabulary size is not known yet: the preflight reads it from the "
            "tokenizer (or set model.vocab_size)"
        )

    def resolved_checkpoint_uri(self) -> str:
        return self.checkpoint.uri.replace("{job}", self.name)

    def zero_bucket_elements(self, stage_params: int) -> int | None:
        """ZeRO's gradient-reduction bucket on every rank of a stage of `stage_params`
        parameters (see `spotline.config.deepspeed_keys.zero_bucket_elements`)."""
        return zero_bucket_elements(self, stage_params)

    def on_device(self, device: str) -> JobSpec:
        """This spec as it trains on `device` ('gpu' or 'cpu'): parallel.precision
        decided ('auto' resolved); unchanged when nothing is left to decide."""
        precision = self.parallel.precision_on(device)
        if precision == self.parallel.precision:
            return self
        return self.model_copy(
            update={"parallel": self.parallel.model_copy(update={"precision": precision})}
        )
