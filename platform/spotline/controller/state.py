"""The controller's states. One loop iteration moves from one state to the next."""

from __future__ import annotations

import enum


class State(str, enum.Enum):
    PENDING = "pending"
    SCHEDULING = "scheduling"
    RUNNING = "running"
    CHECKPOINTING = "checkpointing"
    RECOVERING = "recovering"
    FINISHING = "finishing"
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (State.FINISHED, State.FAILED)
