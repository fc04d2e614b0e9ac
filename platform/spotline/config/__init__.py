"""The job spec: typed sections, YAML loading with overrides, and redaction.

A leaf package: it imports nothing from the runtime, so every other part of
Spotline (driver, controller, workers, executors) can import it.
"""

from spotline.config.backfill import (
    BackfillSpec,
    DraftSpec,
    EvalTaskSpec,
    SpeculativeTaskSpec,
    TaskSpec,
)
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
from spotline.config.redact import redact
from spotline.config.schema import (
    CheckpointSpec,
    DataSourceSpec,
    DataSpec,
    ElasticSpec,
    FailureSpec,
    JobSpec,
    MetricsSpec,
    ParallelSpec,
    ResourcesSpec,
    RuntimeEnvSpec,
    TrainSpec,
)
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
