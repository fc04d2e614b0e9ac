"""Replicas started ahead, so that no process start is on the path of a restart.

A new rank's process imports torch and DeepSpeed and binds its device: seconds on a
CPU, more with CUDA. Started when the group needs it (a grow, a replacement after a
loss), that is time with no training step. So while the group trains, the controller
keeps as many replicas started here as the free capacity holds beyond the group (up to
elastic.max_replicas). Each goes through the one replica starter (`starter.py`): its
placement group, its ranks' actors, their device bind (`TrainWorker.bind`), and a
rehearsal: an engine built among its own ranks (empty weights, no step), which pays a
process's first-time costs (imports, the first engine build: about a second here,
more with CUDA). Then they wait, holding no rank. When the group next re-forms (a
grow, a loss, a notice), the ready ones join it as survivors do (`survivors.py`):
they re-form at their rank in their own processes. A grow waits for them, training
on, rather than starting processes on its path.

This room only starts, holds and ends them; the controller's fleet and growth say
how many to keep.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from spotline import constants
from spotline.checkpoint import CheckpointStore
from spotline.config.schema import JobSpec
from spotline.runtime.progress import describe_failure
from spotline.runtime.rendezvous import share_node_devices
from spotline.runtime.sealed import SealedJob
from spotline.runtime.starter import ReplicaStart, StartFailed
from spotline.runtime.survivors import Survivor
from spotline.train.process import Topology

log = logging.getLogger("spotline.standby")


class Standby:
    """The job's replicas started ahead (see the module)."""

    def __init__(
        self,
        spec: JobSpec,
        store: CheckpointStore,
        gpu_fraction: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.spec = spec
        self.store = store
        self.gpu_fraction = gpu_fraction
        """Of each worker's GPU left to its sidecar, which the group starts (`start_worker`)."""
        self.clock = clock
        self._replicas: list[ReplicaStart] = []
        self._sealed: SealedJob | None = None  # held while any of them lives
        self.failures: list[str] = []
        """Why each one that failed or timed out ended, until the controller says it."""

    # --- what the controller reads ----------------------------------------------------

    def devices(self) -> int:
        """Devices they hold (placed ones): the job's own, as the group's are."""
        return sum(self.spec.parallel.pipeline_stages for r in self._replicas if r.placed)

    def ready(self) -> int:
        return sum(1 for r in self._replicas if r.ready)

    def starting(self) -> int:
        return sum(1 for r in self._replicas if not r.ready)

    # --- keeping them -----------------------------------------------------------------

    def keep(self, room: int, limit: int, device: str, avoid: set[str]) -> None:
        """Move each one on; end those that failed, sit on a node in `avoid`, run on
        another device kind than `device`, or are more than `limit` (the newest go
        first); and start one more when `room` (whole replicas the free resources hold
        now) is at least 1 and none is still waiting for its placement. One at a time,
        and only onto free resources: a placement group that cannot be placed would be
        demand the autoscaler launches nodes for."""
        self._advance()
        for r in list(self._replicas):
            if r.device != device or any(i.get("node_id") in avoid for i in r.infos):
                self._end(r, "its node is leaving or its device kind is no longer the job's")
        while len(self._replicas) > max(limit, 0):
            self._end(self._replicas[-1], "the job needs no more replicas")
        placing = any(not r.placed for r in self._replicas)
        if room >= 1 and not placing and len(self._replicas) < limit:
            self._start(device, avoid)

    def take(self, avoid: set[str]) -> list[Survivor]:
        """The ready replicas, off the nodes in `avoid`, as survivors for the next group;
        every other one ends (one not ready yet would hold devices the next group is
        sized without)."""
        self._advance()
        good = [
            r for r in self._replicas if r.ready and not any(i["node_id"] in avoid for i in r.infos)
        ]
        # A ready replica may have died since (its process killed, out of memory, its
        # node gone before Ray said so): the next group must not count on it.
        dead = not_answering(good, constants.SPOTLINE_STANDBY_CHECK_TIMEOUT_S)
        taken = {r.label for r in good} - set(dead)
        out = []
        for r in self._replicas:
            if r.label in taken:
                out.append(Survivor(r.actors, r.pg, r.infos, ahead=True))
                continue
            if r.label in dead:
                self.failures.append(
                    f"replica {r.label} started ahead{r.where()} is not alive "
                    f"({dead[r.label]}); the next group starts its own processes in its place"
                )
            r.end()
        if out:
            log.info("%d replica(s) started ahead join the next group", len(out))
        self._replicas = []
        return out

    def release(self) -> None:
        for r in self._replicas:
            r.end()
        self._replicas = []

    # --- the phases -------------------------------------------------------------------

    def _start(self, device: str, avoid: set[str]) -> None:
        if self._sealed is None:
            self._sealed = SealedJob(self.spec, self.store)
        pp = self.spec.parallel.pipeline_stages
        label = f"standby-{uuid.uuid4().hex[:8]}"
        self._replicas.append(
            ReplicaStart.place(
                self.spec,
                self._sealed,
                device,
                # Placeholders: `reform` gives each its rank in the group it joins.
                [Topology(pp, 1, stage) for stage in range(pp)],
                label,
                label,
                avoid,
                self.clock,
                rehearse=True,
                gpu_fraction=self.gpu_fraction,
                names=[f"spotline:{self.spec.name}:{label}/stage-{s}" for s in range(pp)],
            )
        )

    def _end(self, r: ReplicaStart, why: str) -> None:
        log.info("replica %s started ahead ends: %s", r.label, why)
        r.end()
        self._replicas.remove(r)

    def _advance(self) -> None:
        """Take each replica one phase on where its calls returned; never waits. Its
        ranks see only its own devices: it binds alone."""
        for r in list(self._replicas):
            try:
                r.advance()
                if r.phase == "started":
                    r.bind(share_node_devices([(i["node_id"], i["gpu_ids"]) for i in r.infos]))
            except StartFailed as e:
                self.failures.append(f"replica {r.label} started ahead{r.where()} ended: {e}")
                self._end(r, str(e))


def not_answering(replicas: list[ReplicaStart], timeout_s: float) -> dict[str, str]:
    """Why each of `replicas` with a rank that does not answer a no-op call (`info`)
    within `timeout_s` is not alive, by label. One wait for every rank of every
    replica: the check costs at most `timeout_s` however many there are."""
    import ray

    calls: dict[Any, ReplicaStart] = {}
    why: dict[str, str] = {}
    for r in replicas:
        for a in r.actors:
            try:
                calls[a.info.remote()] = r
            except Exception as e:  # noqa: BLE001 - a handle that cannot take a call
                why[r.label] = describe_failure(e)
    if not calls:
        return why
    done, _ = ray.wait(list(calls), num_returns=len(calls), timeout=timeout_s)
    answered = set(done)
    for ref, r in calls.items():
        if r.label in why:
            continue
        if ref not in answered:
            why[r.label] = f"no answer within {timeout_s:.0f}s (SPOTLINE_STANDBY_CHECK_TIMEOUT_S)"
            continue
        try:
            ray.get(ref)
        except Exception as e:  # noqa: BLE001 - what ended it is the answer
            why[r.label] = describe_failure(e)
    return why
