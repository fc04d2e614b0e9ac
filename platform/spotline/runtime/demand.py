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
    def bind(self, event: Callable[[str, int], None]) -> None:
        """Say what goes wrong through `event(text, level)` (the controller's events)."""
        ...

    def keep(self, force: bool = False) -> None:
        """State the demand, or refresh it when it is due (`force`: now, e.g. after a
        node was lost, so the autoscaler replaces it without waiting for a refresh).
        Never raises: a failure is a warning, and the job trains on what is up."""
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


def _log_event(text: str, level: int) -> None:
    log.log(level, text)


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
        self._due: float | None = None  # when keep() asks next, failed or not
        self._said: set[tuple[str, str]] = set()  # the causes of failure said so far
        self._event: Callable[[str, int], None] = _log_event
        self._coordinator: Any = None

    def bind(self, event: Callable[[str, int], None]) -> None:
        self._event = event

    def _actor(self) -> Any:
        if self._coordinator is None:
            from spotline.compat.ray import autoscaling_coordinator

            self._coordinator = autoscaling_coordinator()
        return self._coordinator

    def keep(self, force: bool = False) -> None:
        now = self.clock()
        if not force and self._due is not None and now < self._due:
            return
        # Failed or not, the next try is a refresh away: a GCS that does not answer
        # must not cost the controller's loop an RPC timeout at every turn.
        self._due = now + constants.SPOTLINE_DEMAND_REFRESH_S
        doing = "reading the cluster's nodes"
        try:
            bundles = self._bundles_now()
            doing = "loading Ray's autoscaling coordinator"
            send = self._sender()
            doing = "sending the request"
            send(bundles)
        except Exception as e:  # noqa: BLE001 - the job trains on; the next keep() asks again
            self._failed(doing, e)
            return
        self.bundles = bundles
        if self._said:
            self._said.clear()
            self._event(
                f"the autoscaler has the job's demand now ({len(bundles)} worker bundle(s))",
                logging.INFO,
            )
        elif self._sent_at is None:
            log.info("asked the autoscaler for %d worker bundle(s)", len(bundles))
        self._sent_at = now

    def _bundles_now(self) -> list[dict[str, float]]:
        """The bundles to ask for now: live nodes decide the device ('auto') and which
        doomed or cordoned nodes need a replacement (`ray.nodes()`)."""
        from spotline.runtime.placement import held_out_nodes, usable_nodes

        device = self.device
        if device == "auto":
            # Asked for as the next group would run: GPU bundles once a GPU node is up.
            # A job that must wait for GPU nodes on a cluster with none says device: gpu.
            from spotline.runtime.rendezvous import decide_device

            device = decide_device("auto", usable_nodes())
        return demand_bundles(self.spec, device, held_out_nodes(self.cordoned))

    def _sender(self) -> Callable[[list[dict[str, float]]], None]:
        """What sends `bundles` to Ray's autoscaling coordinator (a private module of
        Ray's: it may move in another Ray version)."""
        import ray

        from spotline.compat.ray import request_resources

        coordinator = self._actor()

        def send(bundles: list[dict[str, float]]) -> None:
            ray.get(
                request_resources(
                    coordinator, self.requester, bundles, constants.SPOTLINE_DEMAND_EXPIRE_S
                ),
                timeout=constants.SPOTLINE_DEMAND_RPC_TIMEOUT_S,
            )

        return send

    def _failed(self, doing: str, e: Exception) -> None:
        """One warning per distinct cause (what failed, and the error's type), however
        often it fails again; a success in between makes the next failure news."""
        cause = (doing, type(e).__name__)
        if cause in self._said:
            log.debug("the autoscaler's demand failed again: %s: %s", doing, e)
            return
        self._said.add(cause)
        moved = isinstance(e, ImportError)
        self._event(
            f"could not tell the autoscaler what the job needs ({doing}: {type(e).__name__}: "
            f"{e}); the job trains on the nodes that are up, and the cluster grows only for "
            + (
                "other demand. This Ray version moved its autoscaling coordinator: run "
                "Spotline with the Ray version it pins"
                if moved
                else "other demand until a retry, every "
                f"{constants.SPOTLINE_DEMAND_REFRESH_S:.0f}s (SPOTLINE_DEMAND_REFRESH_S), "
                "gets through"
            ),
            logging.WARNING,
        )

    def withdraw(self) -> None:
        if self._sent_at is None and self._coordinator is None:
            return
        import ray

        from spotline.compat.ray import cancel_request

        self._sent_at = None
        try:
            ray.get(
                cancel_request(self._actor(), self.requester),
                timeout=constants.SPOTLINE_DEMAND_RPC_TIMEOUT_S,
            )
        except Exception as e:  # noqa: BLE001 - it lapses by itself
            log.warning(
                "could not withdraw the job's request to the autoscaler (%s); it lapses "
                "within %.0fs (SPOTLINE_DEMAND_EXPIRE_S)",
                e,
                constants.SPOTLINE_DEMAND_EXPIRE_S,
            )
