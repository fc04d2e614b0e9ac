"""A real group on a local Ray cluster: its device and its ranks' shared GPUs.

This machine has no GPU, so the GPUs are Ray's logical ones (`num_gpus` of the node).
Each scenario runs in its own process with its own Ray cluster, so that the session's
cluster of the other `ray` tests is left as it is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

pytestmark = pytest.mark.ray

_MARK = "RENDEZVOUS-SCENARIO "

_SCENARIO = textwrap.dedent(
    """
    import json, sys
    import ray
    from spotline.checkpoint import CheckpointStore
    from spotline.config import load_spec
    from spotline.runtime.group import RayWorkerGroup
    from spotline.runtime.progress import WorkerFailure

    gpus, device, tmp = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    ray.init(address="local", num_cpus=2, num_gpus=gpus, include_dashboard=False,
             log_to_driver=False, logging_level="WARNING")
    spec = load_spec({
        "name": "rdzv",
        "model": {"n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 32},
        "elastic": {"min_replicas": 2, "max_replicas": 2},
        "train": {"steps": 4, "global_batch_size": 8},
        "checkpoint": {"uri": f"file://{tmp}/ckpt", "staging_dir": f"{tmp}/staging"},
        "resources": {"device": device, "cpus_per_worker": 0.5, "socket_ifname": "lo"},
    })
    group = RayWorkerGroup(spec, 2, CheckpointStore(spec.resolved_checkpoint_uri()), device)
    out = {}
    try:
        group.start()
        while not group.advance(0.25):
            pass
        out["started"] = True
    except WorkerFailure as e:
        out["error"] = str(e)
        out["causes"] = [type(c).__name__ for c in e.causes]
    out["device"] = group.device
    out["workers"] = group.worker_info()
    group.shutdown()
    ray.shutdown()
    print("RENDEZVOUS-SCENARIO " + json.dumps(out), flush=True)
    """
)


def _scenario(tmp_path, gpus: int, device: str, **env: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", _SCENARIO, str(gpus), device, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    for line in proc.stdout.splitlines():
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK) :])
    raise AssertionError(f"scenario gave no result (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


def test_ranks_on_one_node_share_its_gpus_and_never_fall_back_to_cpu(tmp_path):
    out = _scenario(tmp_path, gpus=2, device="auto")
    # auto saw a node with GPUs: the group is a GPU group.
    assert out["device"] == "gpu"
    workers = sorted(out["workers"], key=lambda w: w["rank"])
    assert sorted(w["local_rank"] for w in workers) == [0, 1]
    # Each rank sees both of the node's GPUs and drives the one Ray gave it.
    for w in workers:
        assert w["visible_devices"] == "0,1"
        assert w["visible_devices"].split(",")[w["local_rank"]] == w["gpu_ids"][0]
    # This torch has no CUDA: the ranks fail at their rendezvous with one clear line,
    # never training on the CPU instead.
    assert "started" not in out
    assert "SpecError" in out["causes"]
    assert "cannot use CUDA" in out["error"] and "\n" not in out["error"]
    assert "resources.device: cpu" in out["error"]


def test_device_gpu_with_no_gpu_node_waits_and_says_why(tmp_path):
    out = _scenario(tmp_path, gpus=0, device="gpu", SPOTLINE_WORKER_START_TIMEOUT_S="3")
    assert out["device"] == "gpu"
    assert "started" not in out and out["workers"] == []
    assert "no live node has a GPU" in out["error"]
    assert "never runs on CPU" in out["error"]
