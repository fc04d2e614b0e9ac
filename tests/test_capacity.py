"""Capacity in whole replicas of the real worker bundle, fitted node by node (no Ray),
and the bundles the job's demand asks the autoscaler for."""

from __future__ import annotations

import pytest

from spotline.config import load_spec
from spotline.runtime.cluster import replicas_fit
from spotline.runtime.demand import demand_bundles

pytestmark = pytest.mark.unit

GPU_WORKER = {"CPU": 2.0, "GPU": 1.0}


def test_a_free_gpu_without_the_cpus_of_the_bundle_holds_nothing():
    assert replicas_fit([GPU_WORKER], [{"GPU": 1.0, "CPU": 1.0}]) == 0
    assert replicas_fit([GPU_WORKER], [{"GPU": 1.0, "CPU": 2.0}]) == 1


def test_bundles_are_fitted_per_node_not_from_cluster_totals():
    # Four GPUs and eight CPUs in all, but the CPUs sit on a node with no GPU.
    nodes = [{"GPU": 4.0, "CPU": 1.0}, {"CPU": 8.0}]
    assert replicas_fit([GPU_WORKER], nodes) == 0
    nodes = [{"GPU": 4.0, "CPU": 5.0}, {"GPU": 1.0, "CPU": 2.0}]
    assert replicas_fit([GPU_WORKER], nodes) == 3  # two on the first, one on the second


def test_accelerator_type_and_custom_resources_must_be_on_the_node():
    h100 = {"CPU": 1.0, "GPU": 1.0, "accelerator_type:H100": 0.001, "fast_nvme": 0.01}
    nodes = [
        {"CPU": 8.0, "GPU": 8.0, "accelerator_type:A100": 1.0, "fast_nvme": 1.0},
        {"CPU": 8.0, "GPU": 2.0, "accelerator_type:H100": 1.0},
        {"CPU": 8.0, "GPU": 2.0, "accelerator_type:H100": 1.0, "fast_nvme": 1.0},
    ]
    assert replicas_fit([h100], nodes) == 2


def test_a_replica_fits_only_whole_with_each_stage_on_a_node_that_holds_it():
    first, last = {"CPU": 1.0, "accelerator_type:A100": 0.001}, {"CPU": 1.0, "GPU": 1.0}
    nodes = [{"CPU": 4.0, "accelerator_type:A100": 1.0}, {"CPU": 1.0, "GPU": 2.0}]
    assert replicas_fit([first, last], nodes) == 1  # the second replica's last stage has no CPU


def test_workers_that_ask_for_nothing_are_unbounded():
    assert replicas_fit([{}], []) >= 10**6


def test_the_demand_is_the_real_bundle_of_max_replicas_replicas():
    spec = load_spec(
        {
            "parallel": {"pipeline_stages": 2, "micro_batches": 2},
            "elastic": {"min_replicas": 1, "max_replicas": 3},
            "train": {"global_batch_size": 12},
            "resources": {
                "device": "gpu",
                "cpus_per_worker": 2,
                "stages": [{"accelerator_type": "A100"}, {"resources": {"spot_gpu": 1}}],
            },
        }
    )
    bundles = demand_bundles(spec, "gpu")
    assert len(bundles) == 6
    assert bundles[0] == {"CPU": 2.0, "GPU": 1.0, "accelerator_type:A100": 0.001}
    assert bundles[1] == {"CPU": 2.0, "GPU": 1.0, "spot_gpu": 1.0}


def test_the_demand_asks_for_a_replacement_of_each_replica_a_noticed_node_could_hold():
    """A draining node still counts toward the request for Ray's autoscaler, so the job
    asks for what it could hold on top: the replacement starts during the notice."""
    spec = load_spec(
        {
            "parallel": {"pipeline_stages": 2, "micro_batches": 2},
            "elastic": {"min_replicas": 1, "max_replicas": 2},
            "train": {"global_batch_size": 8},
            "resources": {"device": "gpu", "cpus_per_worker": 2},
        }
    )
    two_gpus = {"CPU": 8.0, "GPU": 2.0}  # one replica: both stages
    one_gpu = {"CPU": 8.0, "GPU": 1.0}  # half a replica
    no_cpu = {"CPU": 1.0, "GPU": 2.0}  # GPUs without the bundle's CPUs: nothing
    assert len(demand_bundles(spec, "gpu")) == 4
    assert len(demand_bundles(spec, "gpu", [two_gpus])) == 6
    assert len(demand_bundles(spec, "gpu", [one_gpu])) == 4
    assert len(demand_bundles(spec, "gpu", [one_gpu, one_gpu])) == 6  # stages span nodes
    assert len(demand_bundles(spec, "gpu", [no_cpu])) == 4


def test_every_failure_of_the_demand_is_one_warning_per_cause_and_the_job_trains_on(
    monkeypatch,
):
    """A GCS that does not answer `ray.nodes()`, a Ray whose autoscaling coordinator
    moved, a request that times out: `keep()` never raises, each cause is said once
    however often the loop calls, and a success makes the next failure news."""
    import logging
    import sys

    from spotline import constants
    from spotline.runtime import placement
    from spotline.runtime.demand import RayDemand

    spec = load_spec({"elastic": {"min_replicas": 1, "max_replicas": 2}})
    now = [0.0]
    events: list[tuple[int, str]] = []
    demand = RayDemand(spec, "auto", clock=lambda: now[0])
    demand.bind(lambda text, level: events.append((level, text)))
    reads = []

    def gcs_down():
        reads.append(now[0])
        raise ConnectionError("GCS at 10.0.0.1:6379 did not answer")

    monkeypatch.setattr(placement, "usable_nodes", gcs_down)
    for _ in range(50):  # the controller's loop
        demand.keep()
        now[0] += constants.SPOTLINE_POLL_INTERVAL_S
    demand.keep(force=True)  # a node was lost
    (warning,) = events
    assert warning[0] == logging.WARNING
    assert "reading the cluster's nodes: ConnectionError: GCS at 10.0.0.1:6379" in warning[1]
    assert "the job trains on the nodes that are up" in warning[1]
    # Asked again once a refresh is due (or forced), not at every turn of the loop.
    assert len(reads) < 5

    # Nodes answer; the coordinator's private module is gone in this Ray.
    monkeypatch.setattr(placement, "usable_nodes", lambda: [{"CPU": 4.0}])
    monkeypatch.setattr(placement, "held_out_nodes", lambda cordoned=(): [])
    # (every module of Ray Data, also one an earlier test of this process imported)
    for name in ["ray.data", *(m for m in sys.modules if m.startswith("ray.data."))]:
        monkeypatch.setitem(sys.modules, name, None)
    for _ in range(3):
        demand.keep(force=True)
    assert len(events) == 2 and events[1][0] == logging.WARNING
    assert "loading Ray's autoscaling coordinator" in events[1][1]
    assert "moved its autoscaling coordinator" in events[1][1]

    sent: list[list[dict[str, float]]] = []
    monkeypatch.setattr(demand, "_sender", lambda: sent.append)
    demand.keep(force=True)
    assert sent == [[{"CPU": 0.5}, {"CPU": 0.5}]]
    assert events[2] == (
        logging.INFO,
        "the autoscaler has the job's demand now (2 worker bundle(s))",
    )

    def timed_out(bundles):
        raise TimeoutError("request_resources did not answer in 5s")

    monkeypatch.setattr(demand, "_sender", lambda: timed_out)
    demand.keep(force=True)
    demand.keep(force=True)
    assert len(events) == 4 and "sending the request: TimeoutError" in events[3][1]
