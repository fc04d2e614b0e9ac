"""Bubble detection against DeepSpeed's own 1F1B schedule, the forecast, the channel
and the trace. The schedule is `deepspeed.runtime.pipe.schedule.TrainSchedule`
itself, played by `simulate` with blocking receives."""

from __future__ import annotations

import json
import multiprocessing as mp
import time

import pytest

from spotline.bubbles import (
    Forecast,
    StepRecorder,
    WindowChannel,
    bubble_fraction,
    compute_gaps,
    idle_slots,
    simulate,
    theory_fraction,
    windows,
)
from spotline.bubbles.book import BubbleBook
from spotline.bubbles.trace import chrome_trace, summarize

pytestmark = pytest.mark.unit

SHAPES = [(2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (4, 16)]


@pytest.mark.parametrize("p,m", SHAPES)
def test_windows_match_the_schedules_idle_slots(p, m):
    """Equal slot times: each stage idles exactly its 2(p-1) idle slots of the schedule,
    and the detector's windows are exactly the stretches without compute."""
    timelines = simulate(p, m, t_fwd=1.0, t_bwd=1.0)
    for s, tl in enumerate(timelines):
        found = windows(tl)
        assert [(w.start, w.end) for w in found] == compute_gaps(tl)
        slots = idle_slots(p, m, s)
        assert len(slots) == 2 * (p - 1)
        assert sum(w.seconds for w in found) == pytest.approx(len(slots))
        assert bubble_fraction(tl) == pytest.approx(theory_fraction(p, m))
        assert tl[-1].end == pytest.approx(2 * (m + p - 1))  # the schedule's slot count


def test_two_stage_windows_sit_where_1f1b_puts_them():
    # p=2, m=4, one time unit per pass. Stage 1 waits for stage 0's first forward at
    # the start, and at the end for stage 0's last backward (in the end-of-step sync);
    # stage 0 waits mid-warm-up for the first gradient and near the end for the last.
    s0, s1 = simulate(2, 4)
    assert [(w.start, w.end) for w in windows(s1)] == [(0.0, 1.0), (9.0, 10.0)]
    assert [(w.start, w.end) for w in windows(s0)] == [(2.0, 3.0), (8.0, 9.0)]
    assert s1[windows(s1)[0].first].name == "RecvActivation"
    assert s0[windows(s0)[0].first].name == "RecvGrad"


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_unequal_passes_keep_windows_equal_to_compute_gaps(p, m):
    # Backward twice the forward (the usual ratio): the bubble per stage is
    # (p-1)(t_f + t_b) out of (m+p-1)(t_f + t_b): the same fraction.
    for tl in simulate(p, m, t_fwd=1.0, t_bwd=2.0):
        assert [(w.start, w.end) for w in windows(tl)] == compute_gaps(tl)
        assert sum(w.seconds for w in windows(tl)) == pytest.approx(3.0 * (p - 1))
        assert bubble_fraction(tl) == pytest.approx(theory_fraction(p, m))


def test_min_window_drops_short_waits():
    # Simulated schedule time (one unit per pass), not a clock.
    tl = simulate(2, 4, t_fwd=1.0, t_bwd=1.0, t_comm=0.01)[0]
    every = windows(tl)
    kept = windows(tl, min_s=0.5)
    assert kept == [w for w in every if w.end - w.start > 0.5]
    assert len(kept) == 2 < len(every)


def test_forecast_predicts_the_next_steps_windows():
    f = Forecast(alpha=0.5)
    slow = simulate(2, 4, t_fwd=2.0, t_bwd=2.0)[1]
    f.update(simulate(2, 4)[1])
    f.update(simulate(2, 4)[1])
    first = windows(simulate(2, 4)[1])[0]
    assert f.remaining(first.first) == pytest.approx(first.seconds)
    assert [(w.start, w.end) for w in f.next_step()] == [(0.0, 1.0), (9.0, 10.0)]
    f.update(slow)  # the steps got slower: the forecast moves halfway
    assert f.remaining(first.first) == pytest.approx(1.5)
    assert f.remaining(first.first + 1) == 0.0  # not a wait: no window there


def test_forecast_restarts_when_the_schedule_changes():
    f = Forecast()
    f.update(simulate(2, 4)[0])
    f.update(simulate(2, 8, t_fwd=3.0, t_bwd=3.0)[0])
    assert [w.seconds for w in f.next_step()] == [3.0, 3.0]


def _executor_side(path, q):
    chan = WindowChannel(path)
    st = chan.wait_open(10.0)
    q.put(None if st is None else (st.seq, st.open))
    chan.account(filled_ns=5_000_000, overrun_ns=1_000_000)
    q.put("accounted")


def test_channel_wakes_the_other_process_and_carries_the_fill(tmp_path):
    path = tmp_path / "window.chan"
    chan = WindowChannel(path, create=True)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_executor_side, args=(str(path), q))
    proc.start()
    time.sleep(0.5)
    chan.open_window(0.05)
    assert q.get(timeout=30) == (1, 1)
    assert q.get(timeout=30) == "accounted"
    chan.close_window()
    proc.join(timeout=30)
    st = chan.state()
    assert (st.open, st.filled_ns, st.overrun_ns, st.slices) == (0, 5_000_000, 1_000_000, 1)
    assert st.closed_ns > 0 and chan.closed_at(1) == st.closed_ns
    chan.open_window(0.05)
    assert chan.closed_at(2) is None  # still open
    assert chan.wait_open(0.05).seq == 2
    chan.close_window()
    assert chan.wait_open(0.05) is None  # closed: nothing to wait for
    assert chan.closed_at(1) < chan.closed_at(2)


class _FakeEngine:
    """The two hooks StepRecorder replaces, as DeepSpeed's PipelineEngine has them."""

    _INSTRUCTION_MAP: dict = {}

    def __init__(self):
        self.ran = []

    def _aggregate_total_loss(self):
        self.ran.append("LossSync")


def test_recorder_times_the_engines_instructions_and_opens_windows(tmp_path):
    from deepspeed.runtime.pipe import schedule as ds

    calls = []

    def make(name, wait_s):
        def fn(self, **kwargs):
            calls.append(name)
            time.sleep(wait_s)

        return fn

    engine = _FakeEngine()
    type(engine)._INSTRUCTION_MAP = {
        ds.RecvActivation: make("RecvActivation", 0.02),
        ds.ForwardPass: make("ForwardPass", 0.0),
    }
    chan = WindowChannel(tmp_path / "c.chan", create=True)
    rec = StepRecorder(stage=1, stages=2, micro_batches=1, channel=chan, min_window_s=0.001)
    rec.attach(engine)
    from types import MethodType

    for step in (1, 2):
        rec.begin_step(step)
        for cls in (ds.RecvActivation, ds.ForwardPass):
            MethodType(engine._INSTRUCTION_MAP[cls], engine)()
        engine._aggregate_total_loss()
        rec.record_sync(lambda: None)
    # Unrecorded outside a step (eval_batch runs the same instructions).
    MethodType(engine._INSTRUCTION_MAP[ds.ForwardPass], engine)()
    names = [i.name for i in rec.recent[-1][2]]
    assert names == ["RecvActivation", "ForwardPass", "LossSync", "StepSync"]
    assert calls.count("ForwardPass") == 3
    # Step 1 taught the forecast; step 2's receive opened (and closed) a window.
    assert chan.state().seq == 1 and chan.state().open == 0
    totals = rec.take_totals()
    assert totals["steps"] == 2
    assert 0 < totals["bubble_fraction"] <= 1
    assert totals["wait_s"] > 0


def test_simulated_loss_broadcast_waits_for_the_last_stage():
    tls = simulate(3, 4, t_fwd=1.0, t_bwd=2.0)
    ends = [tl[-3].end for tl in tls]  # each stage's schedule ends before its two syncs
    for s, tl in enumerate(tls):
        loss, sync = tl[-2], tl[-1]
        assert (loss.name, sync.name) == ("LossSync", "StepSync")
        assert loss.start == ends[s] and loss.end == max(ends[s], ends[-1])
        assert sync.start == loss.end and sync.end == max(ends)


def test_trace_has_a_track_per_stage_and_its_idle_time():
    tls = simulate(2, 4, t_fwd=0.01, t_bwd=0.02)
    ranks = []
    for s, tl in enumerate(tls):
        ranks.append(
            {
                "stage": s,
                "replica": 0,
                "rank": s,
                "steps_timeline": [
                    {
                        "step": 7,
                        "start_ns": 1_000_000_000,
                        "instrs": [(i.name, i.slot, i.start, i.end) for i in tl],
                    }
                ],
                "slices": [(1_000_000_000, 1_005_000_000, "eval")] if s == 1 else [],
            }
        )
    trace = json.loads(json.dumps(chrome_trace(ranks, "job")))
    per_track = summarize(trace)
    assert set(per_track) == {
        "stage-0/replica-0",
        "stage-1/replica-0",
        "stage-1/replica-0 backfill",
    }
    for s, tl in enumerate(tls):
        idle = sum(w.seconds for w in windows(tl))
        assert per_track[f"stage-{s}/replica-0"]["idle"] == pytest.approx(idle)
    assert per_track["stage-1/replica-0 backfill"]["backfill"] == pytest.approx(0.005)


def test_book_sums_stages_and_replicas():
    book = BubbleBook(stages=2)
    book.add(
        [
            {"stage": 0, "rank": 0, "steps": 10, "step_s": 10.0, "wait_s": 2.0, "filled_s": 1.5},
            {"stage": 1, "rank": 1, "steps": 10, "step_s": 10.0, "wait_s": 4.0, "filled_s": 4.0},
        ],
        micro_batches=4,
    )
    s = book.summary()
    assert s["theory"] == pytest.approx(0.2)
    assert s["bubble_fraction"] == pytest.approx(6.0 / 20.0)
    assert s["fill_fraction"] == pytest.approx(5.5 / 6.0)
    assert s["per_stage"][0]["fill_fraction"] == pytest.approx(0.75)
