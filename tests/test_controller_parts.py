"""The controller's parts without its loop: the pace, the JIT timing, the re-partition
book, the typed snapshot and its projections, the inbox. No Ray, no worker group."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from spotline.config import load_spec
from spotline.controller.clock import Clock
from spotline.controller.events import Events as EventLog
from spotline.controller.inbox import Inbox
from spotline.controller.notices import JitBook, JitPolicy, MoveUp, predicted_save_s
from spotline.controller.pace import Pace
from spotline.controller.repartition import PartitionBook
from spotline.controller.snapshot import (
    Attempt,
    Figures,
    Published,
    Record,
    Snapshot,
    as_result,
    as_status,
    as_summary,
)

pytestmark = pytest.mark.unit


def _spec(**over):
    raw = {
        "name": "parts",
        "model": {"n_layers": 6},
        "parallel": {"pipeline_stages": 2, "micro_batches": 2, "partition": "balanced"},
        "elastic": {"min_replicas": 1, "max_replicas": 2},
        "train": {"steps": 400, "global_batch_size": 8},
        "checkpoint": {"uri": "file:///tmp/parts", "interval_steps": 50},
        "preemption": {"jit_checkpoint_budget_s": 5.0},
    }
    return load_spec(raw, over)


class Events:
    def __init__(self):
        self.seen: list[tuple[str, int, str | None]] = []

    def __call__(self, text, level=20, track=None):
        self.seen.append((text, level, track))

    def texts(self):
        return [t for t, _, _ in self.seen]


# --- the pace -------------------------------------------------------------------------


def test_one_slow_chunk_does_not_decide_that_a_size_is_not_worth_returning_to():
    """A size's rate is a moving average of warm chunks: a single chunk slowed by a save
    or a warm-up moves it a little, not to that chunk's figure."""
    pace = Pace()
    pace.note_rate(2, 5.0, warm=False)  # the first group's warm-up
    assert pace.sps[2] == 5.0
    for _ in range(10):
        pace.note_rate(2, 24.0, warm=True)
    assert pace.sps[2] == pytest.approx(24.0)  # the cold figure is gone
    pace.note_rate(2, 8.0, warm=True)  # one chunk during a just-in-time save
    assert 20.0 < pace.sps[2] < 24.0
    pace.note_rate(2, 1.0, warm=False)  # a cold chunk of a later group: ignored
    assert 20.0 < pace.sps[2] < 24.0


def test_the_pace_measures_a_start_and_then_a_restart():
    pace = Pace()
    assert pace.restart_cost_s() is None and pace.wall_step_s() is None
    pace.starting(10.0)
    assert pace.stepped(14.0) is None  # a first start: no restart to end
    assert pace.start_s == 4.0 and pace.restart_cost_s() == 4.0
    pace.restart_from = (20.0, "grow")
    pace.starting(21.0)
    assert pace.stepped(27.0) == ("grow", 7.0)
    assert pace.restart_cost_s() == 7.0 and pace.restart_from is None
    pace.recent.extend([(1, 100.0), (5, 102.0)])
    assert pace.wall_step_s() == pytest.approx(0.5)


# --- just-in-time timing ----------------------------------------------------------------


def test_a_late_save_moves_up_only_when_it_would_miss_the_deadline():
    policy = JitPolicy(margin_s=10.0)
    args = dict(step=100, planned=150, save_s=10.0, seconds_left=120.0)
    # 50 steps at 1 s + 10 s save = 60 s, within the 110 s left: stays.
    assert policy.recheck(step_s=1.0, **args) is None
    # At 2.5 s a step: 135 s needed, 110 s left: the save moves up to the next step.
    assert policy.recheck(step_s=2.5, **args) == MoveUp(101, need_s=135.0, window_s=110.0)
    # Nothing measured yet, or the planned step is the next one: nothing to move.
    assert policy.recheck(step_s=None, **args) is None
    assert policy.recheck(step_s=9.0, **{**args, "planned": 101}) is None


def test_the_save_time_is_measured_once_an_upload_was():
    assert predicted_save_s([], [], 0.5) is None
    assert predicted_save_s([0.2, 0.3], [4.0], 0.5) == pytest.approx(0.3 + 4.0 + 1.0)
    assert predicted_save_s([], [4.0], 0.5) == pytest.approx(5.0)


WALL = 1_000_000.0
"""The JIT book's wall clock in these tests: it stands still."""


def _book(**over):
    events, fig = Events(), Figures()
    clock = Clock(monotonic=lambda: 0.0, wall=lambda: WALL, sleep=lambda s: None)
    book = JitBook(_spec(**over), JitPolicy(10.0), Pace(), fig, events, 0.5, clock)
    return book, fig, events


def _notice(node, deadline, clock=0.0):
    return {
        "source": "aws",
        "reason": "spot interruption",
        "node_id": node,
        "deadline": deadline,
        "received_clock": clock,
    }


def test_notices_for_the_live_group_wait_for_a_checkpoint_the_others_are_answered():
    book, rec, events = _book()
    drained = []
    now = WALL
    mine, other = _notice("node-0", now + 120), _notice("node-9", now + 120)
    jit = book.triage([mine, other], 40, {"node-0"}, lambda *a: drained.append(a[0]))
    assert jit == [mine] and drained == ["node-0", "node-9"]
    assert book.notices == [other] and "no ranks of this job" in other["outcome"]
    assert all(n["step"] == 40 for n in (mine, other))
    assert [track for _, _, track in events.seen] == ["preemption", "preemption"]
    # Without a group every notice is answered at once: the next group avoids the node.
    book.triage([_notice("node-1", now + 60)], 41, None, lambda *a: None)
    assert "the next group avoids it" in book.notices[-1]["outcome"]


def test_the_jit_plan_stays_on_a_long_notice_and_answers_it_once_committed():
    book, fig, events = _book()
    book.pace.recent.extend([(90, 1000.0), (100, 1010.0)])  # 1 s a step
    fig.blocked_s, fig.upload_s = [0.0], [9.0]  # a measured save: 9 + 2 x 0.5 = 10 s
    notice = _notice("node-0", WALL + 120, clock=3.0)
    at, deadline = book.plan([notice], 100, replicas=3, replicas_after=2)
    assert 195 <= at <= 200 and deadline == notice["deadline"]
    assert "just-in-time checkpoint after" in events.texts()[-1]
    book.pending.append(notice)
    book.answer(at, True, latest=at, now=10.0)
    assert book.pending == [] and book.notices == [notice]
    assert notice["committed_step"] == at and notice["notice_to_commit_s"] == 7.0
    assert "over preemption.jit_checkpoint_budget_s" in events.texts()[-1]  # 7 s > 5 s


def test_a_failed_jit_commit_names_the_latest_committed_step():
    book, rec, _ = _book()
    book.pending.append(_notice("node-0", WALL + 30))
    book.answer(120, False, latest=100, now=1.0)
    (n,) = book.notices
    assert n["committed_step"] == 100 and n["outcome"] == "commit failed"
    assert n["notice_to_commit_s"] is None


# --- the re-partition book --------------------------------------------------------------


def _partitions(**over):
    events = Events()
    book = PartitionBook(_spec(**over), events)
    book.started({"method": "balanced", "bounds": [0, 4, 8], "sizes": [4, 4]})
    return book, book, events


def test_a_repartition_waits_for_the_next_checkpoint_boundary():
    book, rec, _ = _partitions()
    leave = book.leave([0, 5, 8], 73, "asked for")
    assert leave.step == 100 and leave.bounds == [0, 5, 8]
    assert "layers per stage [4, 4] -> [5, 3]" in leave.detail
    assert rec.repartitions[-1]["outcome"] == "waiting for the checkpoint boundary"
    assert book.leave([0, 5, 8], 395, "asked for").step == 400  # never past the last step
    detail = book.restarting((0, 5, 8), 100)
    assert book.pin == [0, 5, 8] and "[5, 3]" in detail
    assert rec.repartitions[-1]["outcome"] == "restarting"
    # The next group starts at the new bounds: the re-partition is done.
    book.started({"bounds": [0, 5, 8], "sizes": [5, 3]})
    assert rec.repartitions[-1]["outcome"] == "done"
    assert book.current["repartition"] == len(rec.repartitions) - 1


def test_an_asked_partition_that_does_not_fit_is_ignored_with_a_warning():
    book, rec, events = _partitions()
    assert book.asked(None, 10) is None
    assert book.asked([3, 9], 10) is None and "ignored" in events.texts()[-1]
    assert book.asked([4, 4], 10) is None and "the partition in force" in events.texts()[-1]
    assert book.asked([3, 5], 10).bounds == [0, 3, 8]


def test_the_stages_measured_imbalance_is_kept_per_attempt():
    book, rec, _ = _partitions()
    reports = [
        {"stage": 0, "replica": 0, "steps": 5, "compute_s": 1.0, "step_s": 1.0, "wait_s": 0.0},
        {"stage": 1, "replica": 0, "steps": 5, "compute_s": 2.0, "step_s": 2.0, "wait_s": 0.0},
    ]
    book.measure(reports, 10)
    measured = book.current["measured"]
    assert measured["steps"] == 5 and measured["imbalance"] == pytest.approx(1 / 3)
    assert book.summary()["measured_imbalance"] == pytest.approx(1 / 3)
    assert [step for step, _, _ in book.window] == [10]


def test_no_rebalance_without_a_policy_a_measured_restart_or_a_window():
    book, _, _ = _partitions(**{"parallel.partition": "uniform"})
    args = dict(step=10, replicas=1, restart_s=1.0, steps_per_s=10.0, running_s=100.0)
    assert book.policy is None and book.rebalance(now=10.0, **args) is None
    book, _, _ = _partitions()
    assert book.rebalance(now=10.0, **{**args, "restart_s": None}) is None
    assert book.rebalance(now=11.0, **args) is None  # checked a second ago: not again yet


# --- the snapshot and its projections ---------------------------------------------------


def test_status_result_and_summary_are_cut_from_one_snapshot():
    snap = Snapshot(
        name="j",
        state="running",
        step=7,
        losses={5: 2.0, 7: 1.5},
        notices=[{"source": "aws", "node_id": "n", "committed_step": 5, "extra": 1}],
        attempts=[{"replicas": 1}],
        workers=[],
        bubbles=None,
    )
    assert snap["step"] == 7 and snap.as_dict()["name"] == "j"
    status = as_status(snap, ["e1"], 1)
    assert status["preemption_notices"] == 1 and status["events"] == ["e1"]
    assert status["next_event"] == 1 and status["step"] == 7
    result = as_result(snap)
    assert result["steps"] == 7 and result["final_train_loss"] == 1.5
    summary = as_summary(snap)
    assert summary["losses"] == {"5": 2.0, "7": 1.5}
    assert summary["notices"] == [
        {"source": "aws", "node_id": "n", "committed_step": 5, "notice_to_commit_s": None}
    ]
    assert "attempts" not in summary and "workers" not in summary


def test_a_stored_summary_reads_back_as_it_was_written():
    stored = {"name": "j", "state": "finished", "step": 25, "losses": {"25": 1.0}, "new": 3}
    snap = Snapshot.from_summary(stored)
    assert snap.losses == {25: 1.0} and snap.replicas == 0 and snap.workers == []
    assert snap["new"] == 3  # a key of another version is kept
    summary = as_summary(snap)
    assert summary["new"] == 3 and summary["losses"] == {"25": 1.0}
    assert "mfu" not in summary  # a field the stored summary lacked stays out
    assert as_status(snap, [], 0)["step"] == 25 and as_result(snap)["steps"] == 25
    with pytest.raises(KeyError):
        snap["mfu"]


def test_a_commit_keeps_the_losses_its_group_never_reported():
    from spotline.controller.telemetry import Telemetry

    rec = Record()
    rec.attempts.append(Attempt(replicas=1, attempt="att0", losses=[(1, 3.0)]))
    done = SimpleNamespace(
        manifest=SimpleNamespace(extra={"attempt": "att0"}),
        losses=[(1, 3.0), (2, 2.5)],
        nbytes=10,
        upload_s=0.5,
    )
    rec.take_losses(done.manifest.extra["attempt"], done.losses)
    tel = Telemetry(_spec(), Events(), lambda: 1000.0)
    tel.commit(2, done.nbytes, done.upload_s)
    assert rec.losses == {1: 3.0, 2: 2.5} and rec.attempts[0].losses == [(1, 3.0), (2, 2.5)]
    assert tel.fig.upload_bytes == [10] and tel.fig.upload_s == [0.5]


# --- the inbox --------------------------------------------------------------------------


def test_a_notice_dooms_its_node_until_it_is_forgotten():
    inbox = Inbox()
    assert inbox.notify(_notice("node-1", 5.0), 0.0, 0.0)
    assert inbox.notify(_notice("node-1", 5.0), 1.0, 1.0)
    notices, stop = inbox.take()
    assert len(notices) == 1 and stop is None and inbox.doomed() == ["node-1"]
    inbox.forget({"node-1"})
    assert inbox.doomed() == []
    log = EventLog()
    log.say("a")
    log.say("b")
    assert log.since(1) == (["b"], 2)


def test_a_trace_asked_after_the_job_ended_is_its_last_one_at_once():
    """The loop steps no more once the job ends: its last publish keeps the trace, and a
    later ask gets it without waiting for a step that never comes."""
    published = Published()
    traces = iter([{"traceEvents": ["last"]}])
    published.publish(Snapshot(state="running"), lambda: pytest.fail("nobody asked"))
    published.publish(Snapshot(state="finished"), lambda: next(traces), ended=True)
    assert published.trace(timeout_s=5.0) == {"traceEvents": ["last"]}
    assert published.trace(timeout_s=5.0) == {"traceEvents": ["last"]}
