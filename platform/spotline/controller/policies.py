"""Small policies that return decisions; the controller carries them out.

Policies hold no Ray handles and do no I/O, so they are unit-tested as plain
functions of their inputs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Restart:
    """Tear the group down and start a new one from the latest committed checkpoint."""

    reason: str


@dataclass(frozen=True)
class Fail:
    """Give up: the job ends in FAILED with this reason."""

    reason: str


@dataclass(frozen=True)
class Resize:
    """Start (or restart) the group with this many data-parallel replicas."""

    replicas: int


@dataclass(frozen=True)
class Wait:
    """Not enough capacity for min_replicas yet: wait and ask again."""

    reason: str


class FailurePolicy:
    """Restart after a worker failure until max_failures restarts were used (-1: never stop)."""

    def __init__(self, max_failures: int):
        self.max_failures = max_failures

    def decide(self, failures: int, error: str) -> Restart | Fail:
        """`failures` counts failures so far, this one included."""
        if self.max_failures < 0 or failures <= self.max_failures:
            budget = "unlimited" if self.max_failures < 0 else f"{failures}/{self.max_failures}"
            return Restart(f"restart {budget} after: {error}")
        return Fail(
            f"job failed after {failures} worker failures (failure.max_failures={self.max_failures}); "
            f"last error: {error}\nRaise failure.max_failures, or fix the cause above and resubmit: "
            "the job resumes from its latest committed checkpoint."
        )


class ScalingPolicy:
    """Size the group from live capacity, within [min_replicas, max_replicas].

    `capacity` is how many whole replicas the live, schedulable devices can hold now.
    """

    def __init__(self, min_replicas: int, max_replicas: int):
        self.min_replicas = min_replicas
        self.max_replicas = max_replicas

    def decide(self, capacity: int) -> Resize | Wait:
        if capacity >= self.min_replicas:
            return Resize(min(capacity, self.max_replicas))
        return Wait(
            f"the cluster can hold {capacity} replica(s) now; elastic.min_replicas is "
            f"{self.min_replicas}. Waiting for capacity (add nodes, or lower min_replicas)."
        )
