"""Ranks that outlive their worker group: what one group hands the next.

A restart used to end every rank and start new processes, which then import torch and
DeepSpeed, take a device and build an engine again: seconds on a CPU, tens of seconds
to minutes with CUDA contexts and communicators at scale. Ray ends every actor of a
placement group when the group is removed, so each replica has a placement group of
its own; a replica whose ranks are all still good (alive, off the nodes that go, their
training ended) is handed to the next group whole, with its placement group, and its
ranks re-form in their own processes (`TrainWorker.reform`).

This room only holds and ends them; which replicas are good is the group's to say
(`RayWorkerGroup.hand_over`), and the group adopts them (`adopt`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any


@dataclass
class Survivor:
    """A replica of an ended group that the next group may adopt: its ranks' actors (by
    stage), its placement group, and what the old group knew of each rank (`infos`:
    node, pid, device, local rank)."""

    actors: list[Any]
    pg: Any
    infos: list[dict[str, Any]]
    ahead: bool = False
    """Started ahead and never trained (`standby.py`), rather than kept from a group."""


class Survivors:
    """The replicas one group hands the next (`RayWorkerGroup.hand_over`)."""

    def __init__(self, replicas: list[Survivor] | None = None):
        self.replicas = list(replicas or [])

    def devices(self) -> int:
        """Devices their ranks hold: the next group's to take again."""
        return sum(len(s.actors) for s in self.replicas)

    def release(self) -> None:
        """End them (the next group will not start, or does not need them)."""
        end([a for s in self.replicas for a in s.actors], [s.pg for s in self.replicas])
        self.replicas = []


def adopt(survivors: Survivors, replicas: int, device: str, avoid: set[str]) -> dict[int, Survivor]:
    """The replica index (0, 1, ...) each surviving replica takes in a group of
    `replicas` on `device`, in the order they come. One with no index left, or whose
    ranks ran on another device kind, or sit on a node in `avoid`, is ended here."""
    out: dict[int, Survivor] = {}
    extra = Survivors()
    for sv in survivors.replicas:
        usable = all(i.get("device") == device and i["node_id"] not in avoid for i in sv.infos)
        if usable and len(out) < replicas:
            out[len(out)] = sv
        else:
            extra.replicas.append(sv)
    extra.release()
    return out


def end(actors: list[Any], pgs: list[Any]) -> None:
    """Kill `actors` and remove placement groups `pgs` (None: already handed on).
    Already-dead actors and removed groups are fine: ending is idempotent."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for a in actors:
        with contextlib.suppress(Exception):
            ray.kill(a, no_restart=True)
    for pg in pgs:
        if pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
