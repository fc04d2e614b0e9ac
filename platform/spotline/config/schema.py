"""The typed job spec: one pydantic model per section, docs next to each field.

Everything a worker needs is derived from a validated `JobSpec`. Checks that need
only the spec live here (cross-field rules), with the batch policy (`config.batch`),
identity and resume rules (`config.identity`) and the DeepSpeed keys the spec decides
(`config.deepspeed_keys`) beside it. Checks that touch the outside world (storage,
credentials, the corpus) live in `spotline.preflight`. Validation has no side effect.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator, model_validator

from spotline.config.backfill import BackfillSpec
from spotline.config.batch import BatchPolicy
from spotline.config.deepspeed_keys import check_deepspeed_keys, zero_bucket_elements
from spotline.config.failure import FailureSpec
from spotline.config.identity import SpecIdentity
from spotline.config.model import GptModelSpec, ModelSpec, TokenizerSpec
from spotline.config.preemption import PreemptionSpec
from spotline.config.recovery import RecoverySpec
from spotline.config.resources import ResourcesSpec
from spotline.config.sections import (
    _ENDPOINT_EXAMPLE,
    DataSpec,
    ElasticSpec,
    ParallelSpec,
    TrainSpec,
    _Section,
)
from spotline.config.tracking import TrackerSpec, check_kinds
from spotline.config.urls import CHECKPOINT_SCHEMES, READ_SCHEMES, check_http_url, check_scheme

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


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
