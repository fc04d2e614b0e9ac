"""Spotline on a real autoscaling Ray cluster: Ray's autoscaler with its fake
multi-node provider (tests/cluster_fixture.py), spot nodes launched only for demand.

The workers ask for the custom resource `spot_gpu` that only the spot node type offers
(and train on CPU with gloo, `resources.device: cpu`): the job's bundle is one the head
cannot hold, as a GPU bundle is on a real cluster, while no worker needs CUDA.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

import spotline
from cluster_fixture import AutoscalingTestCluster, drain_node, wait_for
from conftest import CLUSTER_ENV, tiny_spec
from spotline import testing
from spotline.compat.ray import draining_nodes, requested_resources

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

MAX_REPLICAS = 2


@pytest.fixture(scope="module")
def autoscaling_cluster():
    import ray

    had = ray.is_initialized()
    ray.shutdown()
    c = AutoscalingTestCluster.start(CLUSTER_ENV)
    try:
        ray.init(
            address=c.address,
            log_to_driver=False,
            logging_level="WARNING",
        )
        yield c
    finally:
        ray.shutdown()
        c.stop()
        if had:
            from conftest import init_local_ray

            init_local_ray()


@pytest.fixture(autouse=True)
def _no_node_left_behind(autoscaling_cluster: AutoscalingTestCluster):
    yield
    autoscaling_cluster.remove_added_nodes()


def _spot_nodes() -> list[dict[str, Any]]:
    import ray

    return [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("spot_gpu")]


def _pending_requests() -> list[dict[str, float]]:
    """The resource requests the autoscaler is asked to satisfy (`request_resources`)."""
    return requested_resources()


def _spec(tmp_path: Path, name: str, **over: Any):
    base = {
        "parallel.pipeline_stages": 1,
        "resources.device": "cpu",
        "resources.stages": [{"resources": {"spot_gpu": 1}}],
        "elastic.min_replicas": 1,
        "elastic.max_replicas": MAX_REPLICAS,
        "elastic.wait_for_capacity_s": 240,
        # Compute-bound steps, so that a second replica measurably speeds the job up on
        # this machine's cores and growing passes the cost rule (a tiny model's steps are
        # all overhead: two replicas were measured no faster than one, and the job rightly
        # stayed at one).
        "model.d_model": 128,
        "model.n_heads": 4,
        "model.seq_len": 64,
        "train.global_batch_size": 64,
        "train.steps": 200_000,  # long enough that growing pays; stopped by the test
        "checkpoint.interval_steps": 20,
        "checkpoint.keep_last": 100,
    }
    return tiny_spec(tmp_path, name, **{**base, **over})


def _running_without(node: str, replicas: int | None = None, past_step: int = -1):
    """A status predicate: training on workers none of which is on `node`, at
    `replicas` replicas (any, when None), past step `past_step`."""

    def pred(s: dict[str, Any]) -> bool:
        return (
            s["state"] == "running"
            and bool(s["workers"])
            and node not in {w["node_id"] for w in s["workers"]}
            and (replicas is None or s["replicas"] == replicas)
            and s["step"] > past_step
        )

    return pred


def _wait(run: spotline.JobRun, pred, what: str, timeout: float = 240) -> dict[str, Any]:
    try:
        return testing.wait_for(run, pred, what, timeout)
    except AssertionError as e:
        nodes = [n["NodeID"][:8] for n in _spot_nodes()]
        raise AssertionError(f"{e}; spot nodes {nodes}") from None


def _brief(st: dict[str, Any]) -> dict[str, Any]:
    return {k: st.get(k) for k in ("state", "step", "replicas", "committed_steps", "error")} | {
        "events": st.get("events", [])[-20:]
    }


def _result(run: spotline.JobRun) -> dict[str, Any]:
    import ray

    return ray.get(run.controller.result.remote())


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


def test_a_job_started_on_one_node_grows_to_max_replicas(
    autoscaling_cluster: AutoscalingTestCluster, tmp_path: Path
) -> None:
    """One spot node is up when the job starts (as with min_workers: 1): the job trains
    on it at once, and its demand makes the autoscaler add the rest."""
    wait_for(lambda: not _spot_nodes(), "the idle spot nodes to be removed", 120)
    autoscaling_cluster.add_spot_node()
    wait_for(lambda: len(_spot_nodes()) == 1, "the one spot node", 60)
    run = spotline.Job(_spec(tmp_path, "from-one")).start()
    try:
        _wait(run, lambda s: s["state"] == "running" and s["step"] >= 1, "the first step")
        _wait(
            run,
            lambda s: s["replicas"] == MAX_REPLICAS and s["state"] == "running",
            "max_replicas",
        )
        res = _result(run)
        # It started on what there was, and grew at a checkpoint boundary, not by failing.
        assert res["attempts"][0]["replicas"] < MAX_REPLICAS, res["attempts"]
        assert res["failures"] == 0 and res["attempts"][0]["ended_by"] == "grow"
    finally:
        assert run.stop().state == "stopped"
    assert _pending_requests() == []


def test_a_noticed_node_is_drained_never_counted_and_replaced(
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
        # A while at full size first, so the job knows what two replicas are worth: the
        # rate it weighs a grow back by is an average over that while, and too short a
        # one on a busy machine can measure two replicas no faster than one.
        st = _wait(run, lambda s, at=st["step"]: s["step"] >= at + 200, "training at max_replicas")
        victim = next(w["node_id"] for w in st["workers"] if w["rank"] == 1)
        drain_node(victim, seconds=600)
        st = _wait(
            run,
            _running_without(victim),
            "training without the noticed node",
        )
        # The demand stands whole, plus a replacement for the noticed node, which Ray's
        # autoscaler counts until it is gone.
        wait_for(
            lambda: len(_pending_requests()) == MAX_REPLICAS + 1, "a replacement asked for", 60
        )
        # The demand brings a replacement, and the job grows back onto it.
        st = _wait(
            run,
            _running_without(victim, replicas=MAX_REPLICAS),
            "growing back to max_replicas on a replacement",
        )
        # The noticed node is free (its spot_gpu unused) but never counted.
        assert victim in {n["NodeID"] for n in _spot_nodes()}
        assert RayClusterView(spec, "cpu").capacity() == 0
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


def test_device_gpu_with_no_gpu_node_it_can_use_waits_asking_for_gpus(
    autoscaling_cluster: AutoscalingTestCluster, tmp_path: Path
) -> None:
    """`device: gpu` whose GPUs no node type offers (an accelerator type the cluster does
    not have): the job asks for GPU bundles and waits; it never trains on CPU."""
    spec = _spec(
        tmp_path,
        "gpu-only",
        **{
            "resources.device": "gpu",
            "resources.stages": [{"accelerator_type": "H200", "resources": {"spot_gpu": 1}}],
            "elastic.wait_for_capacity_s": 600,
        },
    )
    run = spotline.Job(spec).start()
    try:
        wait_for(
            lambda: [r for r in _pending_requests() if r.get("GPU") == 1],
            "the job's GPU demand",
            60,
        )
        assert all(r.get("accelerator_type:H200") for r in _pending_requests())
        st = _wait(run, lambda s: s["state"] == "waiting", "waiting for GPU capacity", 60)
        time.sleep(5)  # a while longer: still waiting, nothing started on a CPU
        st = run.status()
        assert st["state"] == "waiting" and st["step"] == 0 and st["workers"] == [], _brief(st)
        assert _result(run)["attempts"] == []
    finally:
        assert run.stop().state == "stopped"
    assert _pending_requests() == []


def test_a_lost_node_is_left_behind_and_the_job_grows_back_on_its_replacement(
    autoscaling_cluster: AutoscalingTestCluster, tmp_path: Path
) -> None:
    """A spot node's instance is gone (its raylet and every process on it killed): the
    job resumes without it from its latest commit, losing no committed step, still
    stating its whole demand, and grows back to max_replicas on the node that replaces
    it. Ray's autoscaler may replace the node itself (the dead node stops answering its
    heartbeat) or the fake provider may go on showing it as pending; in that case a node
    is added by hand, as the cloud would launch it.

    Last in this module: the fake provider keeps counting the dead node (every fake node
    heartbeats from 127.0.0.1, so it never looks unresponsive), so a later test's demand
    would be met, for the autoscaler, by a node that does not exist."""
    from spotline.runtime.cluster import RayClusterView

    spec = _spec(tmp_path, "lose-a-node")
    run = spotline.Job(spec).start()
    try:
        st = _wait(
            run,
            lambda s: s["replicas"] == MAX_REPLICAS and s["state"] == "running" and s["step"] >= 1,
            "max_replicas",
        )
        # A while at full size first (the job learns what two replicas are worth), up to
        # a step committed by the full-size group.
        st = _wait(
            run,
            lambda s, at=st["step"]: s["step"] >= at + 100 and max(s["committed_steps"]) > at,
            "a step committed at max_replicas",
        )
        committed = max(st["committed_steps"])
        victim = next(w["node_id"] for w in st["workers"] if w["rank"] == 1)
        autoscaling_cluster.kill_node(victim)
        st = _wait(
            run,
            _running_without(victim, past_step=committed),
            "training again without the lost node",
        )
        assert len(_pending_requests()) == MAX_REPLICAS  # the whole demand, still stated
        res = _result(run)
        assert res["node_losses"] >= 1 and res["failures"] == 0, res
        # No committed step is lost: the next attempt resumed from the latest commit.
        lost_at = next(i for i, a in enumerate(res["attempts"]) if a["ended_by"] == "node lost")
        assert res["attempts"][lost_at + 1]["restored_from"] >= committed

        # The replacement: Ray's autoscaler's own, or one launched by hand as the cloud
        # would, where the fake provider still counts the dead node.

        draining = draining_nodes(timeout_s=10)
        usable = [n for n in _spot_nodes() if n["NodeID"] not in {*draining, victim}]
        if len(usable) < MAX_REPLICAS:
            autoscaling_cluster.add_spot_node()
        st = _wait(
            run,
            _running_without(victim, replicas=MAX_REPLICAS),
            "growing back to max_replicas on the replacement",
        )
        assert RayClusterView(spec, "cpu").capacity() == 0  # every spot node is the job's
        assert len({w["node_id"] for w in st["workers"]}) == MAX_REPLICAS
    finally:
        assert run.stop().state == "stopped"
    assert _pending_requests() == []
