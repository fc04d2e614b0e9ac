"""Connecting to Ray, and what the controller asks of the cluster apart from its workers.

`ClusterView` is the interface (controller tests pass a scripted one); `RayClusterView`
answers from the live Ray cluster: capacity in whole replicas of the real worker
bundle, fitted node by node, which nodes are alive,
draining a doomed node so Ray places nothing new on it, and one notice watcher actor
per node.

The job's cordon list lives here, once (`CordonList`, the view's `cordoned`): capacity,
the groups' placement and the autoscaler demand read it. Only the controller's
`Cordons` room changes it (cordon, lift, expire) and keeps it beside the checkpoints.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Iterator, Set
from dataclasses import dataclass
from typing import Any, Protocol

from spotline import constants
from spotline.config.schema import JobSpec
from spotline.runtime.placement import draining_nodes, usable_nodes, worker_bundle
from spotline.runtime.rendezvous import decide_device

log = logging.getLogger("spotline.controller")


def bind_to_loopback() -> None:
    """Make every Ray node this process starts from now on listen on 127.0.0.1 alone:
    `ray.init()`'s local cluster, and each node of a `ray.cluster_utils.Cluster` (tests
    and benchmarks build multi-node clusters that way, one raylet per node, all on
    loopback). Attaching to an existing cluster is unchanged."""
    from spotline.compat.ray import listen_on_loopback_only

    listen_on_loopback_only()
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # and by any Ray process started here


def connect_ray(address: str | None) -> None:
    """Connect this driver to Ray: the cluster at `address` (or RAY_ADDRESS), else a new
    local cluster that listens on 127.0.0.1 only.

    Ray binds a new node to the machine's routable IP (GCS, raylet, workers, metrics
    endpoints on every interface) unless it runs as a single-machine cluster; Spotline
    starts it that way, so an embedded cluster is reachable from this machine alone.
    The same setting lets this process find such a cluster with address="auto", and
    does not change how it attaches to a real cluster.

    Without an address, Ray itself would attach to whatever cluster its address file
    (/tmp/ray/ray_current_cluster) names: the latest `ray start` or test cluster on the
    machine, possibly long dead, where `ray.init` then retries for minutes. A new local
    cluster is what `spotline run` promises there, so it asks Ray for exactly that.
    """
    import ray

    if ray.is_initialized():
        return
    check_reachable(address)
    bind_to_loopback()
    # ray.init replaces the process's SIGTERM handler (and its core worker's crash
    # handler prints "*** SIGTERM received ... PC: @" for it): the handlers this process
    # chose before, such as the CLI's stop at a step boundary, are put back once Ray is up.
    main = threading.current_thread() is threading.main_thread()
    chosen = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)} if main else {}
    # Worker and controller logs stay in their actor logs (Ray dashboard, `ray logs`);
    # the driver prints the controller's events, and failures arrive grouped by rank.
    if address is None and not os.environ.get("RAY_ADDRESS"):
        address = "local"
    try:
        ray.init(address=address, logging_level="WARNING", log_to_driver=False)
    except SystemExit as e:
        # Ray's own handler, in place while it starts, ends the process on a SIGTERM
        # with SystemExit(SIGTERM), which no command reports: the handler chosen
        # before answers it instead (the CLI's says that nothing was committed).
        chosen_term = chosen.get(signal.SIGTERM)
        if e.code == signal.SIGTERM and callable(chosen_term):
            signal.signal(signal.SIGTERM, chosen_term)
            chosen_term(signal.SIGTERM, None)
        raise
    finally:
        for sig, handler in chosen.items():
            if callable(handler):
                signal.signal(sig, handler)


def cluster_candidates(address: str | None) -> list[str | None]:
    """The clusters a command reading a running job may mean by `address`: the one it
    names (or RAY_ADDRESS); for "auto" with several Ray clusters on this machine, each
    of them. Ray's "auto" picks one of several (the latest `ray start`'s, else any), and
    a local cluster that `spotline run` started is seldom that one."""
    if address not in (None, "auto") or os.environ.get("RAY_ADDRESS"):
        return [address]
    from spotline.compat.ray import local_gcs_addresses

    found = sorted(local_gcs_addresses())
    return list(found) if len(found) > 1 else [address]


def check_reachable(address: str | None) -> None:
    """ConnectionError at once when nothing listens at the cluster's address (`address`,
    or RAY_ADDRESS, which Ray prefers): `ray.init` would retry a dead address for
    minutes. A new local cluster (no address) and addresses Ray cannot find or parse are
    left to `ray.init`, which says so itself."""
    target = os.environ.get("RAY_ADDRESS") or address
    if not target or target == "local":
        return
    target = target.removeprefix("ray://").partition("/")[0]
    try:
        from spotline.compat import ray as ray_internals

        if target == "auto":
            target = ray_internals.address_from_environment("auto")
        host, port = ray_internals.parse_address(target) or ("", "")
        # Ray itself dials a loopback address at the node's own IP.
        hosts = dict.fromkeys([host, ray_internals.node_ip_for(host)])
    except Exception:  # noqa: BLE001 - no cluster found, or no address: ray.init tells
        return
    timeout = constants.SPOTLINE_RAY_CONNECT_TIMEOUT_S
    why = ""
    for h in hosts:
        try:
            socket.create_connection((h.strip("[]"), int(port)), timeout=timeout).close()
            return
        except (OSError, ValueError) as e:
            why = getattr(e, "strerror", None) or type(e).__name__
    raise ConnectionError(f"nothing answers at {host}:{port} ({why})")


@dataclass(frozen=True)
class Cordon:
    """One node kept out of the job's new groups: why, and when (wall-clock seconds, so
    that a controller started again for the same job can tell its age)."""

    node: str
    why: str
    at: float


class CordonList(Set):
    """The nodes the job keeps out of new groups, each with why and since when: a set of
    node IDs to its readers (`node in cordoned`, `set(cordoned)`).

    Changed by one owner only (`controller.cordons.Cordons`); every change replaces the
    mapping whole, so a reader on another thread (status) never sees it half-changed."""

    def __init__(self) -> None:
        self._by_node: dict[str, Cordon] = {}

    def __contains__(self, node: object) -> bool:
        return node in self._by_node

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._by_node))

    def __len__(self) -> int:
        return len(self._by_node)

    def __repr__(self) -> str:
        return f"CordonList({sorted(self._by_node)})"

    @classmethod
    def _from_iterable(cls, nodes) -> set[str]:
        """What set operations on the list return: a plain set of node IDs."""
        return set(nodes)

    def add(self, node: str, why: str, at: float) -> None:
        self._by_node = {**self._by_node, node: Cordon(node, why, at)}

    def lift(self, node: str) -> Cordon | None:
        by_node = dict(self._by_node)
        out = by_node.pop(node, None)
        self._by_node = by_node
        return out

    def get(self, node: str) -> Cordon | None:
        return self._by_node.get(node)

    def oldest_first(self) -> list[Cordon]:
        return sorted(self._by_node.values(), key=lambda c: (c.at, c.node))

    def why(self) -> dict[str, str]:
        """node -> why, as status shows it."""
        return {n: c.why for n, c in self._by_node.items()}


class ClusterView(Protocol):
    cordoned: CordonList
    """Nodes the job keeps out of new groups: never counted in the capacity."""

    def capacity(
        self,
        held_workers: int = 0,
        exclude: set[str] = frozenset(),
        lifted: set[str] = frozenset(),
    ) -> int:
        """Whole replicas the schedulable devices can hold: free ones plus `held_workers`
        (devices the job's own live group holds and would give back on a restart). The
        free devices of the nodes in `exclude` and of cordoned nodes do not count, except
        those of the cordoned nodes in `lifted` (what the capacity would be without their
        cordons)."""
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


def replicas_fit(
    replica: list[dict[str, float]], nodes: list[dict[str, float]], limit: int = 10**6
) -> int:
    """How many whole replicas (`replica`: one worker bundle per pipeline stage) fit in
    the free resources of `nodes`, each bundle on one node whole (GPU, CPU, accelerator
    type, custom resources), as Ray places a placement group's bundles: first fit, node
    by node. Free GPUs on a node without the CPUs or the label a bundle needs hold
    nothing."""
    if not any(replica):
        return limit  # the workers ask for nothing: nothing bounds them
    free = [dict(n) for n in nodes]
    count = 0
    while count < limit:
        for bundle in replica:
            node = next((n for n in free if _fits(bundle, n)), None)
            if node is None:
                return count
            for k, v in bundle.items():
                node[k] = node.get(k, 0.0) - v
        count += 1
    return count


def _fits(bundle: dict[str, float], node: dict[str, float]) -> bool:
    return all(node.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items() if v > 0)


class RayClusterView:
    def __init__(self, spec: JobSpec, device: str, controller: Any = None):
        self.spec = spec
        self.device = device
        self.controller = controller  # handle the watchers push notices to
        self._watchers: dict[str, Any] = {}
        self._sealed: Any = None  # the spec the watchers are given (SealedJob)
        self._noticed: set[str] = set()  # nodes with a preemption notice: never counted
        self.cordoned = CordonList()
        """Nodes the job keeps out of new groups: never counted; the worker groups'
        placement and the autoscaler demand exclude them (the same object)."""

    def capacity(
        self,
        held_workers: int = 0,
        exclude: set[str] = frozenset(),
        lifted: set[str] = frozenset(),
    ) -> int:
        from spotline.compat.ray import free_resources_per_node

        # A draining node takes no new work, but its resources show as free again once
        # the job's own workers on it are gone: count only live nodes that are not
        # draining, nor noticed (a notice whose drain Ray refused still dooms the node).
        draining = draining_nodes()  # unknown drains: count what is free
        alive = self._alive_nodes()
        nodes = [
            res
            for node, res in free_resources_per_node().items()
            if node not in draining
            and node not in self._noticed
            and (node not in self.cordoned or node in lifted)
            and node not in exclude
            and (alive is None or node in alive)
        ]
        pp = self.spec.parallel.pipeline_stages
        # Counted as the next group will run: 'auto' is decided from the nodes there are.
        device = decide_device(self.device, usable_nodes())
        replica = [worker_bundle(self.spec, device, s) for s in range(pp)]
        return replicas_fit(replica, nodes) + held_workers // pp

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

        from spotline.compat.ray import drain_for_preemption

        if node_id == ray.get_runtime_context().get_node_id():
            log.warning(
                "preemption notice for node %s, where the controller runs: not draining it. "
                "Keep the head node on-demand; the job's checkpoints survive it either way.",
                node_id[:12],
            )
            return False
        self._noticed.add(node_id)
        try:
            accepted, why = drain_for_preemption(node_id, f"spotline: {reason}", deadline)
        except Exception as e:  # noqa: BLE001 - the node may already be gone
            log.warning("draining node %s failed: %s", node_id[:12], e)
            return False
        if not accepted:
            log.warning("Ray refused to drain node %s: %s", node_id[:12], why)
        return bool(accepted)

    def watch(self) -> None:
        if self.controller is None:
            return
        from spotline.runtime.watchers import NODE_WATCHED_KINDS

        if not any(s.kind in NODE_WATCHED_KINDS for s in self.spec.preemption.sources):
            return
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from spotline.runtime.sealed import SealedJob
        from spotline.runtime.watchers import NodeWatcherActor, watcher_name

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
