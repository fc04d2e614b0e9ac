"""The job spec: typed models, YAML loading, overrides, and preflight checks."""

from spotline.spec.loader import SpecError, apply_overrides, load_spec, parse_override_list
from spotline.spec.models import (
    CheckpointSpec,
    DataSpec,
    ElasticSpec,
    FailureSpec,
    JobSpec,
    ModelSpec,
    ParallelSpec,
    ResourcesSpec,
    TrainSpec,
)

__all__ = [
    "CheckpointSpec",
    "DataSpec",
    "ElasticSpec",
    "FailureSpec",
    "JobSpec",
    "ModelSpec",
    "ParallelSpec",
    "ResourcesSpec",
    "SpecError",
    "TrainSpec",
    "apply_overrides",
    "load_spec",
    "parse_override_list",
]
