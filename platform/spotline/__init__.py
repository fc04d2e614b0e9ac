"""Spotline: elastic LLM training on preemptible GPUs, on Ray and DeepSpeed."""

from spotline.config import JobSpec, SpecError, load_spec
from spotline.job import Job, JobFailed, JobResult, JobRun, SubmittedJob

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
