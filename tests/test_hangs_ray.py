"""Hangs and stragglers on a real local cluster: ranks frozen with SIGSTOP (alive and
silent, their peers blocked in the next collective) and a rank slowed by an injected
factor (spotline.runtime.faults). The hang floor is 10 s here (conftest.WORKER_ENV).

The tiny job is 2 stages x 2 replicas: rank r is stage r // 2, replica r % 2.
Cordoning (a node left for another) needs several nodes: tests/test_spot_chaos.py.
"""

from __future__ import annotations

import threading
import time

import pytest

import spotline
from conftest import inject_faults, tiny_spec
from spotline.report import health_rows, status_rows

pytestmark = pytest.mark.ray


def _watch_for_a_hang(run, seen: dict) -> None:
    """Keep the first status in which a rank has been silent for 5 s (a hang building
    up), as `spotline status` would show it."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and "status" not in seen:
        try:
            st = run.status()
        except Exception:  # noqa: BLE001 - the job ended
            return
        ranks = (st.get("health") or {}).get("ranks") or []
        if any(r["running"] and r["heartbeat_age_s"] >= 5 for r in ranks):
            seen["status"] = st
            return
        if st["state"] in ("finished", "failed"):
            return
        time.sleep(0.2)


def _run_with_a_watch(spec):
    run = spotline.Job(spec).start()
    seen: dict = {}
    watcher = threading.Thread(target=_watch_for_a_hang, args=(run, seen))
    watcher.start()
    try:
        return run.wait(verbose=False), seen
    finally:
        watcher.join()


def test_ranks_frozen_mid_step_and_inside_a_save_are_named_and_nothing_committed_is_lost(
    reference_run, tmp_path
):
    """One job, two freezes: rank 1 in the first forward of step 14 (first group), then
    rank 2 right after its host copy of step 20 (second group), while the other ranks
    upload their parts of step 20, which must never commit."""
    _, ref, _ = reference_run
    spec = tiny_spec(tmp_path, "hangs", **{"failure.cordon": False, "failure.test_faults": True})
    inject_faults(
        spec,
        [
            {"kind": "freeze", "rank": 1, "step": 14, "phase": "forward"},
            {"kind": "freeze", "rank": 2, "step": 20, "phase": "save"},
        ],
    )
    result, seen = _run_with_a_watch(spec)
    assert result.state == "finished", result.error
    first, second, third = result.attempts
    assert first["ended_by"] == second["ended_by"] == "hang"
    assert result.failures == 2  # hangs count against failure.max_failures
    # The frozen rank is named, with where it sits and what it was last seen doing;
    # its peers (blocked in a collective or a pipeline transfer) are not.
    err = first["error"]
    assert "hang: no step for" in err and "rank 1 (stage 0, replica 1, node" in err, err
    assert "has not answered" in err and "rank 0 (" not in err and "rank 3 (" not in err, err
    assert "rank 2 (stage 1, replica 0, node" in second["error"]
    # Nothing committed was lost, and the step frozen inside its save never committed:
    # both restarts resumed from step 10, and trained exactly as the uninterrupted run.
    assert second["restored_from"] == third["restored_from"] == 10
    for attempt in (second, third):
        for step, loss in attempt["losses"]:
            assert loss == ref.losses[step], step
    assert result.committed_steps[-1] == 30
    # While the first hang built up, status showed every rank's heartbeat and phase.
    st = seen["status"]
    ranks = {r["rank"]: r for r in st["health"]["ranks"]}
    # The rank the watch saw silent is the frozen one: every other rank answered a later
    # poll (polls are 4 a second), and its last answer came before the freeze.
    ages = {r: x["heartbeat_age_s"] for r, x in ranks.items()}
    assert max(ages, key=ages.get) == 1 and ranks[1]["step"] <= 14
    rows = dict(status_rows(st))
    assert "hang watch" in rows and "heartbeat" in rows["rank 1"] and "stage 0" in rows["rank 1"]


def test_a_frozen_ranks_stack_is_taken_while_it_is_stopped_and_stacks_come_on_demand(
    ray_session, tmp_path
):
    """Rank 1 freezes (SIGSTOP) in its forward of step 14. The hang path reads every
    rank's stack from a task on the node before it tears the group down: rank 1's
    process is still stopped then, and its training thread sits in the freeze. Once the
    next group trains, `spotline stacks NAME` reads every rank's stack on demand."""
    import json

    import ray

    from spotline.cli import main

    over = {"failure.cordon": False, "failure.test_faults": True, "train.steps": 60}
    spec = tiny_spec(tmp_path, "stacks", **over)
    inject_faults(spec, [{"kind": "freeze", "rank": 1, "step": 14, "phase": "forward"}])
    run = spotline.Job(spec).start()
    out = tmp_path / "stacks.json"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not out.exists():
        st = run.status()
        if st["state"] in ("finished", "failed"):
            break
        if st["failures"] >= 1 and st["state"] == "running" and st["step"] >= 12:
            address = ray.get_runtime_context().gcs_address
            assert main(["stacks", spec.name, "--address", address, "--json", str(out)]) == 0
        time.sleep(0.5)
    result = run.wait(verbose=False)
    assert result.state == "finished", result.error
    assert result.attempts[0]["ended_by"] == "hang"

    # At the hang: the named rank's frame, read while its process was still stopped
    # (the teardown ends it after). It stopped inside the forward the freeze wraps.
    (taken,) = result.health["stacks"]
    assert list(taken["ranks"]) == ["1"] and taken["ranks"]["1"]["state"] == "stopped"
    (path,) = (tmp_path / "ckpt" / "artifacts" / "stacks").glob("hang-*/stacks.json")
    stored = json.loads(path.read_text())
    assert set(stored["ranks"]) == {"0", "1", "2", "3"}  # every rank of a small group
    frozen = stored["ranks"]["1"]
    assert frozen["frame"] == taken["ranks"]["1"]["frame"]
    (training,) = [t for t in frozen["threads"] if t["frames"][:1] == [frozen["frame"]]]
    assert any("TrainWorker.run (" in f for f in training["frames"])
    assert any("faulty (spotline/runtime/faults.py" in f for f in training["frames"])
    for rank in ("0", "2", "3"):  # its peers, blocked behind it, answered with stacks
        assert stored["ranks"][rank]["frame"] and stored["ranks"][rank]["state"] != "stopped"
    rows = dict(health_rows(result.health))
    assert rows["rank 1 stack"] == f"{frozen['frame']} (process stopped)"

    # On demand, from the group that trained after the hang.
    assert out.exists(), "the job ended before `spotline stacks` could be asked"
    record = json.loads(out.read_text())
    assert set(record["ranks"]) == {"0", "1", "2", "3"}
    for r in record["ranks"].values():
        assert r["error"] is None and r["frame"] and r["state"] != "stopped", r


def test_a_slowed_rank_is_reported_as_a_straggler_with_its_slowdown(ray_session, tmp_path):
    # Two data-parallel ranks, one thread each on this 2-core host: no rank waits for a
    # core, so the measured forward times hold the injected factor.
    spec = tiny_spec(
        tmp_path,
        "straggler",
        **{
            "model.d_model": 128,
            "model.n_layers": 4,
            "model.seq_len": 64,
            "parallel.pipeline_stages": 1,
            "train.steps": 60,
            "failure.straggler_window_steps": 20,
            "failure.cordon": False,  # one node here: nothing to move to
            "failure.test_faults": True,
        },
    )
    inject_faults(spec, [{"kind": "slow", "rank": 1, "factor": 2.0}])
    result = spotline.Job(spec).run(verbose=False)
    assert result.state == "finished", result.error
    assert len(result.attempts) == 1  # a straggler is reported, not restarted
    (s,) = result.health["stragglers"]
    assert (s["rank"], s["stage"], s["replica"]) == (1, 0, 1)
    # Injected: 2x its compute, read here within 0.45 on a shared 2-core host, where
    # the other processes steal time from either rank. How exact the reading is, is a
    # figure: benchmarks/hang.py reports it with its spread.
    assert s["slowdown"] == pytest.approx(1.0, abs=0.45)
    assert result.health["cordoned"] == {}


def test_a_collective_timeout_that_fires_first_reaches_the_controller_as_a_hang(
    ray_session, tmp_path
):
    # The collective timeout (12 s) is far shorter than the hang bound (1000 median
    # steps, over a minute here): the frozen rank's peer raises first, whatever the
    # host's load, and that error is a hang on the frozen rank.
    spec = tiny_spec(
        tmp_path,
        "collective-timeout",
        **{
            "parallel.pipeline_stages": 1,
            "train.steps": 16,
            "checkpoint.interval_steps": 4,
            "failure.collective_timeout_s": 12,
            "failure.hang_factor": 1000,
            "failure.test_faults": True,
        },
    )
    inject_faults(spec, [{"kind": "freeze", "rank": 1, "step": 10, "phase": "forward"}])
    result = spotline.Job(spec).run(verbose=False)
    assert result.state == "finished", result.error
    first, second = result.attempts
    assert first["ended_by"] == "hang" and result.failures == 1
    assert "[ranks 0@" in first["error"] and "hang: no step" not in first["error"]
    # The newest commit before the freeze: step 8, or step 4 when the frozen rank's
    # background upload of step 8 was still running as it froze.
    assert second["restored_from"] in (4, 8)
    (hang,) = result.health["hangs"]
    assert hang["step"] >= 9 and len(hang["nodes"]) == 1  # the frozen rank's node


def test_the_autoscaler_is_asked_to_replace_a_cordoned_node(ray_session, tmp_path):
    import ray

    from spotline.runtime.cluster import replicas_fit
    from spotline.runtime.demand import RayDemand
    from spotline.runtime.placement import worker_bundle

    spec = tiny_spec(tmp_path, "cordon-demand", **{"resources.device": "cpu"})
    demand = RayDemand(spec, "cpu")
    try:
        demand.keep()
        asked = len(demand.bundles)  # max_replicas replicas of 2 stages
        assert asked == 2 * spec.elastic.max_replicas
        # The autoscaler still counts a cordoned node: the request grows by what it holds,
        # so a replacement is launched and the cordoned node can go idle.
        node = ray.get_runtime_context().get_node_id()
        demand.cordoned.add(node)
        demand.keep(force=True)
        (res,) = [n["Resources"] for n in ray.nodes() if n["NodeID"] == node]
        held = replicas_fit([worker_bundle(spec, "cpu", s) for s in range(2)], [res])
        assert held > 0 and len(demand.bundles) == asked + 2 * held
    finally:
        demand.withdraw()


def test_the_only_node_is_never_counted_as_capacity_without_it(ray_session, tmp_path) -> None:
    """A straggler on a one-node cluster must not get its node cordoned: without that
    node there is no capacity at all (its free CPUs do not count), so the cordon is
    refused rather than leaving the job waiting for a node that never comes."""
    import ray

    from spotline.controller.capacity import replicas_left
    from spotline.runtime.cluster import RayClusterView

    view = RayClusterView(tiny_spec(tmp_path, "only-node"), "cpu")
    (node,) = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    workers = [{"node_id": node}] * 4
    assert view.capacity() >= 1
    assert replicas_left(view, workers, gone=set()) >= 2
    assert view.capacity(exclude={node}) == 0
    assert replicas_left(view, workers, gone={node}) == 0
