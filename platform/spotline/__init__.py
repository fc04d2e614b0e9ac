"""Spotline: elastic LLM training on preemptible GPUs, on Ray and DeepSpeed."""

from spotline.job import Job, JobFailed, JobResult, JobRun, SubmittedJob
from spotline.spec import JobSpec, SpecError, load_spec

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
