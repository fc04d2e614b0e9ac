"""The job's demand to the cluster's autoscaler.

A spot cluster (the Ray cluster launcher, KubeRay) launches nodes only for pending
demand. A worker group is sized from what is up, so the controller states what the job
could use, the bundles of `elastic.max_replicas` replicas, through the autoscaling
coordinator Ray Train and Ray Data use: it merges this request with theirs (no requester
overwrites another's) and lets it lapse when its owner stops refreshing it. This module
decides nothing about scaling: the autoscaler decides what exists, the controller's
policies how much of it to use.

A node with a preemption notice (draining) still counts toward the request for Ray's
autoscaler until its instance is gone, so the request grows by the replicas such nodes
could hold: the replacement is launched during the notice, not after the node dies. A
node the job cordoned (a hang, a straggler) counts the same way, so the autoscaler
launches a replacement for it. The cordoned node itself stays up (the request still
covers it): retiring a bad node is the operator's call (`ray drain-node`, the cloud).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from spotline import constants
from spotline.config.schema import JobSpec

log = logging.getLogger("spotline.controller")


class Demand(Protocol):
    def keep(self, force: bool = False) -> None:
        """State the demand, or refresh it when it is due (`force`: now, e.g. after a
        node was lost, so the autoscaler replaces it without waiting for a refresh)."""
        ...

    def withdraw(self) -> None:
        """The job no longer needs anything: the autoscaler may let its nodes go."""
        ...


def demand_bundles(
    spec: JobSpec, device: str, doomed_nodes: Sequence[dict[str, float]] = ()
) -> list[dict[str, float]]:
    """The worker bundles of max_replicas replicas, as the worker group places them, plus
    one replica for each replica the `doomed_nodes` (total resources of live nodes with a
    preemption notice, or cordoned) could hold: the autoscaler still counts those nodes,
    so without these bundles it would not replace them until they are gone."""
    from spotline.runtime.cluster import replicas_fit
    from spotline.runtime.placement import worker_bundle

    pp = spec.parallel.pipeline_stages
    replica = [worker_bundle(spec, device, s) for s in range(pp)]
    replicas = spec.elastic.max_replicas + replicas_fit(replica, list(doomed_nodes))
    return [dict(b) for _ in range(replicas) for b in replica if b]


class RayDemand:
    def __init__(
        self,
        spec: JobSpec,
        device: str,
        clock: Callable[[], float] = time.monotonic,
        cordoned: set[str] | None = None,
    ) -> None:
        self.requester = f"spotline:{spec.name}"
        self.cordoned = cordoned if cordoned is not None else set()
        """Nodes the job keeps out (the cluster view's set, shared)."""
        self.spec, self.device = spec, device
        self.bundles = demand_bundles(spec, device)
        self.clock = clock
        self._sent_at: float | None = None
        self._coordinator: Any = None

    def _actor(self) -> Any:
        if self._coordinator is None:
            from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
                get_or_create_autoscaling_coordinator,
            )

            self._coordinator = get_or_create_autoscaling_coordinator()
        return self._coordinator

    def keep(self, force: bool = False) -> None:
        now = self.clock()
        if (
            not force
            and self._sent_at is not None
            and now - self._sent_at < constants.SPOTLINE_DEMAND_REFRESH_S
        ):
            return
        import ray
        from ray.data._internal.cluster_autoscaler.base_autoscaling_coordinator import (
            ResourceRequestPriority,
        )

        from spotline.runtime.placement import held_out_nodes, usable_nodes

        device = self.device
        if device == "auto":
            # Asked for as the next group would run: GPU bundles once a GPU node is up.
            # A job that must wait for GPU nodes on a cluster with none says device: gpu.
            from spotline.runtime.rendezvous import decide_device

            device = decide_device("auto", usable_nodes())
        self.bundles = demand_bundles(self.spec, device, held_out_nodes(self.cordoned))

        try:
            ray.get(
                self._actor().request_resources.remote(
                    requester_id=self.requester,
                    resources=self.bundles,
                    expire_after_s=constants.SPOTLINE_DEMAND_EXPIRE_S,
                    priority=ResourceRequestPriority.HIGH,
                ),
                timeout=constants.SPOTLINE_DEMAND_RPC_TIMEOUT_S,
            )
        except Exception as e:  # noqa: BLE001 - the next keep() asks again
            log.warning(
                "could not tell the autoscaler what the job needs (%s); asking again in "
                "%.0fs. Until then the cluster grows only for other demand.",
                e,
                constants.SPOTLINE_DEMAND_REFRESH_S,
            )
            return
        if self._sent_at is None:
            log.info("asked the autoscaler for %d worker bundle(s)", len(self.bundles))
        self._sent_at = now

    def withdraw(self) -> None:
        if self._sent_at is None and self._coordinator is None:
            return
        import ray

        self._sent_at = None
        try:
            ray.get(
                self._actor().cancel_request.remote(requester_id=self.requester),
                timeout=constants.SPOTLINE_DEMAND_RPC_TIMEOUT_S,
            )
        except Exception as e:  # noqa: BLE001 - it lapses by itself
            log.warning(
                "could not withdraw the job's request to the autoscaler (%s); it lapses "
                "within %.0fs (SPOTLINE_DEMAND_EXPIRE_S)",
                e,
                constants.SPOTLINE_DEMAND_EXPIRE_S,
            )
