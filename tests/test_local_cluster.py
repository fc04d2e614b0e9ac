"""The embedded local cluster (`spotline run` with no address) listens on loopback only.

Run in a fresh interpreter: the choice is made once per process, before Ray starts,
and this test process already hosts the shared test cluster.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

_SCRIPT = r"""
import ipaddress, json, os, psutil
os.environ.pop("RAY_ADDRESS", None)
from spotline.runtime.cluster import connect_ray
import ray
connect_ray(None)

@ray.remote
class A:
    def ping(self):
        return ray.util.get_node_ip_address()

ip = ray.get(A.remote().ping.remote())
node = ray.nodes()[0]
procs = [psutil.Process()] + psutil.Process().children(recursive=True)
listening = []
for p in procs:
    try:
        conns = p.net_connections(kind="inet")
    except psutil.Error:
        continue
    for c in conns:
        if c.status == psutil.CONN_LISTEN or c.type == 2:
            listening.append([p.name(), c.laddr.ip, c.laddr.port])
print(json.dumps({"actor_ip": ip, "node_ip": node["NodeManagerAddress"],
                  "gcs": ray.get_runtime_context().gcs_address, "listening": listening}))
ray.shutdown()
"""


def test_the_embedded_cluster_binds_to_loopback_only():
    """And it is a cluster of its own: Ray's address file names a cluster that is gone
    (another run's, killed), which a bare `ray.init()` would retry for minutes."""
    with tempfile.TemporaryDirectory(
        prefix="sl-", dir="/tmp", ignore_cleanup_errors=True
    ) as tmp:  # short socket paths
        stale = Path(tmp, "ray")
        stale.mkdir()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens once it closes
        (stale / "ray_current_cluster").write_text(dead)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        out = subprocess.run(
            [sys.executable, "-c", _SCRIPT],
            capture_output=True,
            text=True,
            timeout=180,
            env={**env, "RAY_TMPDIR": tmp},
        )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["node_ip"] == "127.0.0.1" and report["actor_ip"] == "127.0.0.1"
    assert report["gcs"].startswith("127.0.0.1:") and report["gcs"] != dead
    assert len(report["listening"]) >= 5  # GCS, raylet, agents, metrics, workers
    loopback = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
    wide = [entry for entry in report["listening"] if entry[1] not in loopback]
    assert not wide, wide
