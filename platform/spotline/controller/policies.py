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
    `sizes` are the replica counts the job can run at (all of [min, max] unless the
    batch policy allows only some, see `JobSpec.replica_counts`); the largest one that
    fits is chosen.
    """

    def __init__(self, min_replicas: int, max_replicas: int, sizes: list[int] | None = None):
        self.min_replicas = min_replicas
        self.max_replicas = max_replicas
        self.sizes = sorted(sizes or range(min_replicas, max_replicas + 1))

    def fit(self, capacity: int) -> int | None:
        """The largest allowed replica count that `capacity` holds, if any."""
        fitting = [d for d in self.sizes if d <= capacity]
        return fitting[-1] if fitting else None

    def decide(self, capacity: int) -> Resize | Wait:
        size = self.fit(capacity)
        if size is not None:
            return Resize(size)
        return Wait(
            f"the cluster can hold {capacity} replica(s) now; elastic.min_replicas is "
            f"{self.min_replicas}. Waiting for capacity (add nodes, or lower min_replicas)."
        )


class GrowPolicy:
    """Whether to restart a running group at a bigger size, at a checkpoint boundary.

    The rule: grow from D to D' replicas only when
      1. at least `interval_s` passed since the last resize (the configured cadence), and
      2. the time the bigger group saves over the remaining steps is more than twice the
         measured restart cost:
             steps_left / r(D) - steps_left / r(D') > 2 x restart_s
         where r(D) is the current steps per second and r(D') the rate this job measured
         at D' replicas before, or r(D) x D'/D when it has not run at D' yet.
    The factor 2 leaves margin for capacity that leaves again soon after it came.
    """

    def __init__(self, scaling: ScalingPolicy, interval_s: float):
        self.scaling = scaling
        self.interval_s = interval_s

    def decide(
        self,
        replicas: int,
        capacity: int,
        steps_left: int,
        steps_per_s: float,
        restart_s: float,
        since_resize_s: float,
        measured: dict[int, float] | None = None,
    ) -> Resize | None:
        target = self.scaling.fit(capacity) or 0
        if target <= replicas or since_resize_s < self.interval_s or steps_per_s <= 0:
            return None
        faster = (measured or {}).get(target) or steps_per_s * target / replicas
        saved_s = steps_left / steps_per_s - steps_left / faster
        if saved_s <= 2 * restart_s:
            return None
        return Resize(target)
