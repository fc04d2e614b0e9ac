"""How a driver tells the end of a job: the errors it raises, and where running the job
again resumes. Apart from `spotline.job`, so that a command that runs no job (`spotline
status`, `report`, `--help`) loads neither torch nor the planner."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spotline.job import JobResult


def resume_hint(latest: int | None, seen: bool = False) -> str:
    """Where running a job again starts, given the newest step this run committed
    (`seen`: as far as the driver saw it, so a newer one may have landed since)."""
    if latest is None:
        return "this run committed no step: running the job again starts where this run did"
    if seen:
        return (
            f"the latest commit seen is step {latest}: running the job again resumes there "
            "(or from a newer commit)"
        )
    return f"the latest commit is step {latest}: running the job again resumes there"


class StopTimedOut(RuntimeError):
    """A stop asked with a grace (`JobRun.stop_soon`) did not end the job in time; the
    driver ended it at once."""


class JobFailed(RuntimeError):
    """The job ended in FAILED. `.result` holds what it did before failing."""

    def __init__(self, message: str, result: JobResult):
        super().__init__(message)
        self.result = result
