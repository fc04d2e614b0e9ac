"""How big the next group can be: the controller's one reading of capacity.

`Sizing.next_size` reads what the cluster holds for the next group (again for a while
when short of what was there, as right after a teardown), lifts expired cordons, and
the oldest ones when the cordoned nodes alone would keep the job below
elastic.min_replicas (`cordons.Cordons.make_room`), then asks the scaling policy:
a size, or a wait that names the nodes still cordoned. `replicas_left` is what the
next group can expect while the live one still holds its devices: the nodes a notice
dooms, the cordoned ones and those just lost do not count.
"""

from __future__ import annotations

from spotline.config.schema import JobSpec
from spotline.controller.capacity import settled_capacity
from spotline.controller.clock import Clock
from spotline.controller.cordons import Cordons
from spotline.controller.fleet import Fleet
from spotline.controller.inbox import Inbox
from spotline.controller.policies import Resize, ScalingPolicy, Wait
from spotline.runtime.cluster import ClusterView


class Sizing:
    def __init__(
        self,
        spec: JobSpec,
        policy: ScalingPolicy,
        cluster: ClusterView,
        fleet: Fleet,
        cordons: Cordons,
        inbox: Inbox,
        clock: Clock,
    ):
        self.spec, self.policy, self.cluster, self.fleet = spec, policy, cluster, fleet
        self.cordons, self.inbox, self.clock = cordons, inbox, clock

    def next_size(self, want: int | None = None) -> Resize | Wait:
        """The size of the next group (`want`: read again for a while when short of it)."""
        self.cordons.expire()
        held = self.fleet.held()
        cluster = self.cluster

        def capacity() -> int:
            if want is None:
                return cluster.capacity(held_workers=held)
            return settled_capacity(cluster, want, self.clock, self.clock.sleep, held)

        free = capacity()
        if free < self.spec.elastic.min_replicas and self.cordons.make_room(
            lambda lifted: cluster.capacity(held_workers=held, lifted=lifted)
        ):
            free = capacity()
        decision = self.policy.decide(free)
        if isinstance(decision, Wait):
            return Wait(decision.reason + self.cordons.waiting_note())
        return decision

    def replicas_left(self, exclude: set[str] = frozenset()) -> int:
        """Replicas the next group can expect (nodes doomed by a notice, cordoned, or in
        `exclude`, do not count)."""
        gone = set(self.doomed_here()) | set(exclude) | set(self.cluster.cordoned)
        return self.fleet.replicas_left(self.cluster, gone)

    def doomed_here(self) -> list[str]:
        """The live group's nodes a notice named."""
        return self.fleet.here(self.inbox.doomed())
