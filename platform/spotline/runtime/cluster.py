"""Connecting to Ray, and what the controller asks of the cluster apart from its workers.

`ClusterView` is the interface (controller tests pass a scripted one); `RayClusterView`
answers from the live Ray cluster: capacity in whole replicas, which nodes are alive,
draining a doomed node so Ray places nothing new on it, and one notice watcher actor
per node.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from typing import Any, Protocol

from spotline import constants
from spotline.config.schema import JobSpec
from spotline.runtime.group import usable_nodes
from spotline.runtime.rendezvous import decide_device

log = logging.getLogger("spotline.controller")


def bind_to_loopback() -> None:
    """Make every Ray node this process starts from now on listen on 127.0.0.1 alone:
    `ray.init()`'s local cluster, and each node of a `ray.cluster_utils.Cluster` (tests
    and benchmarks build multi-node clusters that way, one raylet per node, all on
    loopback). Attaching to an existing cluster is unchanged."""
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # read by Ray each time it resolves the node IP
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # and by any Ray process started here


def connect_ray(address: str | None) -> None:
    """Connect this driver to Ray: the cluster at `address` (or RAY_ADDRESS), else a new
    local cluster that listens on 127.0.0.1 only.

    Ray binds a new node to the machine's routable IP (GCS, raylet, workers, metrics
    endpoints on every interface) unless it runs as a single-machine cluster; Spotline
    starts it that way, so an embedded cluster is reachable from this machine alone.
    The same setting lets this process find such a cluster with address="auto", and
    does not change how it attaches to a real cluster.
    """
    import ray

    if ray.is_initialized():
        return
    bind_to_loopback()
    # Worker and controller logs stay in their actor logs (Ray dashboard, `ray logs`);
    # the driver prints the controller's events, and failures arrive grouped by rank.
    ray.init(address=address, logging_level="WARNING", log_to_driver=False)


class ClusterView(Protocol):
    def capacity(self, held_workers: int = 0) -> int:
        """Whole replicas the schedulable devices can hold: free ones plus `held_workers`
        (devices the job's own live group holds and would give back on a restart)."""
        ...

    def gone(self, node_ids: set[str]) -> set[str]:
        """The nodes of `node_ids` that are lost: dead to Ray, or not answering."""
        ...

    def drain(self, node_id: str, deadline: float, reason: str) -> bool:
        """Stop placing work on `node_id` (it goes at `deadline`); False when refused."""
        ...

    def watch(self) -> None:
        """Make sure every live node has a notice watcher (nodes come and go)."""
        ...

    def close(self) -> None: ...


def worker_slots(spec: JobSpec, device: str, resources: dict[str, float]) -> int:
    """How many workers of this job fit in `resources`."""
    if device == "gpu":
        return int(resources.get("GPU", 0) + 1e-9)
    pp = spec.parallel.pipeline_stages
    per = sum(spec.resources.stage(s).cpus for s in range(pp)) / pp  # stages may differ
    return int(resources.get("CPU", 0) / per + 1e-9) if per > 0 else 10**6


class RayClusterView:
    def __init__(self, spec: JobSpec, device: str, controller: Any = None):
        self.spec = spec
        self.device = device
        self.controller = controller  # handle the watchers push notices to
        self._watchers: dict[str, Any] = {}
        self._sealed: Any = None  # the spec the watchers are given (SealedJob)

    def capacity(self, held_workers: int = 0) -> int:
        import ray
        from ray._private.state import available_resources_per_node

        # A draining node takes no new work, but its resources show as free again once
        # the job's own workers on it are gone: count only nodes that are not draining.
        try:
            draining = set(
                ray._private.worker.global_worker.gcs_client.get_draining_nodes(timeout=5)
            )
        except Exception as e:  # noqa: BLE001 - unknown drains: count what is free
            log.warning("could not ask Ray which nodes are draining: %s", e)
            draining = set()
        # Counted as the next group will run: 'auto' is decided from the nodes there are.
        device = decide_device(self.device, usable_nodes())
        free = sum(
            worker_slots(self.spec, device, res)
            for node, res in available_resources_per_node().items()
            if node not in draining
        )
        return (free + held_workers) // self.spec.parallel.pipeline_stages

    def _alive_nodes(self) -> set[str] | None:
        import ray

        try:
            return {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        except Exception as e:  # noqa: BLE001 - GCS briefly unreachable: unknown, not empty
            log.warning("could not list the cluster's nodes: %s", e)
            return None

    def gone(self, node_ids: set[str]) -> set[str]:
        import ray

        # Ray's health checks take several seconds to declare a node dead; a node whose
        # raylet refuses connections is gone already.
        try:
            nodes = {n["NodeID"]: n for n in ray.nodes()}
        except Exception as e:  # noqa: BLE001
            log.warning("could not list the cluster's nodes: %s", e)
            return set()
        out = set()
        for node_id in node_ids:
            n = nodes.get(node_id)
            if n is None or not n["Alive"]:
                out.add(node_id)
                continue
            try:
                socket.create_connection(
                    (n["NodeManagerAddress"], n["NodeManagerPort"]),
                    timeout=constants.SPOTLINE_NOTICE_HTTP_TIMEOUT_S,
                ).close()
            except OSError:
                out.add(node_id)
        return out

    def drain(self, node_id: str, deadline: float, reason: str) -> bool:
        import ray
        from ray.core.generated import autoscaler_pb2

        if node_id == ray.get_runtime_context().get_node_id():
            log.warning(
                "preemption notice for node %s, where the controller runs: not draining it. "
                "Keep the head node on-demand; the job's checkpoints survive it either way.",
                node_id[:12],
            )
            return False
        gcs = ray._private.worker.global_worker.gcs_client
        try:
            accepted, why = gcs.drain_node(
                node_id,
                autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                f"spotline: {reason}",
                int(deadline * 1000),
            )
        except Exception as e:  # noqa: BLE001 - the node may already be gone
            log.warning("draining node %s failed: %s", node_id[:12], e)
            return False
        if not accepted:
            log.warning("Ray refused to drain node %s: %s", node_id[:12], why)
        return bool(accepted)

    def watch(self) -> None:
        if self.controller is None:
            return
        from spotline.preemption.actor import NODE_WATCHED_KINDS

        if not any(s.kind in NODE_WATCHED_KINDS for s in self.spec.preemption.sources):
            return
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from spotline.preemption.actor import NodeWatcherActor, watcher_name
        from spotline.runtime.sealed import SealedJob

        alive = self._alive_nodes()
        if alive is None:
            return
        for node in list(self._watchers):
            if node not in alive:
                self._watchers.pop(node)
        if self._sealed is None:  # kept while watchers may start: it holds their secrets
            self._sealed = SealedJob(self.spec)
        for node in sorted(alive - set(self._watchers)):
            name = watcher_name(self.spec.name, node)
            with contextlib.suppress(ValueError):  # a watcher of an earlier controller
                ray.kill(ray.get_actor(name))
            self._watchers[node] = (
                ray.remote(NodeWatcherActor)
                .options(
                    name=name,
                    num_cpus=0,
                    max_restarts=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
                )
                .remote(self._sealed, node, self.controller)
            )

    def close(self) -> None:
        import ray

        for actor in self._watchers.values():
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        self._watchers.clear()
