"""Spot capacity through the controller: notices and just-in-time checkpoints, node
losses, the hand-over of surviving ranks (`fleet.py`), growing back (`growth.py`) and
replicas started ahead, stops, and the demand to the autoscaler. Against a fake group."""

from __future__ import annotations

import time

import pytest

from controller_fakes import FakeGroup, FakeStandby, _devices, _notice, _two_nodes, make, run_until
from spotline import constants
from spotline.controller.state import (
    Running,
    Stopped,
    Waiting,
)

pytestmark = pytest.mark.unit


def test_notice_commits_a_jit_checkpoint_and_restarts_off_the_doomed_node(tmp_path):
    # A short notice: staying would not gain steps, so the group saves at once.
    total = {"nodes": 2}
    script = {"notices": {13: _notice("node-1", deadline=time.time() + 5)}}
    ctl, store = make(tmp_path, script=script, capacity=_devices(total))
    res = ctl.run()
    assert res["state"] == "finished"
    assert res["failures"] == 0 and res["node_losses"] == 0
    first, second = FakeGroup.instances
    assert first.replicas == 2 and second.replicas == 1
    assert "node-1" not in second.node_ids()  # the drained node got no part of it
    jit = first.saves[-1]
    # The controller saw the notice at the poll after step 13: the next step saves.
    assert first.requests[0][:2] == (jit, jit) and jit == res["notices"][0]["step"] + 1
    assert second.restored == [jit] and second.resharded
    (n,) = res["notices"]
    assert n["committed_step"] == jit and n["notice_to_commit_s"] is not None
    assert n["outcome"] == "just-in-time checkpoint committed"
    assert ctl.fake_cluster.drained == ["node-1"]
    assert res["resizes"][0]["why"] == "preemption" and res["resizes"][0]["to_replicas"] == 1
    assert [r["why"] for r in res["recoveries"]] == ["preemption"]
    steps = [s for a in res["attempts"] for s, _ in a["losses"]]
    assert steps == list(range(1, 26))  # no step trained twice


def test_ranks_that_stop_on_a_sigterm_before_the_controller_hears_of_it_move_off_its_node(
    tmp_path,
):
    """A rank's SIGTERM makes the ranks save and stop at once, on their own: the poll that
    brings its notice can also bring the whole group's stop. That stop is the notice's
    just-in-time checkpoint, not the job's end."""
    total = {"nodes": 2}
    script = {"sigterms": {13: _notice("node-1", source="sigterm")}, "steps_per_poll": 5}
    ctl, store = make(tmp_path, script=script, capacity=_devices(total))
    res = ctl.run()
    assert res["state"] == "finished", res["error"]
    first, second = FakeGroup.instances
    assert first.saves[-1] == 13 and second.restored == [13] and second.replicas == 1
    assert "node-1" not in second.node_ids()
    (n,) = res["notices"]
    assert n["committed_step"] == 13 and n["outcome"] == "just-in-time checkpoint committed"
    steps = [s for a in res["attempts"] for s, _ in a["losses"]]
    assert steps == list(range(1, 26))  # no step lost or trained twice
    assert 25 in store.committed_steps()


def test_a_long_notice_keeps_training_on_the_doomed_capacity_until_it_must_save(tmp_path):
    total = {"nodes": 2}
    over = {"train.steps": 400, "checkpoint.interval_steps": 100}
    script = {"notices": {13: _notice("node-1", deadline=time.time() + 30)}}
    ctl, _ = make(tmp_path, script=script, capacity=_devices(total), **over)
    res = ctl.run()
    assert res["state"] == "finished"
    first = FakeGroup.instances[0]
    jit = first.requests[0][0]
    # 30 s left, 10 s margin, 50 ms steps: it stays for hundreds of steps, not one.
    assert jit > 100 and first.saves[-1] == jit and first.replicas == 2
    assert FakeGroup.instances[1].restored == [jit]
    assert any("just-in-time checkpoint after" in e for e in ctl.door.status()["events"])


def test_a_late_jit_checkpoint_moves_up_when_steps_slow_down(tmp_path):
    total = {"nodes": 2}
    over = {"train.steps": 2000, "checkpoint.interval_steps": 1000}
    script = {
        "notices": {13: _notice("node-1", deadline=time.time() + 30)},
        "slow_from": (20, 1.0),  # from step 20 on, a step takes 1 s instead of 50 ms
    }
    ctl, _ = make(tmp_path, script=script, capacity=_devices(total), **over)
    run_until(ctl, lambda: len(FakeGroup.instances) == 2)
    first = FakeGroup.instances[0]
    planned = first.requests[0][1]
    assert planned > 300  # picked at 50 ms a step: stay
    moved = first.requests[-1][1]
    # At 1 s a step the planned step is out of reach: the next one saves instead.
    assert 20 < moved < 40 and first.saves[-1] == moved
    assert FakeGroup.instances[1].restored == [moved]
    assert any("moves up to step" in e for e in ctl.door.status()["events"])


def test_the_first_status_says_when_a_jit_checkpoint_cannot_meet_the_notice(tmp_path):
    def warnings(ctl):
        return [e for e in ctl.door.status()["events"] if "warning: a just-in-time" in e]

    gcp = {"preemption.sources": [{"kind": "gcp", "endpoint": "http://127.0.0.1:9"}]}
    # Predicted from the state size before anything ran: 1 KB/s cannot move it in 30 s.
    ctl, _ = make(tmp_path / "a", **gcp, **{"checkpoint.upload_max_mb_per_s": 0.001})
    ctl.step()
    (w,) = warnings(ctl)
    assert "predicted" in w and "gcp notice gives 30s" in w
    # Fits by prediction, but the first measured save says otherwise: said once.
    ctl, _ = make(tmp_path / "b", script={"upload_s": 25.0}, **gcp)
    ctl.step()
    assert warnings(ctl) == []
    run_until(ctl, lambda: len(ctl.coordinator.committed) >= 2)
    (w,) = warnings(ctl)
    assert "(measured" in w
    # Measured and fitting: nothing to say.
    ctl, _ = make(tmp_path / "c", **gcp)
    assert ctl.run()["state"] == "finished" and warnings(ctl) == []


def test_a_notice_while_scheduling_drains_the_node_before_the_group_starts(tmp_path):
    ctl, _ = make(tmp_path, capacity=1)
    ctl.step()  # pending -> scheduling
    ctl.door.notify(_notice("node-0"))  # lands before any group exists
    ctl.step()  # scheduling: the inbox is read first, in any state
    assert ctl.fake_cluster.drained == ["node-0"]
    assert "node-0" not in FakeGroup.instances[0].node_ids()
    assert "the next group avoids it" in ctl.jit.notices[0]["outcome"]


def test_notice_for_a_node_without_ranks_only_drains_it(tmp_path):
    script = {"notices": {4: _notice("node-3")}}
    ctl, _ = make(tmp_path, script=script)
    res = ctl.run()
    assert res["state"] == "finished"
    assert len(FakeGroup.instances) == 1
    assert ctl.fake_cluster.drained == ["node-3"]
    assert res["notices"][0]["outcome"].startswith("no ranks of this job on that node")


def test_repeated_notice_is_answered_once(tmp_path):
    ctl, _ = make(tmp_path, capacity=1)
    for _ in range(3):
        assert ctl.door.notify(_notice("node-9", deadline=123.0)) is True  # acknowledged
    notices, _ = ctl.inbox.take()
    assert len(notices) == 1


def test_node_loss_resumes_from_latest_commit_without_using_a_failure(tmp_path):
    script = {"kill_at": 17, "lose_node": "node-1"}

    ctl, _ = make(tmp_path, script=script, capacity=_two_nodes)
    res = ctl.run()
    assert res["state"] == "finished"
    assert res["failures"] == 0 and res["node_losses"] == 1
    first, second = FakeGroup.instances
    assert second.replicas == 1 and second.restored == [10]
    assert res["attempts"][0]["ended_by"] == "node lost"
    assert res["recoveries"][0]["why"] == "node loss"


def test_a_restart_hands_the_ranks_that_stay_to_the_next_group_but_never_after_a_hang(
    tmp_path,
):
    """recovery.in_place: after a node loss the replicas off the lost node, and after a
    notice those off the doomed node, are handed to the next group (never ended); after
    a hang nothing is, and with in_place off nothing is either."""
    ctl, _ = make(tmp_path / "loss", {"kill_at": 17, "lose_node": "node-1"}, _two_nodes)
    assert ctl.run()["state"] == "finished"
    first, second = FakeGroup.instances
    assert first.handed == {"node-1"} and first.survivors_out.nodes == ["node-0"]
    assert second.adopted is first.survivors_out and not second.adopted.released

    script = {"notices": {13: _notice("node-1", deadline=time.time() + 5)}}
    ctl, _ = make(tmp_path / "notice", script=script, capacity=_devices({"nodes": 2}))
    assert ctl.run()["state"] == "finished"
    first, second = FakeGroup.instances
    assert first.handed == {"node-1"} and second.adopted is first.survivors_out

    ctl, _ = make(tmp_path / "hang", {"freeze": {"at": 15, "rank": 1, "times": 1}})
    run_until(ctl, lambda: ctl.state.terminal)
    first, second = FakeGroup.instances[:2]
    assert first.handed is None and second.adopted is None

    off = {"recovery.in_place": False}
    ctl, _ = make(tmp_path / "off", {"kill_at": 17, "lose_node": "node-1"}, _two_nodes, **off)
    assert ctl.run()["state"] == "finished"
    assert FakeGroup.instances[0].handed is None and FakeGroup.instances[1].adopted is None


def test_a_lost_nodes_state_keeper_is_forgotten_before_the_next_group_asks(tmp_path):
    """A restore asks every keeper it knows what it holds; one on a lost node would keep
    the next group waiting for Ray to call it unavailable."""
    from spotline.runtime.peers import PeerMemory

    ctl, _ = make(tmp_path, {"kill_at": 17, "lose_node": "node-1"}, _two_nodes)
    peers = PeerMemory(ctl.spec)
    peers._keepers = {"node-0": "keeper-0", "node-1": "keeper-1"}
    ctl.recovery.peers = peers
    offered = []
    peers.offer = lambda *a, **k: offered.append(set(peers._keepers))  # what it would ask
    peers.retain = lambda attempts: None
    assert ctl.run()["state"] == "finished"
    assert offered[-1] == {"node-0"} and set(peers._keepers) == {"node-0"}


def test_ranks_held_for_a_next_group_that_never_starts_are_ended(tmp_path):
    """Handed on at a node loss, then the job stops while it waits for capacity: the
    held ranks end with it."""

    def capacity(held, cluster):  # both nodes at first; none once the loss is seen
        return 0 if any(g.shut for g in FakeGroup.instances) else 2

    script = {"kill_at": 17, "lose_node": "node-1"}
    ctl, _ = make(tmp_path, script, capacity, **{"elastic.wait_for_capacity_s": 3})
    run_until(ctl, lambda: ctl.state.terminal)
    assert ctl.state.name == "failed"
    (first,) = FakeGroup.instances
    assert first.survivors_out.released and ctl.fleet.survivors is None


def test_after_a_teardown_the_group_is_sized_from_settled_capacity(tmp_path):
    """Right after the old group goes, Ray still shows its devices as held: sizing from
    that first reading would start 1 replica; the controller waits until they show."""
    readings = iter([1, 1, 1])

    def capacity(held, cluster):
        if held or len(FakeGroup.instances) < 2 and not any(g.shut for g in FakeGroup.instances):
            return 2  # the first start, and the estimate made while the group still lives
        return next(readings, 2)

    ctl, _ = make(tmp_path, script={"kill_at": 12}, capacity=capacity)
    res = ctl.run()
    assert res["state"] == "finished"
    assert [g.replicas for g in FakeGroup.instances] == [2, 2]


def test_grows_when_capacity_returns_and_it_pays(tmp_path):
    total = {"nodes": 1}
    ctl, store = make(
        tmp_path, capacity=_devices(total), **{"train.steps": 400, "checkpoint.interval_steps": 50}
    )
    run_until(ctl, lambda: ctl.step_count >= 5)
    assert FakeGroup.instances[0].replicas == 1
    total["nodes"] = 2  # a second replica's worth joins
    # No restart happened yet: the measured start of the first group is the cost.
    res = ctl.run()
    assert res["state"] == "finished"
    assert [g.replicas for g in FakeGroup.instances] == [1, 2]
    grow = res["resizes"][0]
    assert grow["why"] == "grow" and grow["to_replicas"] == 2
    # No fixed interval: it grew at the first check after the capacity came.
    assert FakeGroup.instances[1].restored[0] <= 50
    assert store.load_manifest(400).topology["replicas"] == 2


def test_a_grow_trains_on_until_the_replica_started_ahead_is_ready_then_takes_it_in(tmp_path):
    """Capacity joins: a replica is started ahead at the first check, the group trains on
    while its processes start, and the grow hands it to the bigger group as a survivor;
    with no spare capacity none is kept, and the job's end releases what is left."""
    total = {"nodes": 1}
    standby = FakeStandby(ready_after=3)
    steps = {"train.steps": 400, "checkpoint.interval_steps": 50}
    ctl, store = make(tmp_path, capacity=_devices(total), standby=standby, **steps)
    run_until(ctl, lambda: ctl.step_count >= 5 and standby.wants)
    assert set(standby.wants) == {0} and not standby.started
    total["nodes"] = 2  # a second replica's worth joins
    run_until(ctl, lambda: standby.wants[-1] == 1)
    run_until(ctl, lambda: standby.started[0]["keeps"] == 2)
    # Not ready yet: still the first group, training.
    assert len(FakeGroup.instances) == 1 and isinstance(ctl.state, Running)
    res = ctl.run()
    assert res["state"] == "finished"
    first, grown = FakeGroup.instances
    assert grown.replicas == 2 and res["resizes"][0]["why"] == "grow"
    assert standby.taken and grown.adopted.replicas == standby.taken
    assert first.survivors_out is grown.adopted
    assert standby.released  # the job's end
    assert store.load_manifest(400).topology["replicas"] == 2


def test_does_not_grow_when_the_restart_would_not_pay(tmp_path):
    total = {"nodes": 1}
    ctl, _ = make(tmp_path, capacity=_devices(total))
    run_until(ctl, lambda: ctl.step_count >= 5)
    total["nodes"] = 2
    ctl.pace.restart_s = 1e6  # a restart that costs more than the rest of the job
    res = ctl.run()
    assert res["state"] == "finished"
    assert [g.replicas for g in FakeGroup.instances] == [1]


def test_free_capacity_a_grow_would_not_use_is_explained_once(tmp_path):
    total = {"nodes": 1}
    steps = {"train.steps": 400, "checkpoint.interval_steps": 50}
    ctl, _ = make(tmp_path, capacity=_devices(total), **steps)
    run_until(ctl, lambda: ctl.step_count >= 5)
    total["nodes"] = 2
    ctl.pace.sps[2] = 1e-3  # two replicas were measured slower than one
    res = ctl.run()
    assert res["state"] == "finished"
    assert [g.replicas for g in FakeGroup.instances] == [1]
    said = [e for e in ctl.door.status()["events"] if "growing does not pay" in e]
    assert len(said) == 1, said
    assert "capacity for 2 replica(s) is free, staying at 1" in said[0]
    assert "0.00 at 2" in said[0]


def test_a_grow_waits_for_a_replica_started_ahead_only_so_long(tmp_path, monkeypatch):
    """A replica started ahead that never gets ready (stuck, or failing and started
    again) holds a grow back for SPOTLINE_STANDBY_WAIT_S at most; then the grow goes on
    with processes of its own, and says so."""

    monkeypatch.setattr(constants, "SPOTLINE_STANDBY_WAIT_S", 5.0)
    total = {"nodes": 1}
    standby = FakeStandby(ready_after=10**9)
    steps = {"train.steps": 400, "checkpoint.interval_steps": 50}
    ctl, _ = make(tmp_path, capacity=_devices(total), standby=standby, **steps)
    run_until(ctl, lambda: ctl.step_count >= 5)
    total["nodes"] = 2
    run_until(ctl, lambda: standby.started)
    due = ctl.clock()
    standby.failures.append("replica standby-1 started ahead on node node-1 ended: boom")
    run_until(ctl, lambda: len(FakeGroup.instances) == 2)
    assert ctl.clock() - due >= 5.0
    assert [g.replicas for g in FakeGroup.instances] == [1, 2]
    assert not standby.taken  # never ready: the bigger group started its own
    said = [e for e in ctl.door.status()["events"] if "started ahead not ready" in e]
    assert len(said) == 1 and "growing with processes of its own" in said[0]
    # What ended one on the way is said, once.
    boom = [e for e in ctl.door.status()["events"] if e.endswith("ended: boom")]
    assert boom == ["replica standby-1 started ahead on node node-1 ended: boom"]


def test_a_replica_started_ahead_that_fails_is_named_with_its_node():
    from spotline.runtime.standby import Standby
    from spotline.runtime.starter import ReplicaStart, StartFailed

    class Failing(ReplicaStart):  # its rehearsal's calls raised
        def advance(self):
            raise StartFailed("rehearsing failed: RuntimeError: boom")

        def end(self):
            pass

    sb = Standby(spec=None, store=None)
    r = Failing(None, None, "cpu", [], "", "standby-1", None, phase="rehearsing")
    r.infos = [{"node_id": "a" * 40}]
    sb._replicas = [r]
    sb._advance()
    assert sb.starting() == 0
    assert sb.failures == [
        f"replica standby-1 started ahead on node {'a' * 12} ended: "
        "rehearsing failed: RuntimeError: boom"
    ]


def test_stop_commits_at_the_next_boundary_and_ends_stopped(tmp_path):
    ctl, store = make(tmp_path, script={"stop_at_step": 13})
    res = ctl.run()
    assert res["state"] == "stopped"
    last = store.committed_steps()[-1]
    assert last == res["steps"] and 13 < last < 25
    assert FakeGroup.instances[-1].shut
    assert "submitting the job again resumes there" in ctl.door.status()["events"][-1]


def test_stop_while_waiting_for_capacity_ends_stopped(tmp_path):
    ctl, _ = make(tmp_path, capacity=0)
    ctl.step()
    ctl.step()
    assert isinstance(ctl.state, Waiting)
    ctl.door.request_stop()
    assert isinstance(ctl.step(), Stopped)


def test_a_notice_right_at_a_checkpoint_boundary_saves_that_step_once(tmp_path):
    total = {"nodes": 2}
    ctl, _ = make(tmp_path, script={"notices": {10: _notice("node-1", deadline=time.time())}},
                  capacity=_devices(total))  # fmt: skip
    res = ctl.run()
    assert res["state"] == "finished"
    first = FakeGroup.instances[0]
    assert first.saves.count(10) == 1
    assert [g.replicas for g in FakeGroup.instances] == [2, 1]


def test_the_demand_is_stated_while_waiting_and_withdrawn_when_the_job_gives_up(tmp_path):
    ctl, _ = make(tmp_path, capacity=0, **{"elastic.wait_for_capacity_s": 5})
    ctl.step()
    ctl.step()
    assert isinstance(ctl.state, Waiting)
    assert ctl.fake_demand.calls and set(ctl.fake_demand.calls) == {"keep"}
    res = ctl.run()
    assert res["state"] == "failed"
    assert ctl.fake_demand.calls[-1] == "withdraw"
    assert ctl.fake_demand.calls.count("withdraw") == 1


def test_the_demand_is_kept_while_running_and_withdrawn_at_the_end(tmp_path):
    ctl, _ = make(tmp_path)
    res = ctl.run()
    assert res["state"] == "finished"
    calls = ctl.fake_demand.calls
    assert calls[0] == "keep" and calls[-1] == "withdraw"
    assert "withdraw" not in calls[:-1]


def test_the_demand_is_withdrawn_when_the_job_is_stopped(tmp_path):
    ctl, _ = make(tmp_path, capacity=0)
    ctl.step()
    ctl.step()
    ctl.door.request_stop()
    assert isinstance(ctl.step(), Stopped)
    assert ctl.fake_demand.calls[-1] == "withdraw"


def test_a_lost_node_states_the_demand_again_at_once(tmp_path):
    script = {"kill_at": 17, "lose_node": "node-1"}

    ctl, _ = make(tmp_path, script=script, capacity=_two_nodes)
    res = ctl.run()
    assert res["node_losses"] == 1
    assert ctl.fake_demand.calls.count("force") == 1
