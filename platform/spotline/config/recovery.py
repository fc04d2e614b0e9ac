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

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$")


def parse_bytes(text: str) -> int | None:
    """'64GB', '512 MiB', '2e9' as bytes; None when it is not a size."""
    m = _SIZE.match(text.lower())
    if m is None or m.group(2) not in _UNITS:
        return None
    return int(float(m.group(1)) * _UNITS[m.group(2)])


class RecoverySpec(BaseModel):
    """How the job keeps its state in peers' memory to recover from it."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    peer_snapshots: bool = True
    """Keep snapshots of every rank's state in its own node's and a buddy node's host
    memory, and restore from them when they are newer than the newest commit."""
    peer_interval_steps: int | Literal["auto"] = "auto"
    """Steps between peer snapshots (k). "auto": measured, the smallest k whose snapshots
    cost at most `peer_cost_budget` of the step time."""
    peer_cost_budget: float = Field(0.01, gt=0.0, lt=1.0)
    """The share of training time peer snapshots may take under "auto" (0.01: 1%)."""
    peer_memory: float | str = 0.25
    """Host memory the state keepers of one node may hold: a share of the node's RAM
    (0.25: a quarter), or a size ('64GB', '512MiB'). The copies a node's keeper holds
    for the job's shape (its own ranks' and its buddy node's, two steps each: the newest
    complete one and the one arriving) are shown by `spotline plan` and at launch, and
    reserved from Ray's scheduler (`memory`). When they do not fit, the job degrades in
    this order and says so: one kept step instead of two, then copies on each rank's own
    node only (a lost node loses its ranks' copies), then no peer snapshots."""
    in_place: bool = True
    """Keep the processes of the ranks that survive a restart (a lost node, a notice, a
    grow): they re-form the process group at the new shape and restore there, instead
    of being ended and started again. A rank that hangs is never kept."""
    reform_grace_s: float | None = Field(None, ge=0.0)
    """How long a restart waits for a surviving rank's training to end (its collective
    fails once a peer is gone, or once the restart aborts its communicators) before it
    ends that rank's replica too, as without `in_place`. Unset: by backend, 2 s on gloo
    (a socket shutdown) and 40 s on NCCL (an abort of several communicators takes
    seconds, and one that hangs is reported at 30 s and cordons its node), from
    SPOTLINE_REFORM_GRACE_GLOO_S and SPOTLINE_REFORM_GRACE_NCCL_S. The wait ends as soon
    as every surviving rank is free."""

    @field_validator("peer_memory")
    @classmethod
    def _budget(cls, v: float | str) -> float | str:
        if isinstance(v, str):
            if parse_bytes(v) is None:
                raise ValueError(
                    f"recovery.peer_memory is {v!r}; give a share of the node's RAM (0.25) "
                    "or a size such as '64GB' or '512MiB'"
                )
        elif not 0 < v <= 1 and v < 1024:
            raise ValueError(
                f"recovery.peer_memory is {v}; give a share of the node's RAM between 0 "
                "and 1 (0.25), or a size such as '64GB'"
            )
        return v

    def peer_budget_bytes(self, node_ram: int | None) -> int | None:
        """Bytes one node's keepers may hold: a size as given, or the share of
        `node_ram` (None when the RAM is unknown)."""
        v = self.peer_memory
        if isinstance(v, str):
            return parse_bytes(v)
        if v >= 1024:  # a number of bytes
            return int(v)
        return int(v * node_ram) if node_ram else None

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
