"""Hang, straggler and cordon policies as pure functions, and the ranks' signals
(heartbeat, compute meter, injected faults) without Ray."""

from __future__ import annotations

import json

import pytest

from spotline.config import load_spec
from spotline.config.loader import SpecError
from spotline.controller.health import (
    HealthBook,
    behind_ranks,
    find_hang,
    find_stragglers,
    hang_bound,
    is_collective_timeout,
)
from spotline.controller.policies import classify
from spotline.metrics.export import Metrics
from spotline.runtime.faults import Faults, refusal
from spotline.runtime.progress import RankBeat
from spotline.train.health import ComputeMeter, Heartbeat

pytestmark = pytest.mark.unit


def beat(rank, step=7, phase="forward micro-batch 1", silent=0.0, running=True, **kw):
    stage, replica = kw.pop("stage", rank // 2), kw.pop("replica", rank % 2)
    return RankBeat(
        rank, stage, replica, f"node-{replica}", step, phase, 1.0, silent, running, **kw
    )


# --- the hang bound and who is behind ---------------------------------------------------


def test_the_hang_bound_is_factor_times_the_median_step_plus_a_save_with_a_floor():
    assert hang_bound([2.0, 3.0, 100.0], [], 10, 20, 300) == 30.0  # the median, not the mean
    assert hang_bound([2.0, 3.0, 100.0], [4.0, 1.0], 10, 20, 300) == 34.0  # a save holds a step
    assert hang_bound([0.1] * 5, [], 10, 20, 300) == 20.0  # the floor
    assert hang_bound([], [], 10, 20, 300) == 300.0  # no step measured yet: the first-step bound


def test_no_hang_within_the_bound_or_when_every_rank_is_done():
    beats = [beat(0), beat(1, silent=30)]
    assert find_hang(20.0, 20.0, beats) is None
    done = [beat(0, running=False), beat(1, running=False)]
    assert find_hang(100.0, 20.0, done) is None


def test_a_silent_rank_is_the_one_named():
    waiting = "step agreement (collective)"
    beats = [
        beat(0, phase=waiting),
        beat(1, silent=25.0),
        beat(2, phase="receive activation (p2p)"),
    ]
    hang = find_hang(26.0, 20.0, beats)
    assert hang is not None and [b.rank for b in hang.behind] == [1]
    msg = hang.message()
    assert "no step for 26.0s (bound 20.0s)" in msg
    assert "rank 1 (stage 0, replica 1, node node-1) has not answered for 25.0s" in msg
    assert "last seen in 'forward micro-batch 1' of step 7" in msg
    assert hang.nodes == ["node-1"]


def test_when_all_answer_the_lowest_step_not_waiting_on_a_peer_is_behind():
    # A wedged device: rank 2 answers but sits in its forward of step 6; the others wait.
    beats = [
        beat(0, step=7, phase="step agreement (collective)"),
        beat(1, step=6, phase="receive activation (p2p)"),
        beat(2, step=6, phase="backward micro-batch 2"),
    ]
    assert [b.rank for b in behind_ranks(beats, 10.0)] == [2]
    # Every rank at the lowest step waits: all of them are named.
    beats[2] = beat(2, step=6, phase="gradient all-reduce (collective)")
    assert [b.rank for b in behind_ranks(beats, 10.0)] == [1, 2]


def test_a_collective_timeout_is_a_hang_and_retried():
    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
        "5000ms for recv operation to complete"
    )
    nccl = RuntimeError(
        "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, "
        "OpType=ALLREDUCE) ran for 600000 milliseconds before timing out."
    )
    for e in (gloo, nccl):
        assert is_collective_timeout(str(e))
        kind = classify([e])
        assert kind.name == "hang" and kind.retryable
    assert classify([RuntimeError("Connection closed by peer")]).name == "transient"
    # Out of memory stays out of memory, whatever else the text says.
    assert classify([MemoryError("timed out waiting for memory")]).name == "out of memory"


# --- stragglers -----------------------------------------------------------------------------


def test_a_straggler_is_compared_with_its_own_stage_on_the_other_replicas():
    beats = [beat(r, stage=r // 3, replica=r % 3) for r in range(6)]
    # Stage 0 runs 1.0 s; rank 1 takes 1.5 s. Stage 1 is slower by design (2.0 s):
    # not a straggler, its peers are its own stage.
    per_step = {0: 1.0, 1: 1.5, 2: 1.02, 3: 2.0, 4: 2.05, 5: 1.98}
    (s,) = find_stragglers(per_step, beats, 0.2)
    assert (s.rank, s.stage, s.replica) == (1, 0, 1)
    assert s.slowdown == pytest.approx(1.5 / 1.01 - 1)
    assert "computes 49% slower than its peers" in s.message()
    assert find_stragglers(per_step, beats, 0.6) == []
    # A rank alone in its stage (one replica) has no peers to be slower than.
    assert find_stragglers({0: 1.0, 1: 9.0}, [beat(0, stage=0), beat(1, stage=1)], 0.2) == []


class _Recorded(Metrics):
    def __init__(self):
        super().__init__("t")
        self.seen: dict = {}

    def set(self, name, value, **tags):
        self.seen[(name, *sorted(tags.items()))] = value

    def inc(self, name, value=1, **tags):
        self.seen[(name,)] = self.seen.get((name,), 0) + value


def _book(**failure):
    spec = load_spec({"failure": {"straggler_window_steps": 10, **failure}})
    events: list[str] = []
    book = HealthBook(spec, lambda text, *a, **k: events.append(text), _Recorded())
    return book, events


def test_the_book_reports_a_straggler_once_its_window_is_full_and_exports_per_rank():
    book, events = _book()
    book.group_started(0.0, 0)
    step = 1
    for _ in range(4):  # 4 polls of 5 steps: steps 1-5 warm up, then windows fill
        step += 5
        book.take(
            [
                beat(0, stage=0, replica=0, compute_steps=5, compute_s=5 * 0.10),
                beat(1, stage=0, replica=1, compute_steps=5, compute_s=5 * 0.15),
            ],
            step,
            float(step),
        )
    assert list(book.stragglers) == [1]
    assert [e for e in events if e.startswith("straggler: rank 1")]
    assert book.metrics.seen[("spotline_rank_slowdown", ("replica", 1), ("stage", 0))] == (
        pytest.approx(0.5)
    )
    assert book.metrics.seen[("spotline_stragglers_total",)] == 1
    # Past the cordon threshold (0.5)? Not quite: 50% is not more than 50%.
    assert book.cordon_due(float(step)) == []
    view = book.view(float(step))
    assert view["stragglers"][0]["rank"] == 1 and view["ranks"][1]["compute_s"] == 0.15


def test_the_book_counts_hangs_per_node_and_keeps_its_cordons_across_a_restart():
    book, _ = _book(cordon_after_hangs=2)
    assert book.hung(["node-1"], 14) == []
    assert book.hung(["node-1", "node-2"], 30) == ["node-1"]
    book.cordon("node-1", "a rank there hung 2 times")
    again, _ = _book()
    again.load(book.to_json())
    assert again.cordoned == {"node-1": "a rank there hung 2 times"}
    assert again.hangs_on == {"node-1": 2, "node-2": 1}
    off, _ = _book(cordon=False)
    assert off.hung(["n"], 1) == [] and off.hung(["n"], 2) == []


def test_the_failure_section_checks_its_thresholds():
    with pytest.raises(SpecError, match="cordon_straggler_threshold"):
        load_spec({"failure": {"straggler_threshold": 0.5, "cordon_straggler_threshold": 0.3}})
    f = load_spec({}).failure
    assert (f.hang_factor, f.collective_timeout_s, f.straggler_threshold) == (10.0, 600.0, 0.2)


# --- the ranks' signals -----------------------------------------------------------------------


def test_a_heartbeat_names_the_step_and_phase_and_counts_micro_batches():
    now = [100.0]
    hb = Heartbeat(clock=lambda: now[0])
    hb.begin_step(5)
    hb.instruction("LoadMicroBatch")
    hb.instruction("ForwardPass")
    hb.instruction("SendActivation")
    hb.instruction("ForwardPass")
    now[0] += 2.5
    assert hb.read() == {"step": 5, "phase": "forward micro-batch 2", "phase_s": 2.5}
    hb.instruction("RecvGrad")
    assert hb.read()["phase"] == "receive gradient (p2p)"
    hb.begin_step(6)
    hb.instruction("ForwardPass")
    assert hb.read()["phase"] == "forward micro-batch 1" and hb.read()["step"] == 6


def test_the_compute_meter_sums_the_bracketed_passes_per_step():
    from spotline.bubbles.recorder import HostClock

    now = [0.0]
    clock = HostClock()
    clock.mark = lambda: now[0]  # a scripted host clock: no wall time is read
    meter = ComputeMeter(clock=clock)
    for _ in range(3):
        meter.begin_step()
        for _ in range(2):
            mark = meter.start()
            now[0] += 0.010  # a forward pass
            meter.stop(mark)
        now[0] += 0.020  # a collective: not counted
        meter.end_step()
    steps, seconds = meter.take()
    assert steps == 3 and seconds == pytest.approx(0.06)
    assert meter.take() == (0, 0.0)


def test_faults_are_read_per_rank_and_a_freeze_fires_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SPOTLINE_TEST_FAULTS", str(tmp_path))
    job = load_spec({"name": "job", "failure": {"test_faults": True}})
    assert Faults.for_rank(job, 1, "n") is None  # no list for this job
    (tmp_path / "job.json").write_text(
        json.dumps(
            [
                {"kind": "freeze", "rank": 1, "step": 6, "phase": "save"},
                {"kind": "slow", "node": "n2", "factor": 3.0},
            ]
        )
    )
    assert Faults.for_rank(job, 0, "n1") is None
    mine = Faults.for_rank(job, 1, "n1")
    assert [f["kind"] for f in mine.faults] == ["freeze"] and mine.slow_factor() == 1.0
    assert Faults.for_rank(job, 3, "n2").slow_factor() == 3.0
    stops: list[int] = []
    monkeypatch.setattr("os.kill", lambda pid, sig: stops.append(sig))
    mine.maybe_freeze(5, "save")
    mine.maybe_freeze(6, "forward")
    assert stops == []
    mine.maybe_freeze(6, "save")
    mine.maybe_freeze(6, "save")  # the restarted group passes step 6 again: no freeze
    assert len(stops) == 1
    monkeypatch.delenv("SPOTLINE_TEST_FAULTS")
    assert Faults.for_rank(job, 1, "n1") is None  # production: nothing is read


def test_faults_in_a_job_not_marked_as_a_test_are_refused_and_said_once(tmp_path, monkeypatch):
    """A variable left set on a cluster does nothing to a job whose spec does not say
    failure.test_faults: its ranks apply none of the faults listed for it."""
    monkeypatch.setenv("SPOTLINE_TEST_FAULTS", str(tmp_path))
    (tmp_path / "prod.json").write_text(
        json.dumps([{"kind": "freeze", "rank": 0, "step": 1}, {"kind": "slow", "rank": 1}])
    )
    prod = load_spec({"name": "prod"})
    assert not prod.failure.test_faults  # the default
    assert Faults.for_rank(prod, 0, "n1") is None and Faults.for_rank(prod, 1, "n1") is None
    said = refusal(prod)
    assert said is not None and said.startswith("SPOTLINE_TEST_FAULTS names faults for this job")
    assert "failure.test_faults: true" in said and "none is applied" in said
    marked = load_spec({"name": "prod", "failure": {"test_faults": True}})
    assert Faults.for_rank(marked, 0, "n1") is not None and refusal(marked) is None
    assert refusal(load_spec({"name": "other"})) is None  # nothing listed for it
    monkeypatch.delenv("SPOTLINE_TEST_FAULTS")
    assert refusal(prod) is None
