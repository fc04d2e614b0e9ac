"""Small policies that return decisions; the controller carries them out.

Here: failure (restart or fail), scaling (how many replicas), growing, and the cost
rule of a restart that makes the job faster. The just-in-time checkpoint's timing is
in `jit.py`, the stage re-partition decision in `repartition.py`. Policies hold no
Ray handles and do no I/O, so they are unit-tested as plain functions of their
inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from spotline import constants
from spotline.controller.health import is_collective_timeout


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


@dataclass(frozen=True)
class FailureKind:
    """What a failure is, whether restarting can help, and what fixes it."""

    name: str
    retryable: bool
    fix: str = ""


TRANSIENT = FailureKind("transient", True)

_OOM_FIX = (
    "lower the memory per device: a smaller train.global_batch_size (micro-batch), more "
    "parallel.pipeline_stages, a higher parallel.zero_stage, parallel.precision: bf16, or a "
    "smaller model"
)
# Words of torch's, the allocator's and Ray's memory monitor's out-of-memory errors.
_OOM_MARKERS = (
    "cuda out of memory",
    "outofmemoryerror",
    "memory monitor",
    "cannot allocate memory",
    "not enough memory",
    "defaultcpuallocator: can't allocate",
)


def classify(causes: list[BaseException], text: str = "") -> FailureKind:
    """Sort a failure into the ones a restart cannot fix and the transient rest.

    Out of memory, a missing path, a permission error, an import error (user code not
    shipped to the workers), an error raised in the user's own code, a corrupt
    checkpoint file and a spec/checkpoint mismatch fail the same way on every restart; a dead process, a lost peer, a timeout or a storage outage may not.
    Pure: decided from exception types and messages alone.
    """
    names = {c.__name__ for e in causes for c in type(e).__mro__}
    blob = " ".join([text, *(f"{type(e).__name__}: {e}" for e in causes)]).lower()
    if (
        isinstance_any(causes, MemoryError)
        or "OutOfMemoryError" in names
        or any(m in blob for m in _OOM_MARKERS)
    ):
        return FailureKind("out of memory", False, _OOM_FIX)
    if "UserCodeError" in names:
        return FailureKind("error in your code", False, "fix your module named above")
    if "HangError" in names or is_collective_timeout(blob):
        return FailureKind(
            "hang",
            True,
            "if a node hangs again it is cordoned (failure.cordon_after_hangs); raise "
            "failure.hang_factor if steps this long are expected",
        )
    if names & {"CorruptCheckpointError", "CheckpointFormatError"}:
        return FailureKind(
            "corrupt checkpoint",
            False,
            "restore the file named above, or start from another committed step",
        )
    if "SpecError" in names:
        return FailureKind("invalid spec", False, "fix the field named above")
    if "DataError" in names:  # ShardError included: a missing, truncated or altered shard
        return FailureKind(
            "bad data",
            False,
            "restore or re-prepare the data named above (`spotline prepare` writes every "
            "shard with its sha256), or point data.uri elsewhere",
        )
    if "CheckpointMismatchError" in names:
        return FailureKind(
            "checkpoint mismatch",
            False,
            "point checkpoint.uri at a new location, or resubmit with the spec that wrote it",
        )
    if isinstance_any(causes, ImportError):
        return FailureKind(
            "import error",
            False,
            "make the module importable on every node: install it in the image, or ship it "
            "with the job's runtime_env (working_dir or py_modules)",
        )
    if isinstance_any(causes, (FileNotFoundError, NotADirectoryError, IsADirectoryError)):
        return FailureKind(
            "missing path", False, "fix the path named above (it must exist on every node)"
        )
    if isinstance_any(causes, PermissionError):
        return FailureKind(
            "permission denied",
            False,
            "give the user Ray runs as write access to the path named above, or choose another one",
        )
    if "no space left on device" in blob:
        return FailureKind(
            "disk full", False, "free space on the node, or point the path named above elsewhere"
        )
    return TRANSIENT


def isinstance_any(causes: list[BaseException], types: type | tuple[type, ...]) -> bool:
    return any(isinstance(e, types) for e in causes)


class FailurePolicy:
    """Restart after a transient worker failure until max_failures restarts were used
    (-1: never stop); fail at once on one a restart cannot fix."""

    def __init__(self, max_failures: int):
        self.max_failures = max_failures

    def decide(self, failures: int, error: str, kind: FailureKind = TRANSIENT) -> Restart | Fail:
        """`failures` counts transient failures so far, this one included."""
        if not kind.retryable:
            return Fail(
                f"{kind.name}: {error}. Not retried, as a restart would fail the same way: "
                f"{kind.fix}; then resubmit (the job resumes from its latest committed "
                "checkpoint)"
            )
        if self.max_failures < 0 or failures <= self.max_failures:
            budget = "unlimited" if self.max_failures < 0 else f"{failures}/{self.max_failures}"
            return Restart(f"restart {budget} after: {error}")
        return Fail(
            f"job failed after {failures} transient worker failures "
            f"(failure.max_failures={self.max_failures}); last error: {error}. Raise "
            "failure.max_failures if failures like this are expected on this cluster, or fix "
            "the cause and resubmit: the job resumes from its latest committed checkpoint"
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
    """Whether to restart a running group at a bigger size.

    The rule: grow from D to D' replicas only when
      1. the group has run for at least 2 x the measured restart cost since it started
         (a minimum dwell, so capacity that flickers does not cause a restart storm), and
      2. the time the bigger group saves over the remaining steps is more than twice the
         measured restart cost:
             steps_left / r(D) - steps_left / r(D') > 2 x restart_s
         where r(D) is the current steps per second and r(D') the rate this job measured
         at D' replicas before, or r(D) x D'/D when it has not run at D' yet.
    restart_s is the last restart's measured cost; before the first restart, the first
    group's measured start stands in. No fixed interval: capacity that joins is used as soon as the rule says it pays.
    """

    def __init__(self, scaling: ScalingPolicy):
        self.scaling = scaling

    def decide(
        self,
        replicas: int,
        capacity: int,
        steps_left: int,
        steps_per_s: float,
        restart_s: float,
        running_s: float,
        measured: dict[int, float] | None = None,
    ) -> Resize | None:
        target = self.scaling.fit(capacity) or 0
        if target <= replicas:
            return None
        faster = (measured or {}).get(target) or steps_per_s * target / replicas
        if not restart_pays(steps_left, steps_per_s, faster, restart_s, running_s):
            return None
        return Resize(target)


def restart_pays(
    steps_left: int, steps_per_s: float, faster: float, restart_s: float, running_s: float
) -> bool:
    """The cost rule of a restart that makes the job faster (a grow, a re-partition): the
    group has run for 2 x restart_s (a minimum dwell, so flickering capacity or noisy
    figures cause no restart storm), and running the remaining steps at `faster` steps
    per second instead of `steps_per_s` saves more than twice the restart's cost."""
    if steps_per_s <= 0 or faster <= steps_per_s or dwelling(running_s, restart_s):
        return False
    saved_s = steps_left / steps_per_s - steps_left / faster
    return saved_s > 2 * restart_s


def dwelling(running_s: float, restart_s: float) -> bool:
    """Whether a group that has run `running_s` is still within the minimum dwell of a
    restart that makes the job faster: 2 x restart_s."""
    return running_s < 2 * restart_s


def next_boundary(step: int, interval: int, steps_per_s: float, last: int) -> int:
    """The first checkpoint boundary (a multiple of `interval`, at most `last`) the
    ranks have not reached yet. They train on their own, ahead of `step` (the latest
    the controller saw) by up to about two polls' worth of steps; a stop asked for a
    step they passed happens at once, off the boundary."""
    ahead = math.ceil(max(steps_per_s, 0.0) * 2 * constants.SPOTLINE_POLL_INTERVAL_S)
    return min(((step + ahead) // interval + 1) * interval, last)
