"""What a worker failure was, before the loop acts on it.

`Failures.judge` reads a failure of the live group the way the restart needs it: the
nodes lost with it (read patiently when a process died: its node may be seen gone a
moment after), its kind (`policies.classify`: a hang, a transient fault, the user's
code, ...), whether a hang cordons a node (`cordons.Cordons.after_hang`, and
`after_comms_hung` for a rank whose abort of its communicators hung), which nodes'
ranks go while the others may go on in their processes, and how many replicas the
next group can expect. The loop records the verdict, ends the group and decides
with `FailurePolicy`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from spotline.controller.capacity import lost_nodes
from spotline.controller.clock import Clock
from spotline.controller.cordons import Cordons
from spotline.controller.fleet import Fleet
from spotline.controller.policies import FailureKind, classify
from spotline.runtime.cluster import ClusterView
from spotline.train.watch import CommsHung


@dataclass(frozen=True)
class Verdict:
    what: str
    """"node loss", "hang" or "failure"."""
    kind: FailureKind
    lost: frozenset[str]
    leaving: frozenset[str] | None
    """The nodes whose ranks go while the others go on in their processes (a rank lost
    with its node, or whose process died, leaves its peers good); None: nothing is kept
    (after a hang a rank is stuck)."""
    want: int
    """Replicas the next group can expect."""


class Failures:
    def __init__(
        self,
        cluster: ClusterView,
        fleet: Fleet,
        cordons: Cordons,
        replicas_left: Callable[..., int],
        clock: Clock,
    ):
        self.cluster, self.fleet, self.cordons = cluster, fleet, cordons
        self.replicas_left, self.clock = replicas_left, clock

    def judge(
        self, error: str, process_died: bool, causes: list[BaseException], step: int
    ) -> Verdict:
        group, clock = self.fleet.group, self.clock
        lost = set()
        if group is not None:
            lost = lost_nodes(self.cluster, group.node_ids(), process_died, clock, clock.sleep)
        kind = classify(causes, error)
        hang = kind.name == "hang" and not lost
        if hang:  # may cordon a node: before the next size is counted
            self.cordons.after_hang(causes, step, self.replicas_left)
        # A rank whose abort or destroy of its communicators hung: its node, whatever
        # else went wrong.
        hung = {
            c.node: f"rank {c.rank} there: {c.short}"
            for c in causes
            if isinstance(c, CommsHung) and c.node and c.node not in lost
        }
        self.cordons.after_comms_hung(hung, self.replicas_left)
        what = "node loss" if lost else ("hang" if hang else "failure")
        keep = (lost or process_died) and not hang
        return Verdict(
            what,
            kind,
            frozenset(lost),
            frozenset(lost) if keep else None,
            self.replicas_left(exclude=lost),
        )
