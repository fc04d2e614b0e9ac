"""What a worker group publishes, and the interface the controller drives it through.

`WorkerGroup` is all the controller knows of its ranks, so controller tests swap in a
fake group; `Progress`, `RankBeat` and `WorkerFailure` are what a poll returns or
raises. This room holds data and the protocol only: it never starts an actor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from spotline.checkpoint import Manifest
from spotline.config.redact import redact
from spotline.train.process import sticky_cuda_error

PROCESS_DIED = "worker process died (killed, out of memory, or its node was lost)"


class WorkerFailure(RuntimeError):
    """One or more ranks failed. `ranks_by_error` groups identical errors across ranks."""

    def __init__(
        self,
        what: str,
        ranks_by_error: dict[str, list[int]],
        nodes: dict[int, str] | None = None,
        causes: list[BaseException] | None = None,
        silent: list[int] | None = None,
    ):
        self.what = what
        self.ranks_by_error = ranks_by_error
        self.nodes = nodes or {}
        self.causes = causes or []
        self.silent = silent or []
        """Ranks whose run had not ended when the others' failures were collected: a
        process on a vanished node ends only once Ray sees the node dead."""
        self.progress: Progress | None = None
        """What the ranks that still answered published in the same poll: their steps
        and finished uploads must not be lost with the failure."""
        super().__init__(self._render())

    @property
    def process_died(self) -> bool:
        """Some rank's process is gone (not merely raised): its node may be lost."""
        return PROCESS_DIED in self.ranks_by_error

    def _render(self) -> str:
        parts = []
        for err, ranks in self.ranks_by_error.items():
            where = ", ".join(
                f"{r}" + (f"@{self.nodes[r][:8]}" if r in self.nodes else "") for r in sorted(ranks)
            )
            parts.append(f"[ranks {where}]: {err}")
        return redact(f"{self.what} failed: " + "; ".join(parts))


@dataclass
class Progress:
    """What a group's ranks published since the last poll."""

    steps: list[tuple[int, float, float, float]] = field(default_factory=list)
    """(step, loss, seconds, wall time at its end), in order (rank 0's: the loss is the
    same on every rank)."""
    saves: dict[int, float] = field(default_factory=dict)
    """Steps saved by every rank, with the longest time a rank's training was blocked."""
    save_bytes: dict[int, int] = field(default_factory=dict)
    """Bytes each of those saves copied to the host, over all ranks."""
    uploads: list[Any] = field(default_factory=list)
    """Finished uploads (UploadResult), any rank, in the order they finished."""
    uploading: bool = False
    notices: list[dict[str, Any]] = field(default_factory=list)
    """Preemption notices the ranks saw themselves (SIGTERM), as Notice fields + rank."""
    bubbles: list[dict[str, Any]] = field(default_factory=list)
    """Per rank of a pipeline: bubble figures since the last poll and its latest steps."""
    lr: float | None = None
    batch: dict[str, Any] | None = None
    """Rank 0's batch in force: schedule, global_batch_size, micro_batches, noise_scale
    and the schedule's history ([[first_step, global_batch], ...])."""
    data_stall_s: float = 0.0
    """Seconds steps waited for their batches since the last poll (the slowest rank's)."""
    memory: list[dict[str, Any]] = field(default_factory=list)
    """Peak tensor memory of ranks that measured it since the last poll: stage, bytes."""
    finished: dict[str, Any] | None = None
    """Set once every rank's run returned: {"stopped_at": step, "reason": ...}."""
    ranks: list[RankBeat] = field(default_factory=list)
    """Every rank's latest heartbeat and its compute since the last poll (rank order)."""
    skipped_saves: list[int] = field(default_factory=list)
    """Periodic checkpoint steps every rank skipped: some rank's upload of an earlier
    checkpoint was still running (rank 0 reports them)."""
    peer: list[dict[str, Any]] = field(default_factory=list)
    """Peer copies since the last poll, per rank: taken ({step, rank, blocked_s, taken})
    and sent to the keepers ({step, rank, nbytes, send_s, total_s, kept_by} or error)."""


@dataclass
class RankBeat:
    """What the controller knows of one rank's health after a poll."""

    rank: int
    stage: int
    replica: int
    node: str
    step: int
    """The step its heartbeat says it works on."""
    phase: str
    """What it was doing at its latest heartbeat, and for how long it had been (`phase_s`)."""
    phase_s: float
    silent_s: float
    """Seconds since the rank last answered a poll (0: it answered this one)."""
    running: bool
    """Its run has not returned (a finished rank is idle, not hung)."""
    compute_steps: int = 0
    compute_s: float = 0.0
    """Steps whose own compute time (no collective, no pipeline transfer) it measured
    since the last poll, and their summed seconds."""


class WorkerGroup(Protocol):
    """What the controller needs from a group of ranks."""

    world_size: int
    replicas: int
    attempt: str
    device: str  # "gpu" or "cpu", once started
    restored_bytes: int  # what the ranks read in the latest restore
    kept: int  # ranks adopted from the previous group at `start` (their processes kept)
    ahead: int  # ranks that joined from replicas started ahead, at `start`
    left_behind: dict[int, str]  # rank -> why `hand_over` did not keep it

    def start(
        self, partition: list[int] | None = None, init: bool = True, survivors: Any = None
    ) -> None:
        """Begin placing and starting the ranks; returns at once."""

    def advance(self, timeout_s: float = 0.0) -> bool:
        """Move the start on (waiting at most `timeout_s`); True once the group is set up
        and can restore. Raises WorkerFailure."""

    def hand_over(self, leaving: set[str], grace_s: float | None) -> Any: ...
    def partition(self) -> dict[str, Any]: ...
    def restore(self, manifest: Manifest, source: str | None = None) -> int: ...
    def run(self, target: int, peer_every: int = 0) -> None: ...
    def poll(self, timeout_s: float) -> Progress: ...
    def request(
        self, save_at: int = 0, stop_at: int = 0, reason: str = "", peer_every: int = 0
    ) -> None: ...
    def wait_uploads(self, timeout_s: float) -> bool: ...
    def node_ids(self) -> set[str]: ...
    def heldout_loss(self) -> float: ...
    def executors(self) -> list[Any]: ...
    def peak_flops(self) -> float | None: ...
    def worker_info(self) -> list[dict[str, Any]]: ...
    def shutdown(self) -> None: ...


def failure_cause(e: BaseException) -> BaseException:
    """The exception a rank raised, out of Ray's wrapper."""
    return getattr(e, "cause", None) or e


def describe_failure(e: BaseException) -> str:
    """One line for what ended a rank's call: PROCESS_DIED, or the error's type and last
    line (a sticky CUDA error's own line, which torch follows with debugging hints)."""
    name = type(e).__name__
    if "ActorDied" in name or "ActorUnavailable" in name or "RayActorError" in name:
        return PROCESS_DIED
    cause = getattr(e, "cause", None)
    sticky = sticky_cuda_error(str(cause if cause is not None else e))
    if sticky is not None:
        return f"{type(cause if cause is not None else e).__name__}: CUDA error: {sticky}"
    if cause is not None:
        return f"{type(cause).__name__}: {str(cause).strip().splitlines()[-1] if str(cause).strip() else ''}"
    text = str(e).strip().splitlines()
    return f"{name}: {text[-1] if text else ''}"


def collect(refs: list[Any]) -> list[tuple[Any, BaseException | None]]:
    """Each ref's (value, None), or (None, the exception its call raised): one `ray.get`
    for all of them (a poll of thousands of ranks takes their reports in one call, not
    one per rank); only when some call raised are they taken one by one, to tell which."""
    import ray

    try:
        return [(v, None) for v in ray.get(list(refs))]
    except Exception:  # noqa: BLE001 - which one raised is found below
        pass
    out: list[tuple[Any, BaseException | None]] = []
    for ref in refs:
        try:
            out.append((ray.get(ref), None))
        except Exception as e:  # noqa: BLE001 - the caller groups and re-raises them
            out.append((None, e))
    return out


_QUIET_S = 0.25
"""After a rank failed, how long no other rank failing ends the wait for them."""


def peer_failures(
    first_rank: int, first_exc: BaseException, runs: list[Any], rank_of: dict[Any, int]
) -> tuple[dict[str, list[int]], list[BaseException], list[int]]:
    """The ranks that failed with `first_rank` (their `runs` refs), grouped by what they
    said, the causes, and the ranks still silent then. Peers fail within milliseconds of
    each other (a failed rank cuts its links), so the wait ends once none more fails for
    _QUIET_S, at most 1 s: a rank on a node that vanished fails only once Ray sees the
    node dead, and must not hold recovery up."""
    import time

    import ray

    errors: dict[str, list[int]] = {describe_failure(first_exc): [first_rank]}
    causes = [failure_cause(first_exc)]
    pending = [f for f in runs if rank_of[f] != first_rank]
    deadline = time.monotonic() + 1.0
    while pending and time.monotonic() < deadline:
        wait_s = min(_QUIET_S, max(0.0, deadline - time.monotonic()))
        ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
        if not ready:
            break
        try:
            ray.get(ready[0])
        except Exception as e:  # noqa: BLE001 - grouped for the report
            errors.setdefault(describe_failure(e), []).append(rank_of[ready[0]])
            causes.append(failure_cause(e))
    return errors, causes, sorted(rank_of[f] for f in pending)


class Standby(Protocol):
    """Replicas started ahead on free capacity (`spotline.runtime.standby.Standby`)."""

    failures: list[str]

    def devices(self) -> int: ...
    def starting(self) -> int: ...
    def keep(self, room: int, limit: int, device: str, avoid: set[str]) -> None: ...
    def take(self, avoid: set[str]) -> list[Any]: ...
    def release(self) -> None: ...


class Stacks(Protocol):
    """Takes the stacks of a group's ranks (`spotline.runtime.stacks.RayStacks`)."""

    def take(self, group: Any, ranks: list[int] | None = None) -> dict[str, Any]: ...


class Backfill(Protocol):
    """The backfill pool the controller is handed (`spotline.backfill.pool`): it never
    imports backfill itself."""

    pinned_steps: Any
    governor: Any

    def bind(self, event: Any, on_result: Any) -> None: ...
    def attach(self, executors: list[Any]) -> None: ...
    def detach(self) -> None: ...
    def poll(self) -> None: ...
    def on_chunk(self, steps: int, seconds: float, warm: bool) -> None: ...
    def on_commit(self, manifest: Any, final: bool) -> None: ...
    def finish(self, timeout_s: float, sleep: Any) -> None: ...
    def results(self) -> list[dict[str, Any]]: ...
    def summary(self) -> dict[str, Any]: ...
