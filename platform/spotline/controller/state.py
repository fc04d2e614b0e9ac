"""The controller's states. Each carries what it needs; a loop iteration returns the next.

`name` is what status, events and the ledger call the state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class State:
    name: ClassVar[str] = "?"
    terminal: ClassVar[bool] = False


@dataclass(frozen=True)
class Pending(State):
    name: ClassVar[str] = "pending"


@dataclass(frozen=True)
class Scheduling(State):
    """Start a group on the capacity that is there: at least `want` replicas if it comes
    within the settle time (after a teardown, the freed devices show up a moment later)."""

    name: ClassVar[str] = "scheduling"
    reason: str = "start"
    since: float = 0.0
    want: int = 0


@dataclass(frozen=True)
class Waiting(State):
    """Below elastic.min_replicas: waiting for capacity since `since`."""

    name: ClassVar[str] = "waiting"
    reason: str = ""
    since: float = 0.0


@dataclass(frozen=True)
class Starting(State):
    """A group is being started (placed, its processes up, the rendezvous); the loop
    moves it on at each step and handles what arrives meanwhile. `offer`: the peer
    copy it restores when it is ready (or None); `reached`: the step the job had
    reached before it (what it trains again is lost work)."""

    name: ClassVar[str] = "starting"
    reason: str = "start"
    since: float = 0.0
    offer: Any = field(default=None, compare=False, hash=False)
    reached: int = 0


@dataclass(frozen=True)
class Running(State):
    """The group trains on its own toward `target`."""

    name: ClassVar[str] = "running"
    target: int = 0


@dataclass(frozen=True)
class Leaving(State):
    """The group was asked to save and stop at `step` (a just-in-time checkpoint before a
    preemption, a grow, a re-partition or the leaving of a cordoned node at the next
    checkpoint boundary, or a stop request); it leaves once that step is committed."""

    name: ClassVar[str] = "checkpointing"
    why: str = "preemption"  # "preemption" | "grow" | "stop" | "rebalance" | "cordon"
    step: int = 0
    since: float = 0.0
    grow_to: int = 0
    deadline: float | None = None  # wall clock: the notice's, while `step` is a late one
    partition: tuple[int, ...] | None = None  # rebalance: the next group's stage bounds


@dataclass(frozen=True)
class Finishing(State):
    """Every rank reached the last step: its commit, the held-out loss, backfill's end."""

    name: ClassVar[str] = "finishing"


@dataclass(frozen=True)
class Finished(State):
    """The job trained its last step. `reported`: it had finished before this controller
    started, and this is the summary it stored then (no worker was started)."""

    name: ClassVar[str] = "finished"
    terminal: ClassVar[bool] = True
    reported: dict[str, Any] | None = field(default=None, compare=False, hash=False)


@dataclass(frozen=True)
class Failed(State):
    name: ClassVar[str] = "failed"
    terminal: ClassVar[bool] = True
    error: str = ""


@dataclass(frozen=True)
class Stopped(State):
    """Stopped on request after a final commit; submitting the job again resumes there."""

    name: ClassVar[str] = "stopped"
    terminal: ClassVar[bool] = True
    reason: str = ""
