"""A local autoscaling Ray cluster: Ray's own autoscaler with its fake multi-node
provider, as `ray.cluster_utils.AutoscalingCluster` builds it, but started and stopped
here so that nothing touches any other Ray cluster on the machine.

The head holds no GPU, like an on-demand head. The `spot` node type has one logical GPU,
two CPUs and the custom resource `spot_gpu`; the autoscaler launches 0 to 3 of them on
demand and removes idle ones after a few seconds. Every process of the cluster (the
head's, the autoscaler's, each fake node's raylet and workers) inherits a marker in its
environment; teardown ends exactly the processes that carry it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from spotline.chaos.cluster import NODE_DEATH_CONFIG
from spotline.compat.ray import drain_for_preemption, start_node

MAX_SPOT_NODES = 3
SPOT_NODE = {"CPU": 2, "GPU": 1, "spot_gpu": 1}
_OBJECT_STORE_BYTES = 200 * 1024**2
_MARK = "SPOTLINE_TEST_CLUSTER"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def autoscaling_config(gcs_address: str, min_workers: int = 0) -> dict:
    """Ray's fake_multi_node/example.yaml, with this cluster's node types."""
    return {
        "cluster_name": "spotline-autoscale-test",
        "max_workers": MAX_SPOT_NODES,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            # Fake nodes join this GCS (the provider's default is port 6379).
            "gcs_address": gcs_address,
        },
        "available_node_types": {
            "ray.head.default": {
                "resources": {"CPU": 2, "GPU": 0},
                "node_config": {},
                "max_workers": 0,
            },
            "spot": {
                "resources": {**SPOT_NODE, "object_store_memory": _OBJECT_STORE_BYTES},
                "node_config": {},
                "min_workers": min_workers,
                "max_workers": MAX_SPOT_NODES,
            },
        },
        "head_node_type": "ray.head.default",
        "auth": {},
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 0.1,
        "docker": {},
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
    }


@dataclass
class AutoscalingTestCluster:
    address: str
    temp_dir: Path
    mark: str
    worker_env: dict[str, str] = field(default_factory=dict)
    """In the environment of every node's processes (the fake provider's nodes inherit
    the head's), so every worker has it."""
    extra_nodes: dict = field(default_factory=dict)  # node id -> its Ray node (`start_node`)

    @classmethod
    def start(cls, worker_env: dict[str, str]) -> AutoscalingTestCluster:
        port = _free_port()
        address = f"127.0.0.1:{port}"
        temp_dir = Path(
            tempfile.mkdtemp(prefix="sl-as-", dir="/tmp")
        )  # Ray's socket paths are short
        config = temp_dir / "autoscaling.json"
        config.write_text(json.dumps(autoscaling_config(address)))
        mark = uuid.uuid4().hex
        # `ray start` turns token authentication on (the token in ~/.ray/auth_token); this
        # process's clients send it only in token mode, which the core reads once per
        # process: the same mode a local `ray.init` sets, so both kinds of cluster work
        # from one test session.
        os.environ["RAY_AUTH_MODE"] = "token"
        env = {
            **os.environ,
            **worker_env,
            _MARK: mark,
            "RAY_FAKE_CLUSTER": "1",
            "AUTOSCALER_UPDATE_INTERVAL_S": "1",
            # A node that stops answering is terminated (and so replaced) after 5 s, as
            # a cloud reports a preempted instance gone.
            "AUTOSCALER_HEARTBEAT_TIMEOUT_S": "5",
            # A removed node is declared dead in about 6 s, not 16.
            **{f"RAY_{k}": str(v) for k, v in NODE_DEATH_CONFIG.items()},
            # Every node of this cluster, the fake ones too, binds to 127.0.0.1.
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        # Every fixed default port of a head may be taken by another cluster here.
        agent, agent_grpc, metrics, rt_env, client = (_free_port() for _ in range(5))
        cluster = cls(address, temp_dir, mark, dict(worker_env))
        try:
            subprocess.run(
                [
                    "ray",
                    "start",
                    "--head",
                    f"--autoscaling-config={config}",
                    "--node-ip-address=127.0.0.1",
                    f"--port={port}",
                    f"--temp-dir={temp_dir}",
                    "--num-cpus=2",
                    "--num-gpus=0",
                    f"--object-store-memory={_OBJECT_STORE_BYTES}",
                    "--include-dashboard=false",
                    "--disable-usage-stats",
                    f"--dashboard-agent-listen-port={agent}",
                    f"--dashboard-agent-grpc-port={agent_grpc}",
                    f"--metrics-export-port={metrics}",
                    f"--runtime-env-agent-port={rt_env}",
                    f"--ray-client-server-port={client}",
                ],
                env=env,
                check=True,
                capture_output=True,
                timeout=120,
            )
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def add_spot_node(self) -> str:
        """A spot node that joins by itself, started as the fake provider starts the
        ones it launches (its processes carry the cluster's marker and its node id);
        returns its node id."""

        node_id = uuid.uuid4().hex + uuid.uuid4().hex[:24]  # 28 bytes, as Ray's

        self.extra_nodes[node_id] = start_node(
            node_ip_address="127.0.0.1",
            gcs_address=self.address,
            min_worker_port=0,
            max_worker_port=0,
            dashboard_port=None,
            dashboard_agent_listen_port=0,
            num_cpus=SPOT_NODE["CPU"],
            num_gpus=SPOT_NODE["GPU"],
            resources={"spot_gpu": SPOT_NODE["spot_gpu"]},
            object_store_memory=_OBJECT_STORE_BYTES,
            env_vars={
                **self.worker_env,
                _MARK: self.mark,
                "RAY_OVERRIDE_NODE_ID_FOR_TESTING": node_id,
            },
        )
        return node_id

    def remove_added_nodes(self) -> None:
        """Every node `add_spot_node` started goes, as an instance the cloud takes back:
        the fake provider does not know them, so its idle timeout never removes them, and
        a node left over from one test would be capacity the next one does not expect."""
        import ray

        gone = list(self.extra_nodes)
        for node_id in gone:
            self.kill_node(node_id, missing_ok=True)
            del self.extra_nodes[node_id]
        # Until Ray's health check marks them dead, a next job would still count them.
        wait_for(
            lambda: not {n["NodeID"] for n in ray.nodes() if n["Alive"]} & set(gone),
            "the removed nodes to be marked dead",
            120,
        )

    def kill_node(self, node_id: str, missing_ok: bool = False) -> None:
        """The node's instance is gone: its raylet and every process on it die at once
        (each node's processes carry its id in RAY_OVERRIDE_NODE_ID_FOR_TESTING)."""
        import psutil

        procs = []
        for p in self.processes():
            with contextlib.suppress(psutil.Error):  # gone meanwhile, or a zombie
                if p.environ().get("RAY_OVERRIDE_NODE_ID_FOR_TESTING") == node_id:
                    procs.append(p)
        assert procs or missing_ok, f"no process of node {node_id}"
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(procs, timeout=10)

    def processes(self) -> list:
        """Every live process of this cluster: found by the marker in its environment, or
        by its session directory under the cluster's own temp dir (Ray starts a few, such
        as the head's log monitor, with an environment of their own)."""
        import psutil

        out = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if p.environ().get(_MARK) == self.mark or any(
                    str(self.temp_dir) in arg for arg in p.cmdline()
                ):
                    out.append(p)
        return out

    def stop(self) -> None:
        import psutil

        for node in self.extra_nodes.values():
            with contextlib.suppress(Exception):
                node.kill_all_processes(check_alive=False, allow_graceful=False)

        # SIGKILL at once: the cluster and its folder go, nothing of it is kept (one of
        # its processes outwaits a SIGTERM by 10 s).
        procs = self.processes()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(procs, timeout=10)
        # The same search again: a process started while the first ones were ending.
        for p in self.processes():
            with contextlib.suppress(psutil.Error):
                p.kill()
        import shutil

        shutil.rmtree(self.temp_dir, ignore_errors=True)


def wait_for(pred, what: str, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def drain_node(node_id: str, seconds: float) -> None:
    """A spot preemption notice as Ray's autoscaler and KubeRay give it: the GCS drains
    the node with a deadline `seconds` from now."""
    accepted, why = drain_for_preemption(node_id, "spot preemption (test)", time.time() + seconds)
    assert accepted, why
