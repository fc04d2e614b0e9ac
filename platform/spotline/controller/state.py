"""The controller's states. One loop iteration moves from one state to the next."""

from __future__ import annotations

import enum


class State(str, enum.Enum):
    PENDING = "pending"
    SCHEDULING = "scheduling"
    WAITING = "waiting"  # below elastic.min_replicas: waiting for capacity
    RUNNING = "running"
    CHECKPOINTING = "checkpointing"
    RESIZING = "resizing"  # restarting at another size from a fresh commit
    RECOVERING = "recovering"
    FINISHING = "finishing"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"  # stopped on request, after a final commit

    @property
    def terminal(self) -> bool:
        return self in (State.FINISHED, State.FAILED, State.STOPPED)
