"""The `recovery` section of a job spec: peer-memory snapshots of the training state.

Every k steps each rank copies the state it alone owns (the same bytes a checkpoint
holds) into the host memory of a state keeper on its own node and of one on another
node (its buddy). A group that lost a node restores the newest step every rank of it
left complete in live keepers' memory, not the newest commit in object storage: fewer
steps lost, nothing read from storage. The durable commit is unchanged.

In place (`in_place`): after a node loss, a notice, a grow or any other restart, the
ranks that are still good keep their processes and re-form at the new shape; only the
missing ranks are started anew.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class RecoverySpec(BaseModel):
    """How the job keeps its state in peers' memory to recover from it."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    peer_snapshots: bool = True
    """Keep snapshots of every rank's state in its own node's and a buddy node's host
    memory, and restore from them when they are newer than the newest commit."""
    peer_interval_steps: int | Literal["auto"] = "auto"
    """Steps between peer snapshots (k). "auto": measured, the smallest k whose snapshots
    cost at most `peer_cost_budget` of the step time."""
    peer_cost_budget: float = Field(0.02, gt=0.0, lt=1.0)
    """The share of training time peer snapshots may take under "auto" (0.02: 2%)."""
    in_place: bool = True
    """Keep the processes of the ranks that survive a restart (a lost node, a notice, a
    grow): they re-form the process group at the new shape and restore there, instead
    of being ended and started again. A rank that hangs is never kept."""
    reform_grace_s: float = Field(2.0, ge=0.0)
    """How long a restart waits for a surviving rank's training to end (a collective
    fails once a peer is gone) before it ends that rank's replica too, as without
    `in_place`. On gloo a rank whose collective waits on another survivor, not on the
    lost one, stays blocked until failure.collective_timeout_s: this bounds that wait."""

    def fixed_interval(self) -> int | None:
        """k when the spec sets it (0: none taken); None when it is measured."""
        if not self.peer_snapshots:
            return 0
        return None if self.peer_interval_steps == "auto" else self.peer_interval_steps

    def model_post_init(self, _: object) -> None:
        k = self.peer_interval_steps
        if k != "auto" and k < 1:
            raise ValueError(
                f'recovery.peer_interval_steps is {k}; give a number of steps >= 1, "auto", '
                "or set recovery.peer_snapshots: false to take none"
            )
