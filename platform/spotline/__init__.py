"""Spotline: elastic LLM training on preemptible GPUs, on Ray and DeepSpeed.

The names below load on first use (PEP 562), so a process that needs one small part
of the package (a state keeper, the controller, a CLI that only reads a spec) does
not import torch and DeepSpeed to reach it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spotline.config import JobSpec, SpecError, load_spec
    from spotline.job import Job, JobRun, SubmittedJob
    from spotline.job_outcome import JobFailed, JobResult

_HOMES = {
    "Job": "spotline.job",
    "JobFailed": "spotline.job_outcome",
    "JobResult": "spotline.job_outcome",
    "JobRun": "spotline.job",
    "SubmittedJob": "spotline.job",
    "JobSpec": "spotline.config",
    "SpecError": "spotline.config",
    "load_spec": "spotline.config",
}

__all__ = [
    "Job",
    "JobFailed",
    "JobResult",
    "JobRun",
    "JobSpec",
    "SpecError",
    "SubmittedJob",
    "load_spec",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'spotline' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
