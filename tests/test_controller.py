"""The controller's loop and its states, stepped one iteration at a time against a fake
group (`controller_fakes.py`): the run, the status it publishes, and a group's start,
which never blocks the loop."""

from __future__ import annotations

import pytest

from controller_fakes import FakeGroup, _devices, _notice, fake_loss, make, run_until
from spotline import constants
from spotline.controller.state import (
    Failed,
    Finished,
    Finishing,
    Leaving,
    Pending,
    Running,
    Scheduling,
    Starting,
    Stopped,
    Waiting,
)

pytestmark = pytest.mark.unit


def test_states_advance_and_training_never_waits_for_a_commit(tmp_path):
    ctl, store = make(tmp_path)
    assert isinstance(ctl.state, Pending)
    assert isinstance(ctl.step(), Scheduling)
    assert isinstance(ctl.step(), Running)
    group = FakeGroup.instances[0]
    assert group.replicas == 2 and group.running
    ctl.step()  # steps 1..5
    ctl.step()  # steps 6..10: step 10 saved by the ranks themselves
    assert ctl.step_count == 10 and group.saves == [10]
    assert ctl.coordinator.committed == []  # its uploads are not finished yet
    ctl.step()  # steps 11..15, and step 10's uploads come in: it commits at once
    assert ctl.coordinator.committed == [10] and ctl.step_count == 15
    assert group.requests == []  # the controller never had to ask for a checkpoint
    run_until(ctl, lambda: ctl.state.terminal)
    assert isinstance(ctl.state, Finished)
    assert ctl.coordinator.committed == [20, 25]


def test_the_status_says_which_device_each_group_runs_on(tmp_path):
    ctl, _ = make(tmp_path)
    assert ctl.door.status()["device"] is None  # no group started yet
    ctl.step()
    ctl.step()
    FakeGroup.instances[0].device = "gpu"  # what the group decided when it started
    ctl.step()  # the status is what the loop published after its latest step
    assert ctl.door.status()["device"] == "gpu" and ctl.door.summary()["device"] == "gpu"
    res = ctl.run()
    assert res["attempts"][0]["device"] == "cpu"  # recorded as the group started
    assert ctl.door.status()["device"] == "cpu"  # no live group: the last one's
    # A device: gpu job waiting for its first GPU node says it is a GPU job.
    waiting, _ = make(tmp_path / "gpu", capacity=0, resources={"device": "gpu"})
    waiting.step()
    waiting.step()
    assert waiting.door.status()["waiting"] and waiting.door.status()["device"] == "gpu"


def test_full_run_commits_every_interval_and_the_end(tmp_path):
    ctl, store = make(tmp_path)
    res = ctl.run()
    assert res["state"] == "finished"
    assert res["steps"] == 25
    assert res["losses"] == {s: fake_loss(s) for s in range(1, 26)}
    # keep_last=2: step 10 was committed, then deleted by retention.
    assert store.committed_steps() == [20, 25]
    m = store.load_manifest(25)
    assert m.topology["replicas"] == 2 and m.topology["world_size"] == 4
    assert m.data_position["next_step"] == 25
    assert m.spec_hash == ctl.spec.spec_hash()
    assert m.extra["attempt"] == "att0"
    assert len(m.files) == 4 and len(m.extra["index"]) == 4
    assert res["heldout_loss"] == pytest.approx(fake_loss(25) + 0.5)
    assert FakeGroup.instances[-1].shut
    # Wall-clock throughput, from the first step's start to the last step's end.
    assert res["steps_per_s"] > 0


def test_waits_below_min_then_fails(tmp_path):
    ctl, _ = make(tmp_path, capacity=0, **{"elastic.wait_for_capacity_s": 30})
    assert isinstance(ctl.step(), Scheduling)
    assert isinstance(ctl.step(), Waiting)
    assert "elastic.min_replicas is 1" in ctl.door.status()["waiting"]
    res = ctl.run()
    assert res["state"] == "failed"
    assert "elastic.min_replicas" in res["error"]
    assert "elastic.wait_for_capacity_s" in res["error"]
    assert 30 <= res["waited_s"] <= 32 + 10  # + the settle after the first reading
    assert not FakeGroup.instances  # no worker was ever started


def test_capacity_sizes_the_group_within_bounds(tmp_path):
    ctl, _ = make(tmp_path, capacity=1)
    ctl.step()
    ctl.step()
    assert FakeGroup.instances[0].replicas == 1
    ctl, _ = make(tmp_path / "b", capacity=9)
    ctl.step()
    ctl.step()
    assert FakeGroup.instances[0].replicas == 2


def test_states_are_what_they_carry():
    s = Leaving(why="grow", step=12, since=3.0, grow_to=2)
    assert s.name == "checkpointing" and not s.terminal and s.grow_to == 2
    assert Finished().terminal and Failed(error="x").error == "x" and Stopped().terminal
    assert Finishing().name == "finishing"


def test_while_a_group_starts_the_loop_steps_and_status_answers(tmp_path):
    ctl, _ = make(tmp_path, script={"start_polls": 5})
    run_until(ctl, lambda: isinstance(ctl.state, Starting))
    started = ctl.fake_clock.now
    assert ctl.door.status()["state"] == "starting"
    run_until(ctl, lambda: isinstance(ctl.state, Running))
    # Each step moved the start on for at most a poll interval, then came back.
    assert ctl.fake_clock.now - started <= 6 * constants.SPOTLINE_POLL_INTERVAL_S
    assert ctl.run()["state"] == "finished"


def test_a_rank_that_fails_its_start_is_a_failure_and_the_job_starts_again(tmp_path):
    ctl, _ = make(tmp_path, script={"start_polls": 2, "fail_starting": True})
    res = ctl.run()
    assert res["state"] == "finished" and ctl.rec.failures == 1
    assert "binding failed" in ctl.rec.attempts[0].error


def test_a_stop_during_a_start_is_taken_at_once(tmp_path):
    ctl, _ = make(tmp_path, script={"start_polls": 10**6})
    run_until(ctl, lambda: isinstance(ctl.state, Starting))
    ctl.door.request_stop("operator")
    ctl.step()
    assert isinstance(ctl.state, Stopped) and FakeGroup.instances[0].shut


def test_a_notice_for_a_starting_groups_node_starts_it_again_without_that_node(tmp_path):
    ctl, _ = make(tmp_path, script={"start_polls": 3}, capacity=_devices({"nodes": 3}))
    run_until(ctl, lambda: isinstance(ctl.state, Starting))
    first = FakeGroup.instances[0]
    doomed = first.nodes[-1]
    assert ctl.door.notify(_notice(doomed))
    ctl.step()  # taken at once: the start ends, and the next one begins off that node
    assert first.shut and len(FakeGroup.instances) == 2
    said = [e for e in ctl.door.status()["events"] if "starting the group again" in e]
    assert len(said) == 1 and "a node of the group being started is doomed" in said[0]
    assert ctl.run()["state"] == "finished"
    second = FakeGroup.instances[1]
    assert doomed not in second.nodes and ctl.rec.attempts[0].ended_by == "preemption notice"
