"""The job spec: pure data and its validation.

Typed sections with their cross-field checks (schema.py and one module per large
section), the batch policy (batch.py), the spec's identity and resume rules
(identity.py), the DeepSpeed keys the spec decides (deepspeed_keys.py), YAML loading
with overrides and one-line errors (loader.py), and the one redaction function
(redact.py). Every other part of Spotline (driver, controller, workers, executors)
imports it.

It must never import the runtime (train/, runtime/, controller/, checkpoint/,
planning) nor touch storage or the network, and it has no side effects at import or
validation time: validating a spec, twice or in a test, changes nothing. The one
explicit step with an effect is `loader.register_spec_secrets`, which a spec loaded
to run takes (`load_spec`, `validate_dict`, `spotline.Job`, an actor opening its
spec) so that redaction masks its secrets in free text.
"""

from spotline.config.backfill import (
    BackfillSpec,
    DraftSpec,
    EvalTaskSpec,
    SpeculativeTaskSpec,
    TaskSpec,
)
from spotline.config.failure import FailureSpec
from spotline.config.loader import (
    SpecError,
    apply_overrides,
    load_spec,
    parse_override_list,
    validate_dict,
)
from spotline.config.model import (
    LLAMA_PRESETS,
    CustomModelSpec,
    GptModelSpec,
    LlamaModelSpec,
    ModelSpec,
    TokenizerSpec,
)
from spotline.config.preemption import NoticeSourceSpec, PreemptionSpec
from spotline.config.recovery import RecoverySpec
from spotline.config.redact import redact
from spotline.config.resources import ResourcesSpec
from spotline.config.schema import CheckpointSpec, JobSpec, MetricsSpec, RuntimeEnvSpec
from spotline.config.sections import DataSourceSpec, DataSpec, ElasticSpec, ParallelSpec, TrainSpec
from spotline.config.tracking import (
    MlflowTrackerSpec,
    TensorBoardTrackerSpec,
    TrackerSpec,
    WandbTrackerSpec,
)

__all__ = [
    "LLAMA_PRESETS",
    "BackfillSpec",
    "CheckpointSpec",
    "CustomModelSpec",
    "DataSourceSpec",
    "DataSpec",
    "DraftSpec",
    "ElasticSpec",
    "EvalTaskSpec",
    "FailureSpec",
    "RecoverySpec",
    "GptModelSpec",
    "JobSpec",
    "LlamaModelSpec",
    "MetricsSpec",
    "MlflowTrackerSpec",
    "ModelSpec",
    "NoticeSourceSpec",
    "ParallelSpec",
    "PreemptionSpec",
    "ResourcesSpec",
    "RuntimeEnvSpec",
    "SpecError",
    "SpeculativeTaskSpec",
    "TaskSpec",
    "TensorBoardTrackerSpec",
    "TokenizerSpec",
    "TrackerSpec",
    "TrainSpec",
    "WandbTrackerSpec",
    "apply_overrides",
    "load_spec",
    "parse_override_list",
    "redact",
    "validate_dict",
]
