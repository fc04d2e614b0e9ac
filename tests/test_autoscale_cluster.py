"""Spotline on a real autoscaling Ray cluster: Ray's autoscaler with its fake
multi-node provider (tests/cluster_fixture.py), spot nodes launched only for demand.

The workers ask for the custom resource `spot_gpu` that only the spot node type offers
(and train on CPU with gloo, `resources.device: cpu`): the job's bundle is one the head
cannot hold, as a GPU bundle is on a real cluster, while no worker needs CUDA.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

import spotline
from cluster_fixture import AutoscalingTestCluster, wait_for
from conftest import tiny_spec

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

MAX_REPLICAS = 2


@pytest.fixture(scope="module")
def autoscaling_cluster():
    import ray

    had = ray.is_initialized()
    ray.shutdown()
    c = AutoscalingTestCluster.start()
    try:
        ray.init(
            address=c.address,
            log_to_driver=False,
            logging_level="WARNING",
            runtime_env={"env_vars": {"SPOTLINE_DIST_TIMEOUT_S": "120"}},
        )
        yield c
    finally:
        ray.shutdown()
        c.stop()
        if had:
            from conftest import init_local_ray

            init_local_ray()


def _spot_nodes() -> list[dict[str, Any]]:
    import ray

    return [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("spot_gpu")]


def _pending_requests() -> list[dict[str, float]]:
    """The resource requests the autoscaler is asked to satisfy (`request_resources`)."""
    from ray.autoscaler._private.constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(raw) if raw else []


def _spec(tmp_path: Path, name: str, **over: Any):
    base = {
        "parallel.pipeline_stages": 1,
        "resources.device": "cpu",
        "resources.stages": [{"resources": {"spot_gpu": 1}}],
        "elastic.min_replicas": 1,
        "elastic.max_replicas": MAX_REPLICAS,
        "elastic.wait_for_capacity_s": 240,
        "train.steps": 200_000,  # long enough that growing pays; stopped by the test
        "checkpoint.keep_last": 100,
    }
    return tiny_spec(tmp_path, name, **{**base, **over})


def _wait(run: spotline.JobRun, pred, what: str, timeout: float = 240) -> dict[str, Any]:
    st: dict[str, Any] = {}

    def check():
        nonlocal st
        st = run.status()
        assert st["state"] not in ("finished", "failed"), _brief(st)
        return pred(st)

    try:
        wait_for(check, what, timeout)
    except AssertionError as e:
        raise AssertionError(f"{e}; last status: {_brief(st)}") from None
    return st


def _brief(st: dict[str, Any]) -> dict[str, Any]:
    return {k: st.get(k) for k in ("state", "step", "replicas", "committed_steps", "error")} | {
        "events": st.get("events", [])[-20:]
    }


def _result(run: spotline.JobRun) -> dict[str, Any]:
    import ray

    return ray.get(run.controller.result.remote())


def _kill_node(node_id: str, cluster: AutoscalingTestCluster) -> None:
    """The node's instance is gone: its raylet and every process on it die at once (the
    fake provider names each node's processes by RAY_OVERRIDE_NODE_ID_FOR_TESTING)."""
    import psutil

    procs = [
        p
        for p in cluster.processes()
        if p.environ().get("RAY_OVERRIDE_NODE_ID_FOR_TESTING") == node_id
    ]
    assert procs, f"no process of node {node_id}"
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
    psutil.wait_procs(procs, timeout=10)


def _drain(node_id: str, seconds: float) -> None:
    """What the autoscaler and KubeRay do on a spot preemption."""
    import ray
    from ray.core.generated import autoscaler_pb2

    gcs = ray._private.worker.global_worker.gcs_client
    accepted, why = gcs.drain_node(
        node_id,
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        "spot preemption (test)",
        int((time.time() + seconds) * 1000),
    )
    assert accepted, why


def test_a_job_submitted_with_no_worker_node_starts_and_grows_to_max_replicas(
    autoscaling_cluster: AutoscalingTestCluster, tmp_path: Path
) -> None:
    wait_for(lambda: not _spot_nodes(), "the idle spot nodes to be removed", 120)
    run = spotline.Job(_spec(tmp_path, "from-zero")).start()
    try:
        # The job's demand is what makes the autoscaler launch nodes at all.
        wait_for(lambda: len(_pending_requests()) == MAX_REPLICAS, "the job's demand", 60)
        assert all(r.get("spot_gpu") == 1 for r in _pending_requests())
        _wait(run, lambda s: s["state"] == "running" and s["step"] >= 1, "the first step")
        st = _wait(
            run,
            lambda s: s["replicas"] == MAX_REPLICAS and s["state"] == "running",
            "max_replicas",
        )
        _wait(run, lambda s: s["step"] >= st["step"] + 2, "training at max_replicas")
        assert len({w["node_id"] for w in run.status()["workers"]}) == MAX_REPLICAS
    finally:
        assert run.stop().state == "stopped"
    # Withdrawn at the end: the autoscaler may let the nodes go.
    assert _pending_requests() == []


def test_a_lost_node_leaves_the_job_training_on_the_survivor_and_asking_for_more(
    autoscaling_cluster: AutoscalingTestCluster, tmp_path: Path
) -> None:
    """The fake provider is not told that a node whose processes died is gone (it shows
    it as pending), so it never relaunches it; what is checked is that the job keeps
    training on the survivor, from its latest commit, still stating its whole demand,
    and that a node which joins afterwards is counted for it."""
    from spotline.runtime.cluster import RayClusterView

    spec = _spec(tmp_path, "lose-a-node")
    run = spotline.Job(spec).start()
    try:
        _wait(
            run,
            lambda s: s["replicas"] == MAX_REPLICAS and s["state"] == "running" and s["step"] >= 1,
            "max_replicas",
        )
        st = _wait(run, lambda s: s["committed_steps"], "a committed step")
        committed = max(st["committed_steps"])
        victim = next(w["node_id"] for w in st["workers"] if w["rank"] == 1)
        _kill_node(victim, autoscaling_cluster)
        st = _wait(
            run,
            lambda s: s["replicas"] == 1 and s["state"] == "running" and s["step"] > committed,
            "training on the survivor",
        )
        assert victim not in {w["node_id"] for w in st["workers"]}
        assert len(_pending_requests()) == MAX_REPLICAS  # the whole demand, still stated
        res = _result(run)
        assert res["node_losses"] >= 1 and res["failures"] == 0
        # No committed step is lost: the survivor resumed from the latest commit.
        lost_at = next(i for i, a in enumerate(res["attempts"]) if a["ended_by"] == "node lost")
        assert res["attempts"][lost_at + 1]["restored_from"] >= committed

        autoscaling_cluster.add_spot_node()
        view = RayClusterView(spec, "cpu")
        wait_for(lambda: view.capacity() >= 1, "the new node counted for the job", 60)
    finally:
        assert run.stop().state == "stopped"
    assert _pending_requests() == []


def test_a_noticed_node_is_drained_and_never_counted_while_the_demand_stands(
    autoscaling_cluster: AutoscalingTestCluster, tmp_path: Path
) -> None:
    from spotline.runtime.cluster import RayClusterView

    over = {"preemption.sources": [{"kind": "ray-drain", "poll_interval_s": 0.2}]}
    spec = _spec(tmp_path, "noticed", **over)
    run = spotline.Job(spec).start()
    try:
        st = _wait(
            run,
            lambda s: s["replicas"] == MAX_REPLICAS and s["state"] == "running" and s["step"] >= 1,
            "max_replicas",
        )
        victim = next(w["node_id"] for w in st["workers"] if w["rank"] == 1)
        _drain(victim, seconds=600)
        st = _wait(
            run,
            lambda s: s["replicas"] == 1 and s["state"] == "running",
            "training on the node without a notice",
        )
        assert victim not in {w["node_id"] for w in st["workers"]}
        # The noticed node is free again, but neither the job nor its capacity count it.
        assert RayClusterView(spec, "cpu").capacity() == 0
        assert len(_pending_requests()) == MAX_REPLICAS
        assert run.status()["replicas"] == 1
    finally:
        assert run.stop().state == "stopped"
    assert _pending_requests() == []


def test_capacity_counts_a_node_only_when_the_whole_bundle_fits(
    autoscaling_cluster: AutoscalingTestCluster, tmp_path: Path
) -> None:
    from ray.autoscaler.sdk import request_resources

    from spotline.runtime.cluster import RayClusterView

    request_resources(bundles=[{"spot_gpu": 1}])
    try:
        wait_for(_spot_nodes, "a spot node", 120)
        fits = _spec(tmp_path, "fits", **{"resources.cpus_per_worker": 2})
        too_big = _spec(tmp_path, "too-big", **{"resources.cpus_per_worker": 3})
        # A free GPU (and spot_gpu) on the node, but not the CPUs of the bundle.
        assert RayClusterView(fits, "gpu").capacity() >= 1
        assert RayClusterView(too_big, "gpu").capacity() == 0
    finally:
        request_resources(bundles=[])
