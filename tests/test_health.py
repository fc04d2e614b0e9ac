"""Hang, data-stall, straggler and cordon policies as pure functions, the health book
and the cordons room on injected clocks, and the ranks' signals (heartbeat, compute
meter, injected faults) without Ray."""

from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from spotline import constants
from spotline.config import load_spec
from spotline.config.loader import SpecError
from spotline.controller.clock import Clock
from spotline.controller.cordons import Cordons
from spotline.controller.health import (
    DataStall,
    Hang,
    HangError,
    HealthBook,
    behind_ranks,
    find_hang,
    find_stragglers,
    hang_bound,
    is_collective_timeout,
)
from spotline.controller.policies import classify
from spotline.metrics.prometheus import Metrics
from spotline.runtime.cluster import CordonList
from spotline.runtime.faults import Faults, refusal
from spotline.runtime.progress import RankBeat
from spotline.train.health import DATA_PHASE, ComputeMeter, Heartbeat

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


def _poll(book, step, ranks_s, stage_of=lambda r: 0):
    """One poll of 5 steps: rank r computed `ranks_s[r]` seconds per step."""
    ranks = [
        beat(r, stage=stage_of(r), replica=r, compute_steps=5, compute_s=5 * t)
        for r, t in enumerate(ranks_s)
    ]
    book.take(ranks, step, float(step))


def test_the_book_reports_a_straggler_once_it_stayed_slow_past_a_window_and_exports_per_rank():
    book, events = _book()
    book.group_started(0.0, 0)
    step = 1
    for _ in range(4):  # steps 1-5 warm up, then the windows fill: not reported yet
        step += 5
        _poll(book, step, [0.10, 0.15])
    assert book.stragglers == {} and events == []
    for _ in range(3):  # slower by 50% for more than another window (10 steps)
        step += 5
        _poll(book, step, [0.10, 0.15])
    assert list(book.stragglers) == [1]
    assert [e for e in events if e.startswith("straggler: rank 1")]
    assert book.metrics.seen[("spotline_rank_slowdown", ("replica", 1), ("stage", 0))] == (
        pytest.approx(0.5)
    )
    assert book.metrics.seen[("spotline_stragglers_total",)] == 1
    # Past the cordon threshold (0.5)? Not quite: 50% is not more than 50%.
    assert book.cordon_due(float(step), set()) == []
    view = book.view(float(step))
    assert view["stragglers"][0]["rank"] == 1 and view["ranks"][1]["compute_s"] == 0.15


def test_a_rank_hovering_around_the_straggler_threshold_is_reported_once_not_flapping():
    # The threshold is 20%. Rank 1 is 25% slower for a while: reported once. Then, as on
    # a busy host, it hovers around the threshold for 60 polls (its windowed slowdown
    # crosses 20% again and again): nothing more is said. Only once it stayed below 10%
    # for more than a window is it well again, said once.
    book, events = _book()
    book.group_started(0.0, 0)
    step = 1

    def measured():
        ranks = book.view(float(step))["ranks"]
        return ranks[1]["compute_s"] / ranks[0]["compute_s"] - 1

    for _ in range(8):
        step += 5
        _poll(book, step, [0.10, 0.125])
    assert list(book.stragglers) == [1] and len(events) == 1
    assert events[0].startswith("straggler: rank 1")
    crossings, above = 0, True
    for i in range(60):
        step += 5
        _poll(book, step, [0.10, 0.10 * [1.26, 1.14, 1.27, 1.13, 1.25, 1.12][i % 6]])
        if (measured() > 0.2) != above:
            crossings, above = crossings + 1, not above
    assert crossings >= 10  # it flapped across the threshold ...
    assert list(book.stragglers) == [1] and len(events) == 1  # ... and nobody was told
    for _ in range(6):
        step += 5
        _poll(book, step, [0.10, 0.10])
    assert book.stragglers == {} and len(events) == 2
    assert events[-1] == (
        "rank 1 is no longer a straggler (below 10% slower than its peers for 10 steps)"
    )


def test_the_straggler_watch_holds_each_verdict_for_more_than_a_window():
    from spotline.controller.health import Straggler, StragglerWatch

    watch = StragglerWatch(threshold=0.2, clear=0.1, hold=10)

    def measured(slowdown):
        return {1: Straggler(1, 0, 1, "n", 1.0 + slowdown, 1.0)}

    assert watch.judge(measured(0.3), 10) == ([], [])
    assert watch.judge(measured(0.3), 20) == ([], [])  # 10 steps: not more than the window
    assert watch.judge(measured(0.15), 21) == ([], [])  # dipped: the run starts again
    assert watch.judge(measured(0.3), 22) == ([], [])
    raised, _ = watch.judge(measured(0.3), 33)
    assert [s.rank for s in raised] == [1]
    assert watch.judge(measured(0.05), 34) == ([], [])
    assert watch.judge(measured(0.05), 45) == ([], [1])


# --- data stalls ----------------------------------------------------------------------------


def test_a_rank_waiting_for_data_past_the_bound_with_its_peers_in_a_collective_is_a_stall():
    beats = [
        beat(0, step=8, phase=DATA_PHASE),
        beat(1, step=8, phase="step agreement (collective)"),
        beat(2, step=8, phase="gradient all-reduce (collective)"),
    ]
    verdict = find_hang(30.0, 20.0, beats)
    assert isinstance(verdict, DataStall) and not isinstance(verdict, Hang)
    assert [b.rank for b in verdict.behind] == [0]
    msg = replace(verdict, limit_s=300).message()
    assert msg.startswith("data stall: rank 0 (stage 0, replica 0, node node-0)")
    assert "no rank is hung" in msg and "300s" in msg
    # Frozen in the data phase (silent): that is a hang, not storage.
    beats[0] = beat(0, step=8, phase=DATA_PHASE, silent=15.0)
    assert isinstance(find_hang(30.0, 20.0, beats), Hang)
    # One rank waits for data, another one computes at the same step: a hang.
    beats[0] = beat(0, step=8, phase=DATA_PHASE)
    beats[2] = beat(2, step=8, phase="backward micro-batch 1")
    assert isinstance(find_hang(30.0, 20.0, beats), Hang)


def test_the_book_says_a_data_stall_once_never_declares_a_hang_and_fails_past_its_limit(
    monkeypatch,
):
    monkeypatch.setattr(constants, "SPOTLINE_DATA_STALL_LIMIT_S", 100.0)
    book, events = _book(collective_timeout_s=600)
    book.group_started(0.0, 0)
    book.take([beat(0, step=5), beat(1, step=5)], 5, 0.0)
    step_s, saves = [0.05] * 10, []

    def stalled(now):
        waiting = [
            replace(beat(0, step=6, phase=DATA_PHASE), phase_s=now),
            beat(1, step=6, phase="step agreement (collective)"),
        ]
        book.take(waiting, 5, now)
        return book.hang(now, step_s, saves)

    for now in range(1, 100):  # the floor (20 s) passes: a stall, not a hang
        assert stalled(float(now)) is None
    stalls = [e for e in events if e.startswith("data stall:")]
    assert len(stalls) == 1 and "rank 0 (stage 0, replica 0, node node-0)" in stalls[0]
    assert book.view(99.0)["data_stall"]["ranks"] == [0]
    over = stalled(100.0)
    assert isinstance(over, DataStall)
    err = over.error()
    assert (
        "past SPOTLINE_DATA_STALL_LIMIT_S (100s)" in str(err) and "not a hang" in str(err).lower()
    )
    kind = classify([err], str(err))
    assert kind.name != "hang" and kind.retryable  # a restart may help; no node is blamed


def test_a_data_stall_that_ends_restarts_the_hang_clock():
    book, events = _book()
    book.group_started(0.0, 0)
    book.take([beat(0, step=5), beat(1, step=5)], 5, 0.0)
    waiting = [
        replace(beat(0, step=6, phase=DATA_PHASE), phase_s=30.0),
        beat(1, step=6, phase="step agreement (collective)"),
    ]
    book.take(waiting, 5, 30.0)
    assert book.hang(30.0, [0.05] * 10, []) is None
    # The batches came at 31 s; rank 0 computes (slowly) in its forward: no hang yet, as
    # the clock runs from the end of the stall, not from the last step.
    working = [beat(0, step=6), beat(1, step=6, phase="step agreement (collective)")]
    book.take(working, 5, 31.0)
    assert book.hang(31.0, [0.05] * 10, []) is None
    assert events[-1].startswith("data stall over: rank(s) 0 got their batches after 31s")
    assert book.hang(45.0, [0.05] * 10, []) is None
    assert isinstance(book.hang(52.0, [0.05] * 10, []), Hang)  # 21 s after the stall


# --- cordons --------------------------------------------------------------------------------


class _Store:
    """The commit coordinator's artifacts, in memory."""

    def __init__(self, saved=None):
        self.files = {} if saved is None else {"cordon.json": json.dumps(saved).encode()}

    def read_artifact(self, path):
        return self.files.get(path)

    def write_artifact(self, path, data):
        self.files[path] = data
        return f"file:///ckpt/artifacts/{path}"


class _Cluster:
    """Replica-sized nodes; capacity counts the free ones that are not cordoned."""

    def __init__(self, free):
        self.free = set(free)
        self.cordoned = CordonList()

    def capacity(self, held_workers=0, exclude=frozenset(), lifted=frozenset()):
        usable = {n for n in self.free if n not in self.cordoned or n in lifted}
        return len(usable - set(exclude))


def _cordons(free=("node-0", "node-1", "node-2"), saved=None, **failure):
    spec = load_spec(
        {"elastic": {"min_replicas": 2, "max_replicas": 4}, "failure": failure},
    )
    events: list[str] = []
    book = HealthBook(spec, lambda *a, **k: None, _Recorded())
    wall, clock = [1_000_000.0], [0.0]
    room = Cordons(
        spec,
        book,
        _Cluster(free),
        _Store(saved),
        SimpleNamespace(owned=True),
        None,
        lambda text, *a, **k: events.append(text),
        Clock(monotonic=lambda: clock[0], wall=lambda: wall[0]),
    )
    return room, events, wall


def _hang_on(room, node, step=10):
    room.after_hang([HangError("hang", [node])], step, lambda nodes: 2)


def test_hang_counts_decay_so_only_hangs_within_the_ttl_cordon_a_node():
    room, events, wall = _cordons(cordon_after_hangs=2, hang_count_ttl_s=3600)
    _hang_on(room, "node-1")
    wall[0] += 3601  # an hour later the first hang no longer counts
    _hang_on(room, "node-1")
    assert room.nodes == set() and room.hangs_on() == {"node-1": 1}
    wall[0] += 600
    _hang_on(room, "node-1")  # two within the hour
    assert room.nodes == {"node-1"}
    assert "a rank there hung 2 times within 1.0h" in room.nodes.get("node-1").why
    assert any(e.startswith("cordoned node node-1 for 6.0h (failure.cordon_ttl_s)") for e in events)
    wall[0] += 3600
    assert room.hangs_on() == {}  # the count decays; the cordon stands for its own ttl
    assert room.expire() == [] and room.nodes == {"node-1"}


def test_a_collective_timeout_during_a_data_stall_blames_no_node():
    room, events, _ = _cordons(cordon_after_hangs=1)
    waiting = (replace(beat(0, step=6, phase=DATA_PHASE), phase_s=500.0),)
    room.health.stall = DataStall(500.0, waiting, 540.0)
    timeout = RuntimeError("Timed out waiting 600000ms for recv operation to complete")
    room.after_hang([timeout], 6, lambda nodes: 2)
    assert room.nodes == set() and room.hangs_on() == {} and room.health.hangs == []
    assert "waited for data: not counted against their node(s)" in events[-1]


def test_cordons_expire_after_their_ttl_with_an_event():
    room, events, wall = _cordons(cordon_ttl_s=7200)
    room.cordon("node-1", "a rank there hung 2 times", lambda nodes: 2)
    wall[0] += 7199
    assert room.expire() == []
    wall[0] += 1
    assert room.expire() == ["node-1"] and room.nodes == set()
    assert "expired after 2.0h (failure.cordon_ttl_s)" in events[-1]
    saved = json.loads(room.coordinator.files["cordon.json"])
    assert saved["cordoned"] == {}


def test_a_cordon_is_lifted_when_the_job_could_not_otherwise_reach_min_replicas():
    room, events, wall = _cordons(free=("node-0", "node-1", "node-2"))
    cluster = room.cluster
    room.cordon("node-1", "a rank there hung 2 times", lambda nodes: 2)
    assert room.make_room(lambda lifted: cluster.capacity(lifted=lifted)) == []  # 2 left
    wall[0] += 60
    room.cordon("node-2", "rank 3 there computed 80% slower than its peers", lambda nodes: 2)
    # node-0 alone holds 1 replica, below min_replicas 2: lifting the older cordon
    # (node-1) is enough, and the newer one stays.
    wall[0] += 60
    lifted = room.make_room(lambda lifted: cluster.capacity(lifted=lifted))
    assert lifted == ["node-1"] and room.nodes == {"node-2"}
    said = events[-1]
    assert said.startswith("lifted the cordon on node node-1 (a rank there hung 2 times, made")
    assert "elastic.min_replicas (2)" in said
    assert "Cordoned node(s) not counted: node-2 (rank 3 there" in room.waiting_note()
    # Short even with every cordon lifted: capacity, not the cordons, is what it waits on.
    cluster.free = {"node-2"}
    assert room.make_room(lambda lifted: cluster.capacity(lifted=lifted)) == []
    assert room.nodes == {"node-2"}


def test_a_resubmitted_job_applies_only_the_cordons_from_cordon_json_that_have_not_expired():
    now = 1_000_000.0
    saved = {
        "cordoned": {
            "node-1": {"why": "a rank there hung 2 times", "at": now - 3600},
            "node-2": {"why": "rank 3 there computed 80% slower", "at": now - 7 * 3600},
            "node-3": "a rank there hung 2 times",  # an older version's: no time
        },
        "hangs": {"node-1": [now - 600, now - 7200]},
    }
    room, events, _ = _cordons(saved=saved, hang_count_ttl_s=3600)
    room.keep()
    assert room.nodes == {"node-1"}
    assert room.hangs_on() == {"node-1": 1}
    assert any("node node-1 stays cordoned" in e and "for 5.0h more" in e for e in events)
    expired = [e for e in events if "expired (failure.cordon_ttl_s 6.0h): not applied" in e]
    assert len(expired) == 2 and "node-2" in expired[0] + expired[1]


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
    stops: list[tuple[int, int]] = []
    monkeypatch.setattr("signal.pthread_kill", lambda tid, sig: stops.append((tid, sig)))
    mine.maybe_freeze(5, "save")
    mine.maybe_freeze(6, "forward")
    assert stops == []
    mine.maybe_freeze(6, "save")
    mine.maybe_freeze(6, "save")  # the restarted group passes step 6 again: no freeze
    # The stop goes to the thread that hit the freeze, which then stops the process.
    assert stops == [(threading.get_ident(), signal.SIGSTOP)]
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


# --- through the controller (a fake group, an injected clock) --------------------------------


def test_a_data_stall_in_a_running_job_is_said_once_and_costs_no_failure_or_cordon(tmp_path):
    from controller_fakes import make, run_until

    # Rank 0 waits 60 s for its batches at step 15 in two groups' worth of tries; its
    # peers wait for it in a collective. The hang floor is 20 s.
    ctl, store = make(
        tmp_path,
        {"stall": {"at": 15, "rank": 0, "for_s": 60, "times": 2}},
        **{"failure.cordon_after_hangs": 1},
    )
    run_until(ctl, lambda: ctl.state.terminal)
    assert ctl.state.name == "finished" and len(ctl.rec.attempts) == 1
    assert ctl.rec.failures == 0 and ctl.health.hangs == []
    assert ctl.fake_cluster.cordoned == set()
    events = ctl.events.since(0)[0]
    stalls = [e for e in events if e.startswith("data stall:")]
    assert len(stalls) == 1 and "rank 0 (stage 0, replica 0, node node-" in stalls[0]
    assert len([e for e in events if e.startswith("data stall over")]) == 1


def test_a_data_stall_past_its_limit_restarts_as_a_data_failure_not_a_hang(tmp_path, monkeypatch):
    from controller_fakes import make, run_until

    monkeypatch.setattr(constants, "SPOTLINE_DATA_STALL_LIMIT_S", 40.0)
    ctl, _ = make(
        tmp_path,
        {"stall": {"at": 15, "rank": 0, "for_s": 1000, "times": 1}},
        **{"failure.cordon_after_hangs": 1},
    )
    run_until(ctl, lambda: ctl.state.terminal)
    assert ctl.state.name == "finished"
    first, second = ctl.rec.attempts
    assert first.ended_by == "failure" and "data stall: rank 0" in first.error
    assert "SPOTLINE_DATA_STALL_LIMIT_S (40s)" in first.error
    assert second.restored_from == 10
    assert ctl.health.hangs == [] and ctl.fake_cluster.cordoned == set()
    assert ctl.rec.failures == 1  # the restart it took counts; no node is blamed


def _cordoned_before(tmp_path, node):
    """An earlier run of the job cordoned `node` a minute ago (its cordon.json)."""
    (tmp_path / "ckpt" / "artifacts").mkdir(parents=True)
    made = {"why": "a rank there hung 2 times", "at": time.time() - 60}
    (tmp_path / "ckpt" / "artifacts" / "cordon.json").write_text(
        json.dumps({"cordoned": {node: made}})
    )


def test_a_placement_lifts_a_cordon_that_keeps_the_job_below_min_replicas(tmp_path):
    """A resubmitted job whose earlier run cordoned node-1: the cluster now holds only
    node-0 and node-1, and min_replicas is 2. It lifts the cordon (saying so) rather than
    waiting on capacity that is there."""
    from controller_fakes import make, run_until

    _cordoned_before(tmp_path, "node-1")
    ctl, _ = make(tmp_path, **{"elastic.min_replicas": 2})
    cluster = ctl.fake_cluster

    def capacity(held_workers=0, exclude=frozenset(), lifted=frozenset()):
        return len({"node-0", "node-1"} - (set(cluster.cordoned) - set(lifted)))

    cluster.capacity = capacity
    run_until(ctl, lambda: len(ctl.rec.attempts) == 1)
    events = ctl.events.since(0)[0]
    assert any(e.startswith("node node-1 stays cordoned") for e in events)
    lifted = [e for e in events if e.startswith("lifted the cordon on node node-1")]
    assert lifted and "elastic.min_replicas (2)" in lifted[0]
    assert ctl.fake_cluster.cordoned == set() and ctl.rec.attempts[0].replicas == 2
    assert not any("Waiting up to" in e for e in events)


def test_the_wait_for_capacity_names_the_cordoned_nodes(tmp_path):
    from controller_fakes import make

    _cordoned_before(tmp_path, "node-1")
    # Nothing fits, with or without node-1: the cordon is not what the job waits on.
    ctl, _ = make(tmp_path, capacity=0)
    ctl.step()  # pending
    ctl.step()  # scheduling: waits
    assert ctl.state.name == "waiting" and ctl.fake_cluster.cordoned == {"node-1"}
    waits = [e for e in ctl.events.since(0)[0] if "Waiting up to" in e]
    assert (
        "Cordoned node(s) not counted: node-1 (a rank there hung 2 times; expires in" in (waits[0])
    )
