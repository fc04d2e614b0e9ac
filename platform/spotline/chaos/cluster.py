"""A local multi-node Ray cluster of simulated spot nodes, and what a cloud does to them.

`LocalSpotCluster` starts an on-demand head and N spot nodes on 127.0.0.1 with
`ray.cluster_utils.Cluster` (one raylet per node). Each spot node offers `slots` units
of the custom resource `spot_gpu`, which every worker of a job adapted for it asks for
as a GPU worker asks for a GPU: placement, draining and node loss behave as on a GPU
cluster while the ranks compute on CPU.

- `notice(n, deadline_s)`: Ray's GCS drains the node with that deadline (what the
  autoscaler and KubeRay do on a cloud's notice); it goes when the deadline passes.
- `lose(n)`: the node and every process on it vanish at once (SIGKILL).
- `join()`: a fresh spot node joins; it takes the next number.

It stops only what it started: the cluster's own processes, by their pids (never a
`ray stop`). Adding a node starts processes, which Ray does from the main thread only;
a noticed node's going may run on a timer thread.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

NODE_DEATH_CONFIG = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
"""Ray's system config for a cluster of simulated nodes: its GCS declares a killed node
dead after three failed health checks a second apart, about 6 s here (Ray's default, five
3 s apart, about 16 s). A trace's next `join` waits for it: the cluster counts its nodes
first."""
RAY_DEFAULT_NODE_DEATH = {"health_check_period_ms": 3000, "health_check_failure_threshold": 5}


def node_death_note() -> str:
    """What the rehearsal's node-death timing does to the figures of a loss, in words."""
    ours, ray = NODE_DEATH_CONFIG, RAY_DEFAULT_NODE_DEATH
    return (
        f"this rehearsal's Ray declares a killed node dead after "
        f"{ours['health_check_failure_threshold']} failed health checks "
        f"{ours['health_check_period_ms'] / 1000:g}s apart, where Ray's default is "
        f"{ray['health_check_failure_threshold']} checks {ray['health_check_period_ms'] / 1000:g}s "
        "apart (about 6 s against 16 s): on a cluster with Ray's defaults, a loss without "
        "notice is declared later, and its 'training again' time may be that much longer"
    )


@dataclass(frozen=True)
class SpotNodeShape:
    """What one simulated spot node offers Ray."""

    slots: int = 2
    """Units of `spot_gpu`: the workers it holds (one replica's stages)."""
    cpus: float = 2.0
    """Logical CPUs (the machine's cores are shared by every node)."""
    object_store_mb: int = 200

    def node_args(self) -> dict[str, Any]:
        return {
            "num_cpus": max(1, math.ceil(self.cpus)),
            "num_gpus": 0,
            "resources": {"spot_gpu": self.slots},
            "object_store_memory": self.object_store_mb * 1024**2,
        }


@dataclass
class NodeEvent:
    """What the cluster did to a node, and when (wall clock)."""

    t: float
    kind: str  # 'start', 'notice', 'gone', 'loss', 'join'
    node: int
    node_id: str
    deadline_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"t": self.t, "kind": self.kind, "node": self.node, "node_id": self.node_id}
        if self.deadline_s is not None:
            out["deadline_s"] = self.deadline_s
        return out


@dataclass
class LocalSpotCluster:
    """N simulated spot nodes and an on-demand head, all on 127.0.0.1."""

    nodes: int = 2
    shape: SpotNodeShape = field(default_factory=SpotNodeShape)
    dashboard: bool = False
    """Start Ray's dashboard (its state API) on a free port of 127.0.0.1."""
    worker_env: dict[str, str] = field(default_factory=dict)
    """Environment variables for every process the nodes start (the jobs' workers
    included). Each node's raylet holds them and its workers inherit them: given as a
    runtime_env instead, they would make Ray start every worker through its setup
    process (a second interpreter importing Ray), about a second more per job here."""
    head_cpus: int = 2

    def __post_init__(self) -> None:
        import ray
        from ray.cluster_utils import Cluster

        from spotline.compat.ray import head_with_system_config
        from spotline.runtime.cluster import bind_to_loopback

        if ray.is_initialized():
            raise RuntimeError(
                "this process is connected to a Ray cluster already; ray.shutdown() it "
                "before starting a local spot cluster"
            )
        bind_to_loopback()
        self._lock = threading.RLock()
        self._timers: list[threading.Timer] = []
        self.log: list[NodeEvent] = []
        head: dict[str, Any] = {
            "num_cpus": self.head_cpus,
            "num_gpus": 0,
            "include_dashboard": self.dashboard,
            # A port of its own even without the dashboard: Ray binds it anyway, and
            # another cluster on this machine may hold the default one.
            "dashboard_port": _free_port(),
            "env_vars": dict(self.worker_env),
        }
        self.cluster = Cluster(
            initialize_head=True, head_node_args=head_with_system_config(head, NODE_DEATH_CONFIG)
        )
        self.by_number: dict[int, Any] = {}
        """Node number -> its Ray node while it is up."""
        self.ids: dict[int, str] = {}
        """Node number -> its Ray node id (kept after it is gone)."""
        self._next = 0
        try:
            for _ in range(self.nodes):
                self._add("start")
            self.cluster.wait_for_nodes()
            ray.init(
                address=self.cluster.address,
                log_to_driver=False,
                logging_level="ERROR",
            )
        except BaseException:
            self.cluster.shutdown()
            raise

    # --- what the cloud does -------------------------------------------------------------

    def notice(self, node: int, deadline_s: float, then_remove: bool = True) -> str:
        """A preemption notice for spot node `node`: Ray drains it with the deadline; with
        `then_remove`, it goes when the deadline passes. Returns its node id."""
        from spotline.compat.ray import drain_for_preemption

        with self._lock:
            n = self._live(node)
            drain_for_preemption(
                n.node_id, "spot preemption (spotline chaos)", time.time() + deadline_s
            )
            self.log.append(NodeEvent(time.time(), "notice", node, n.node_id, deadline_s))
        if then_remove:
            timer = threading.Timer(deadline_s, self._gone, args=(node,))
            timer.daemon = True
            timer.start()
            self._timers.append(timer)
        return n.node_id

    def lose(self, node: int, kind: str = "loss") -> str:
        """Spot node `node` vanishes with every process on it, at once. Returns its id."""
        with self._lock:
            n = self._live(node)
            _kill_node(n)
            with contextlib.suppress(Exception):  # its processes are dead already
                self.cluster.remove_node(n, allow_graceful=False)
            del self.by_number[node]
            self.log.append(NodeEvent(time.time(), kind, node, n.node_id))
            return n.node_id

    def join(self) -> int:
        """A fresh spot node joins (call from the main thread); returns its number."""
        with self._lock:
            number = self._add("join")
        self.cluster.wait_for_nodes()
        return number

    def _gone(self, node: int) -> None:
        with self._lock:
            if node in self.by_number:
                self.lose(node, kind="gone")

    # --- reading and resetting -----------------------------------------------------------

    @property
    def address(self) -> str:
        return self.cluster.address

    def live(self) -> list[int]:
        """Numbers of the spot nodes that are up (drained ones included)."""
        with self._lock:
            return sorted(self.by_number)

    def node_id(self, node: int) -> str:
        return self.ids[node]

    def number(self, node_id: str) -> int:
        """The number of the spot node with Ray id `node_id`."""
        for n, i in self.ids.items():
            if i == node_id:
                return n
        raise KeyError(f"no spot node has id {node_id}")

    def reset(self, nodes: int | None = None) -> None:
        """Exactly `nodes` (default: as at the start) healthy spot nodes: noticed ones go
        now, and fresh ones join. Call from the main thread."""
        from spotline.compat.ray import draining_nodes

        want = self.nodes if nodes is None else nodes
        for t in self._timers:
            t.cancel()
        self._timers.clear()
        draining = set(draining_nodes(10.0))
        for n in self.live():
            if self.ids[n] in draining:
                self.lose(n, kind="gone")
        while len(self.live()) > want:
            self.lose(self.live()[-1], kind="gone")
        while len(self.live()) < want:
            self.join()

    def close(self) -> None:
        """Disconnect and end every process of this cluster (and only those)."""
        import ray

        for t in self._timers:
            t.cancel()
        with contextlib.suppress(Exception):
            ray.shutdown()
        with self._lock:
            for n in list(self.by_number.values()):
                _kill_node(n)
            self.cluster.shutdown()

    def __enter__(self) -> LocalSpotCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- inside ----------------------------------------------------------------------------

    def _add(self, kind: str) -> int:
        number = self._next
        # Each node unpacks the job's runtime_env (its working_dir, py_modules) in a
        # folder of its own, as a real node does on its own disk. In the one session
        # folder the nodes here share, a node that has not unpacked a package yet
        # removes the copy another node unpacked and unpacks it again, under the
        # processes that run in it.
        node = self.cluster.add_node(
            **self.shape.node_args(),
            env_vars=dict(self.worker_env),
            runtime_env_dir_name=f"runtime_resources_node{number}",
        )
        self._next += 1
        self.by_number[number] = node
        self.ids[number] = node.node_id
        self.log.append(NodeEvent(time.time(), kind, number, node.node_id))
        return number

    def _live(self, node: int) -> Any:
        n = self.by_number.get(node)
        if n is None:
            have = ", ".join(map(str, sorted(self.by_number))) or "none"
            raise KeyError(f"spot node {node} is not up (up now: {have})")
        return n


def _kill_node(node: Any) -> None:
    """SIGKILL every process of a simulated node and their children (the workers its
    raylet started, the job's ranks and keepers there): a removed node's workers would
    otherwise linger a moment and could finish an upload a real loss never finishes."""
    import psutil

    from spotline.compat.ray import node_pids

    procs: list[psutil.Process] = []
    for pid in node_pids(node):
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            procs += [*p.children(recursive=True), p]
    for p in procs:
        if p.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error, OSError):
            p.send_signal(signal.SIGKILL)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
