"""Failures through the controller (`failures.py`): restarts, max_failures, what a
restart cannot fix, hangs, stragglers and cordons, node losses seen late, and a restore
from a peer copy that cannot be read. Against a fake group."""

from __future__ import annotations

import json

import pytest

from controller_fakes import FakeGroup, make, run_until
from spotline.checkpoint.transfer import UploadResult
from spotline.controller.state import (
    Failed,
    Finished,
    Running,
)
from spotline.report import status_rows

pytestmark = pytest.mark.unit


def test_worker_failure_restarts_from_latest_commit(tmp_path):
    ctl, store = make(tmp_path, script={"kill_at": 15})
    res = ctl.run()
    assert res["state"] == "finished"
    assert res["failures"] == 1
    first, second = FakeGroup.instances
    assert first.shut and second.restored == [10]
    assert res["attempts"][1]["restored_from"] == 10
    assert [s for s, _ in res["attempts"][1]["losses"]][0] == 11
    assert "worker process died" in res["attempts"][0]["error"]
    assert "[ranks 3@node-1]" in res["attempts"][0]["error"]


def test_steps_reported_in_the_poll_that_failed_are_kept(tmp_path):
    # Step 12 is saved and its receipts land in storage, then a rank dies in the same
    # poll: the restart commits 12 from the receipts and resumes after it, so steps 11
    # and 12 are never trained again. Their losses come from the failing poll's report.
    ctl, _ = make(tmp_path, script={"kill_at": 12}, **{"checkpoint.interval_steps": 4})
    res = ctl.run()
    assert res["state"] == "finished" and res["failures"] == 1
    assert res["attempts"][1]["restored_from"] == 12
    assert sorted(res["losses"]) == list(range(1, 26))


def test_max_failures_exhausted_fails_with_clear_message(tmp_path):
    ctl, _ = make(tmp_path, script={"kill_at": 3}, **{"failure.max_failures": 0})
    res = ctl.run()
    assert res["state"] == "failed"
    assert "failure.max_failures=0" in res["error"]
    assert "worker process died" in res["error"]


def test_start_failure_counts_as_failure_and_retries(tmp_path):
    ctl, _ = make(tmp_path, script={"fail_start": True})
    res = ctl.run()
    assert res["state"] == "finished"
    assert res["failures"] == 1


def test_an_unexpected_controller_error_tears_everything_down(tmp_path, monkeypatch):
    ctl, _ = make(tmp_path)
    run_until(ctl, lambda: ctl.step_count >= 5)

    def boom(*a, **k):
        raise KeyError("surprise")

    monkeypatch.setattr(ctl.growth, "decide", boom)
    ctl.step()
    assert isinstance(ctl.state, Failed)
    assert "internal error in the controller while running: KeyError" in ctl.state.error
    assert FakeGroup.instances[0].shut and ctl.fake_cluster.closed


def test_an_error_in_user_code_run_by_the_controller_is_called_theirs(tmp_path, monkeypatch):
    """The controller runs user code too (a notice source named by module:attr): what it
    raises is the user's, not 'a Spotline bug'."""
    from spotline.registry import import_object

    (tmp_path / "user_notice_source.py").write_text(
        "def poll(*args, **kwargs):\n    raise RuntimeError('metadata server answered 500')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    poll = import_object("user_notice_source:poll", "preemption.sources[0].kind")
    ctl, _ = make(tmp_path)
    run_until(ctl, lambda: ctl.step_count >= 5)
    monkeypatch.setattr(ctl.growth, "decide", poll)
    ctl.step()
    assert isinstance(ctl.state, Failed)
    error = ctl.state.error
    assert "error in your code" in error and "Spotline bug" not in error
    assert "user_notice_source.poll, user_notice_source.py line 2" in error
    assert "preemption.sources[0].kind 'user_notice_source:poll'" in error
    assert FakeGroup.instances[0].shut and ctl.fake_cluster.closed


@pytest.mark.parametrize(
    ("cause", "kind", "fix"),
    [
        (MemoryError("CUDA out of memory. Tried to allocate 51.0 GiB"), "out of memory", "micro-batch"),
        (FileNotFoundError(2, "No such file or directory", "/data/tok.json"), "missing path", "path"),
        (PermissionError(13, "Permission denied", "/stage"), "permission denied", "write access"),
    ],
)  # fmt: skip
def test_a_failure_a_restart_cannot_fix_fails_at_once(tmp_path, cause, kind, fix):
    ctl, _ = make(tmp_path, script={"kill_at": 12, "cause": cause}, **{"failure.max_failures": 5})
    res = ctl.run()
    assert res["state"] == "failed"
    assert res["failures"] == 0  # not counted against failure.max_failures
    assert len(FakeGroup.instances) == 1  # and never restarted
    assert res["error"].startswith(f"{kind}: training failed:")
    assert "Not retried" in res["error"] and fix in res["error"]
    assert "max_failures" not in res["error"] and "\n" not in res["error"]


def test_a_frozen_rank_is_declared_hung_named_and_its_node_cordoned_after_two(tmp_path):
    # Rank 1 (stage 0, replica 1, on node-1) freezes at step 15 in two groups running.
    ctl, store = make(tmp_path, {"freeze": {"at": 15, "rank": 1, "times": 2}})
    run_until(ctl, lambda: ctl.state.terminal)
    assert isinstance(ctl.state, Finished)
    first, second, third = ctl.rec.attempts
    assert first.ended_by == second.ended_by == "hang"
    assert "rank 1 (stage 0, replica 1, node node-1" in first.error
    assert "has not answered for" in first.error and "'forward micro-batch 1'" in first.error
    assert "rank 0 (" not in first.error  # waiting in a collective: held up, not the cause
    # Declared after the bound (20 s floor: 10 x a 50 ms step is less), not after the
    # 600 s collective timeout.
    assert "(bound 20.0s)" in first.error
    assert second.restored_from == third.restored_from == 10
    assert ctl.rec.failures == 2  # hangs count against failure.max_failures
    # Twice on node-1: cordoned, kept beside the checkpoints, and out of the capacity.
    assert ctl.fake_cluster.cordoned == {"node-1"}
    assert "hung 2 times within 1.0h" in ctl.fake_cluster.cordoned.get("node-1").why
    saved = json.loads(store.read_artifact("cordon.json"))
    assert list(saved["cordoned"]) == ["node-1"] and len(saved["hangs"]["node-1"]) == 2
    rows = dict(status_rows(ctl.door.status()))
    assert rows["cordoned"].startswith("node node-1") and rows["hangs"] == "2"
    assert "expires in 6.0h" in rows["cordoned"]

    # A new controller of the same job keeps node-1 out before it places anything.
    again, _ = make(tmp_path, **{"train.steps": 30})
    again.step()  # pending
    assert again.fake_cluster.cordoned == {"node-1"}
    assert again.cordons.view()["cordoned"] == ctl.cordons.view()["cordoned"]


def test_a_third_hang_fails_the_job_when_max_failures_is_two(tmp_path):
    ctl, _ = make(
        tmp_path, {"freeze": {"at": 15, "rank": 1, "times": 3}}, **{"failure.cordon": False}
    )
    run_until(ctl, lambda: ctl.state.terminal)
    assert isinstance(ctl.state, Failed)
    assert "3 transient worker failures" in ctl.rec.error and "hang" in ctl.rec.error
    assert ctl.fake_cluster.cordoned == set()  # failure.cordon: false


def test_a_node_is_not_cordoned_when_the_job_could_not_run_without_it(tmp_path):
    # One replica fits on the cluster, and the live group holds it: without node-0
    # nothing is left for min_replicas 1.
    def capacity(held, cluster):
        live = FakeGroup.instances and FakeGroup.instances[-1].running
        return held // 2 + (0 if live else 1)

    ctl, _ = make(
        tmp_path,
        {"freeze": {"at": 15, "rank": 0, "times": 2}},
        capacity=capacity,
        **{"elastic.max_replicas": 1, "failure.cordon_after_hangs": 1},
    )
    run_until(ctl, lambda: ctl.state.terminal)
    assert isinstance(ctl.state, Finished)
    assert ctl.fake_cluster.cordoned == set()
    assert any(
        "not cordoned, as without it the cluster holds 0 replica(s)" in e
        for e in ctl.events.since(0)[0]
    )


def test_a_straggler_is_reported_and_its_node_left_at_the_next_boundary(tmp_path):
    # node-1's ranks compute 3x slower than their peers; node-2 is spare.
    ctl, _ = make(
        tmp_path,
        {"slow_nodes": {"node-1": 3.0}},
        **{"train.steps": 400, "failure.straggler_window_steps": 10},
    )
    run_until(ctl, lambda: len(ctl.rec.attempts) == 2 and isinstance(ctl.state, Running))
    first = ctl.rec.attempts[0]
    assert first.ended_by == "cordon"
    events = ctl.events.since(0)[0]
    straggled = [e for e in events if e.startswith("straggler: rank 1 (stage 0, replica 1)")]
    assert straggled and "node node-1 computes 200% slower than its peers" in straggled[0]
    assert ctl.fake_cluster.cordoned == {"node-1"}
    assert "computed 200% slower" in ctl.fake_cluster.cordoned.get("node-1").why
    # Left at a checkpoint boundary, and the next group runs on node-0 and node-2.
    second = FakeGroup.instances[-1]
    assert second.restored[-1] % 10 == 0 and second.restored[-1] == first.losses[-1][0]
    assert "node-1" not in second.node_ids() and second.replicas == 2
    ctl.door.request_stop()
    run_until(ctl, lambda: ctl.state.terminal)


def test_a_group_whose_only_restore_is_a_peer_copy_still_initialises_its_weights(tmp_path):
    """Nothing is committed yet and the failed group left a complete peer copy: the next
    group is built with its random init all the same, so a peer copy that no rank can
    read leaves it training from the start, not refusing to step on empty weights."""
    from spotline.checkpoint.peer import PEER_KEY, PeerOffer
    from spotline.checkpoint.transfer import build_manifest
    from spotline.runtime.peers import PeerMemory

    ctl, store = make(tmp_path, {"kill_at": 7, "peer_unreadable": True})
    asked = []

    class Keepers(PeerMemory):  # the failed group's step 5, complete in live nodes' memory
        def offer(self, attempt, world, partition, at=None, leaving=frozenset()):
            asked.append(attempt)
            results = [UploadResult(5, r, attempt, world, [], []) for r in range(world)]
            manifest = build_manifest(ctl.spec, 5, attempt, world, results)
            manifest.extra[PEER_KEY] = {"holders": {}}
            return PeerOffer(5, attempt, manifest)

        def retain(self, attempts):
            pass

    ctl.recovery.peers = Keepers(ctl.spec)
    run_until(ctl, lambda: ctl.state.terminal)
    assert isinstance(ctl.state, Finished), ctl.state
    first, second = FakeGroup.instances[:2]
    assert asked == [first.attempt]
    assert first.init and second.init and second.restored == []
    assert any("peer copy of step 5 could not be restored" in e for e in ctl.events.since(0)[0])


def test_faults_listed_for_a_job_not_marked_as_a_test_are_said_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SPOTLINE_TEST_FAULTS", str(tmp_path / "faults"))
    (tmp_path / "faults").mkdir()
    (tmp_path / "faults" / "ctl.json").write_text('[{"kind": "slow", "rank": 1}]')
    ctl, _ = make(tmp_path)
    ctl.run()
    said = [e for e in ctl.door.status()["events"] if "SPOTLINE_TEST_FAULTS" in e]
    assert len(said) == 1 and "none is applied" in said[0]
    marked, _ = make(tmp_path / "marked", **{"failure.test_faults": True})
    assert not any("SPOTLINE_TEST_FAULTS" in e for e in marked.door.status()["events"])


@pytest.mark.parametrize(("seen_gone_after_s", "node_lost"), [(0.4, True), (1.5, False)])
def test_a_node_seen_gone_a_moment_after_its_worker_died_is_a_node_loss(
    tmp_path, seen_gone_after_s, node_lost
):
    """Rank 3's process dies on node-1; the node shows as gone `seen_gone_after_s` later.
    Within SPOTLINE_NODE_LOSS_WAIT_S (1 s) that is a spot loss, which uses up no
    failure; after it, a failure of the worker on a live node."""
    ctl, _ = make(tmp_path, script={"kill_at": 15})
    cluster, clock = ctl.cluster, ctl.fake_clock
    checks: list[float] = []  # the clock at each check after the death

    def gone(node_ids):
        checks.append(clock.now)
        if clock.now - checks[0] >= seen_gone_after_s:
            cluster.nodes.discard("node-1")
        return set(node_ids) - cluster.nodes

    cluster.gone = gone
    res = ctl.run()
    assert res["state"] == "finished"
    assert (res["node_losses"], res["failures"]) == ((1, 0) if node_lost else (0, 1))
    # The checks stop at the first sight of the loss, or once the wait is over.
    assert checks[-1] - checks[0] == pytest.approx(0.5 if node_lost else 1.0)
