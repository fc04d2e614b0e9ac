"""Bubble detection against DeepSpeed's own 1F1B schedule, the forecast, the channel
and the trace. The schedule is `deepspeed.runtime.pipe.schedule.TrainSchedule`
itself, played by `simulate` with blocking receives."""

from __future__ import annotations

import json
import time
from types import MethodType

import pytest

from spotline.bubbles import (
    WAITS,
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
from spotline.bubbles.recorder import DeviceClock, HostClock, clock_for
from spotline.bubbles.schedule import program, simulate_passes
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
    clock = _ScriptedHostClock()  # each instruction moves it by what it waited

    def make(name, wait_s):
        def fn(self, **kwargs):
            calls.append(name)
            clock.now += wait_s

        return fn

    engine = _FakeEngine()
    type(engine)._INSTRUCTION_MAP = {
        ds.RecvActivation: make("RecvActivation", 0.02),
        ds.ForwardPass: make("ForwardPass", 0.0),
    }
    chan = WindowChannel(tmp_path / "c.chan", create=True)
    rec = StepRecorder(
        stage=1, stages=2, micro_batches=1, channel=chan, min_window_s=0.001, clock=clock
    )
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


# --- a stage's real instruction stream, with scripted clocks ---------------------------


def _pipe_engine(stages, micro_batches, stage, run, device=None):
    """DeepSpeed PipelineEngine's `train_batch` loop with its own instruction classes and
    TrainSchedule; every instruction (and the loss broadcast) calls `run(name)`."""
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    def instr(name):
        def fn(self, **kwargs):
            run(name)

        return fn

    class Engine:
        _INSTRUCTION_MAP = {cls: instr(cls.__name__) for cls in PipelineEngine._INSTRUCTION_MAP}

        def __init__(self):
            self.device = device

        def _aggregate_total_loss(self):
            run("LossSync")

        def train_batch(self):
            # As PipelineEngine._exec_schedule, then train_batch's loss broadcast.
            sched = TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage)
            for cmds in sched:
                for cmd in cmds:
                    MethodType(self._INSTRUCTION_MAP[type(cmd)], self)(**cmd.kwargs)
            self._aggregate_total_loss()

    return Engine()


def _train_step(rec, engine, step, run):
    """One step as the trainer runs it: begin, train_batch, the all-rank agreement."""
    rec.begin_step(step)
    engine.train_batch()
    rec.record_sync(lambda: run("StepSync"))


class _ScriptedHostClock(HostClock):
    """Host clock whose time moves only when an instruction says so."""

    def __init__(self):
        self.now = 0.0

    def mark(self):
        return self.now

    def step_start(self, host_now):
        return self.now


class _FakeDevice:
    """A CUDA stream's timeline: work queued moves `tail`, the device has executed up
    to `done` (everything, unless a test holds it back)."""

    def __init__(self):
        self.tail = 100.0
        self.done = float("inf")


class _FakeEvent:
    """torch.cuda.Event(enable_timing=True) on a `_FakeDevice`'s stream."""

    made = 0

    def __init__(self):
        _FakeEvent.made += 1
        self.at = None

    def record(self, stream):
        self.stream, self.at = stream, stream.tail

    def query(self):
        return self.at is not None and self.stream.done >= self.at

    def elapsed_time(self, other):
        assert self.query() and other.query(), "elapsed_time on an incomplete event"
        return (other.at - self.at) * 1e3

    def synchronize(self):
        raise AssertionError("the recorder waited for the device")


# Device seconds of each instruction (a receive waits on the device, not the host).
_DEVICE_S = {
    "LoadMicroBatch": 0.01,
    "ForwardPass": 0.2,
    "BackwardPass": 0.4,
    "RecvActivation": 0.3,
    "SendGrad": 0.05,
    "ReduceTiedGrads": 0.0,
    "ReduceGrads": 0.02,
    "OptimizerStep": 0.03,
    "LossSync": 0.07,
    "StepSync": 0.11,
}


def _no_cuda_calls(monkeypatch):
    import torch

    def boom(*a, **k):
        raise AssertionError("the recorder called into CUDA itself")

    for name in ("synchronize", "current_stream", "Event"):
        monkeypatch.setattr(torch.cuda, name, boom)


def test_device_clock_reads_the_devices_times_one_step_late_without_a_sync(monkeypatch):
    _no_cuda_calls(monkeypatch)
    dev = _FakeDevice()
    scale = {}  # step -> how much slower than _DEVICE_S its instructions run on the device

    def run(name):
        dev.tail += _DEVICE_S[name] * scale[rec._step]
        time.sleep(0.001 if name == "ForwardPass" else 0.0)  # host time: unrelated

    clock = DeviceClock(event=_FakeEvent, stream=lambda: dev)
    rec = StepRecorder(stage=1, stages=2, micro_batches=2, clock=clock)
    engine = _pipe_engine(2, 2, 1, run)
    rec.attach(engine)
    names = [n for _, n in program(2, 2, 1)] + ["LossSync", "StepSync"]

    def expected(step):
        out, t = [], 0.0
        for n in names:
            d = _DEVICE_S[n] * scale[step]
            out.append((n, t, t + d))
            t += d
        return out

    def check(tl, step):
        want = expected(step)
        assert [i.name for i in tl] == [n for n, _, _ in want]
        assert [i.start for i in tl] == pytest.approx([b for _, b, _ in want])
        assert [i.end for i in tl] == pytest.approx([e for _, _, e in want])

    scale[1] = 1.0
    before = time.monotonic()
    _train_step(rec, engine, 1, run)
    assert rec.recent_steps() == [] and rec.pending_steps() == [1]  # read one step late
    assert rec.take_totals()["steps"] == 0
    scale[2] = 2.0
    _train_step(rec, engine, 2, run)
    ((step, host_start, tl),) = rec.recent_steps()
    assert step == 1 and before <= host_start <= time.monotonic()  # CLOCK_MONOTONIC
    check(tl, 1)
    # The host's ForwardPass took 1 ms; the device's 200 ms.
    assert tl[names.index("ForwardPass")].seconds == pytest.approx(0.2)
    # Step 3 runs while the device is still behind step 2's end: step 2 stays pending.
    scale[3] = 1.0
    dev.done = dev.tail - 0.001
    _train_step(rec, engine, 3, run)
    assert rec.pending_steps() == [2, 3] and len(rec.recent_steps()) == 1
    dev.done = float("inf")
    scale[4] = 1.0
    _train_step(rec, engine, 4, run)
    assert rec.pending_steps() == [4]
    steps = rec.recent_steps()
    assert [s for s, _, _ in steps] == [1, 2, 3]
    assert [s[1] for s in steps] == sorted(s[1] for s in steps)
    for s, _, tl in steps:
        check(tl, s)
    # Totals and forecast are the device's too.
    totals = rec.take_totals()
    waits = [
        t for t in expected(1) if t[0] in ("RecvActivation", "SendGrad", "LossSync", "StepSync")
    ]
    assert totals["steps"] == 3 and totals["dropped"] == 0
    assert totals["step_s"] == pytest.approx(expected(1)[-1][2] * 4)  # 1 + 2 + 1
    assert totals["wait_s"] == pytest.approx(sum(e - b for _, b, e in waits) * 4)
    oracle = Forecast()
    for _, _, tl in steps:
        oracle.update(tl)
    assert rec.forecast.next_step() == oracle.next_step()
    first = names.index("RecvActivation")
    assert rec.forecast.remaining(first) == pytest.approx(oracle.remaining(first))
    # Events of read steps are recorded again rather than made anew.
    made = _FakeEvent.made
    scale[5] = 1.0
    _train_step(rec, engine, 5, run)
    assert _FakeEvent.made == made


def test_device_clock_drops_the_oldest_unread_step_and_counts_it(monkeypatch):
    _no_cuda_calls(monkeypatch)
    dev = _FakeDevice()
    dev.done = 0.0  # the device never gets anywhere

    def run(name):
        dev.tail += _DEVICE_S[name]

    clock = DeviceClock(event=_FakeEvent, stream=lambda: dev)
    rec = StepRecorder(stage=1, stages=2, micro_batches=1, clock=clock, max_pending=2)
    engine = _pipe_engine(2, 1, 1, run)
    rec.attach(engine)
    for step in range(1, 6):
        _train_step(rec, engine, step, run)
    assert rec.pending_steps() == [4, 5]
    dev.done = float("inf")
    _train_step(rec, engine, 6, run)
    assert [s for s, _, _ in rec.recent_steps()] == [4, 5]
    totals = rec.take_totals()
    assert totals["dropped"] == 3 and totals["steps"] == 2


def test_the_engines_device_picks_the_clock():
    import torch

    assert isinstance(clock_for(torch.device("cuda", 0)), DeviceClock)
    assert isinstance(clock_for(torch.device("cpu")), HostClock)
    rec = StepRecorder(stage=0, stages=2, micro_batches=1)
    rec.attach(_pipe_engine(2, 1, 0, lambda name: None, device=torch.device("cuda", 0)))
    assert isinstance(rec.clock, DeviceClock)
    given = HostClock()
    rec = StepRecorder(stage=0, stages=2, micro_batches=1, clock=given)
    rec.attach(_pipe_engine(2, 1, 0, lambda name: None, device=torch.device("cuda", 0)))
    assert rec.clock is given


# --- the cold start ----------------------------------------------------------------------


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 8)])
def test_the_seed_has_the_instructions_a_recorded_step_has(p, m):
    for stage in range(p):
        rec = StepRecorder(stage, p, m, micro_s=[0.01] * p, clock=_ScriptedHostClock())
        engine = _pipe_engine(p, m, stage, lambda name: None)
        rec.attach(engine)
        _train_step(rec, engine, 1, lambda name: None)
        recorded = rec.recent_steps()[0][2]
        seed = rec.seed_timeline()
        assert [i.name for i in seed] == [i.name for i in recorded]
        assert [i.slot for i in seed] == [i.slot for i in recorded]
        assert [i.name for i in seed] == [n for _, n in program(p, m, stage)] + [
            "LossSync",
            "StepSync",
        ]


def test_the_forecast_starts_from_the_simulated_schedule(tmp_path):
    micro_s = [0.03, 0.06]  # stage 1 twice as heavy (it holds the head)
    for stage in (0, 1):
        rec = StepRecorder(stage, 2, 4, micro_s=micro_s)
        sim = windows(simulate_passes(2, 4, micro_s)[stage])
        tl = simulate_passes(2, 4, micro_s)[stage]
        predicted = rec.forecast.next_step()
        assert predicted and rec.forecast.seeded
        # A predicted window is a run of simulated waits that lasts, from its first wait
        # on; together they are the simulated idle time, each inside a simulated window.
        runs = [
            (k, tl[k].start, sum(i.seconds for i in tl[k : k + _waits_from(tl, k)]))
            for k in range(len(tl))
            if tl[k].name in WAITS and (k == 0 or tl[k - 1].name not in WAITS)
        ]
        runs = [r for r in runs if r[2] > 0]
        assert [w.first for w in predicted] == [k for k, _, _ in runs]
        assert [w.start for w in predicted] == pytest.approx([t for _, t, _ in runs])
        assert [w.seconds for w in predicted] == pytest.approx([d for _, _, d in runs])
        assert sum(w.seconds for w in predicted) == pytest.approx(sum(w.seconds for w in sim))
        for w in predicted:
            assert any(s.start <= w.start + 1e-12 and w.end <= s.end + 1e-12 for s in sim)
            assert rec.forecast.remaining(w.first) == pytest.approx(w.seconds)
    # Without costs there is nothing to predict from.
    assert StepRecorder(1, 2, 4).forecast.next_step() == []


def _waits_from(tl, first):
    """How many consecutive wait instructions start at `first`."""
    n = 0
    while first + n < len(tl) and tl[first + n].name in WAITS:
        n += 1
    return n


def _announced(forecast, timeline, min_s=0.0):
    """Windows a step with the forecast's schedule opens: one per wait predicted long enough."""
    return sum(
        1 for k, i in enumerate(timeline) if i.name in WAITS and forecast.remaining(k) > min_s
    )


def test_the_first_measured_step_replaces_the_seed(tmp_path):
    clock = _ScriptedHostClock()
    measured = {"RecvActivation": 0.5, "ForwardPass": 0.1, "BackwardPass": 0.2, "StepSync": 0.05}

    def run(name):
        clock.now += measured.get(name, 0.0)

    chan = WindowChannel(tmp_path / "c.chan", create=True)
    rec = StepRecorder(1, 2, 4, channel=chan, micro_s=[0.003, 0.003], clock=clock)
    engine = _pipe_engine(2, 4, 1, run)
    rec.attach(engine)
    # The first step already tells the executor about the simulated windows.
    seed = rec.seed_timeline()
    announced = _announced(rec.forecast, seed)
    _train_step(rec, engine, 1, run)
    assert announced >= len(windows(seed)) > 0
    assert chan.state().seq == announced
    tl = rec.recent_steps()[0][2]
    assert not rec.forecast.seeded
    oracle = Forecast()
    oracle.update(tl)
    assert rec.forecast.next_step() == oracle.next_step()  # the measurement, not an average
    first = windows(tl)[0]
    assert tl[first.first].name == "RecvActivation"
    assert rec.forecast.remaining(first.first) == pytest.approx(0.5)
    # A new schedule depth starts again from its own simulation.
    rec.set_micro_batches(8)
    assert rec.forecast.seeded
    oracle = Forecast()
    oracle.update(rec.seed_timeline())
    assert rec.forecast.next_step() == oracle.next_step()
    assert len(rec.seed_timeline()) > len(tl)


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
