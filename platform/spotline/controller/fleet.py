"""The job's processes: the live group, the ranks it hands the next one, and the
replicas started ahead.

`Fleet` is the controller's one owner of them. It begins a group (`start`: it
returns at once, and the loop moves the start on with `advance` while it goes on
reading notices and answering status), ends it (`end`: in place, the good replicas
and the ready replicas started ahead go on to the next group; otherwise everything
ends), keeps replicas started ahead on free capacity (`keep_standby`), and counts
what the next group can expect (`replicas_left`). It decides nothing: the loop says
when and with what.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from spotline.config.schema import JobSpec
from spotline.controller.capacity import replicas_left
from spotline.runtime.progress import Standby, WorkerGroup
from spotline.runtime.survivors import Survivors


@dataclass(frozen=True)
class HandedOver:
    """What went on to the next group and why each other rank did not (`slow`: a rank
    was still in its step, which is worth a warning)."""

    text: str
    slow: bool


class Fleet:
    def __init__(
        self,
        spec: JobSpec,
        factory: Callable[[int], WorkerGroup],
        standby: Standby | None,
    ):
        self.spec = spec
        self.factory = factory
        self.standby = standby if spec.recovery.in_place else None
        """Replicas started ahead on free capacity (`spotline.runtime.standby`)."""
        self.group: WorkerGroup | None = None
        self.survivors: Survivors | None = None
        """Ranks of the ended group that the next one adopts (`WorkerGroup.hand_over`)."""
        self.failures: list[str] = []
        """What went wrong with replicas started ahead, until the loop says it."""

    # --- a group's life ---------------------------------------------------------------

    def start(self, replicas: int, partition: list[int] | None, init: bool) -> WorkerGroup:
        """Begin a group of `replicas` (it adopts the ranks held for it); returns at once."""
        survivors, self.survivors = self.survivors, None
        group = self.factory(replicas)
        self.group = group
        group.start(partition=partition, init=init, survivors=survivors)
        return group

    def end(
        self,
        leaving: set[str] | None,
        avoid: set[str],
        on_hung: Callable[[dict[str, str]], None] | None = None,
    ) -> HandedOver | None:
        """End the live group. `leaving` (with recovery.in_place): the nodes whose ranks
        go (lost, or named by a notice); the group's other good replicas, off those and
        off `avoid` (cordoned, noticed), are held for the next group with the ready
        replicas started ahead. `on_hung(node -> why)`: told, before the group ends, of
        the nodes where a rank's abort hung. Returns what went on and why each other
        rank did not, for the event log. None: everything ends, ranks held before
        included."""
        said = None
        group = self.group
        if group is not None:
            if leaving is not None and self.spec.recovery.in_place:
                gone = set(leaving) | set(avoid)
                self.release_held()
                self.survivors = group.hand_over(gone, self.spec.recovery.reform_grace_s)
                if self.standby is not None:
                    self.survivors.replicas += self.standby.take(gone)
                    self.failures += self.standby.failures
                    self.standby.failures = []
                behind = group.left_behind
                said = HandedOver(
                    f"{self.survivors.devices()} rank(s) go on in their processes"
                    + "".join(f"; rank {k} not: {why}" for k, why in sorted(behind.items())),
                    any(w.startswith("still") for w in behind.values()),
                )
                hung = getattr(group, "comms_hung", {})
                if hung and on_hung is not None:  # while the group still counts
                    on_hung(dict(hung))
            group.shutdown()
            self.group = None
        if leaving is None:
            self.release_held()
            if self.standby is not None:
                self.standby.release()
        return said

    def release_held(self) -> None:
        """End the ranks held for a next group (it will not start, or needs them not)."""
        if self.survivors is not None:
            self.survivors.release()
            self.survivors = None

    def held(self) -> int:
        """Devices the ranks held for the next group occupy: theirs to take again."""
        return self.survivors.devices() if self.survivors is not None else 0

    # --- replicas started ahead ---------------------------------------------------------

    def keep_standby(self, room: int, limit: int, avoid: set[str]) -> int:
        """Start replicas ahead on `room` (the free capacity beyond the live group), up to
        `limit` more than it, off `avoid`; returns the devices they hold (the job's own,
        as the group's are)."""
        group, standby = self.group, self.standby
        if standby is None or group is None:
            return 0
        standby.keep(room, limit, group.device, avoid)
        self.failures += standby.failures
        standby.failures = []
        return standby.devices()

    def standby_starting(self) -> bool:
        return self.standby is not None and self.standby.starting() > 0

    def take_failures(self) -> list[str]:
        out, self.failures = self.failures, []
        return out

    # --- what the next group can expect -------------------------------------------------

    def here(self, nodes: set[str] | list[str]) -> list[str]:
        """Those of `nodes` the live group runs on, sorted."""
        return sorted((self.group.node_ids() if self.group else set()) & set(nodes))

    def replicas_left(self, cluster, gone: set[str]) -> int:
        """Replicas the next group can expect: the live group's devices off the `gone`
        nodes, those of replicas started ahead, and the free ones."""
        if self.group is None:
            return 0
        ahead = self.standby.devices() if self.standby is not None else 0
        return replicas_left(cluster, self.group.worker_info(), gone, ahead)
