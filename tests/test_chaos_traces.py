"""`spotline chaos` without a cluster: traces (the schema, each refusal, the built-in
traces' shape), what a rehearsal makes of its runs, the fit check, and the command line's
refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spotline.chaos.traces import BUILTIN, TraceError, check_trace, load_trace
from spotline.chaos.verdict import (
    Applied,
    first_difference,
    judge,
    lost_commits,
    settings_costs,
)
from spotline.cli import main

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")


def _trace(events, **over):
    return {"events": events, **over}


def _refused(raw, nodes=2, duration=60.0) -> str:
    with pytest.raises(TraceError) as ei:
        check_trace(raw, "my.json", nodes, duration)
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


# --- the schema --------------------------------------------------------------------------


def test_a_trace_file_loads_with_joins_numbered_and_each_notice_followed_by_its_going(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(
        json.dumps(
            {
                "name": "mine",
                "about": "two notices and a loss",
                "nodes": 3,
                "duration_s": 100,
                "events": [
                    {"at": 10, "kind": "notice", "node": 2, "deadline_s": 20},
                    {"at": 40, "kind": "join"},
                    {"at": 50, "kind": "loss", "node": 3},
                    {"at": 60, "kind": "notice", "node": 0, "deadline_s": 30},
                ],
            }
        )
    )
    t = load_trace(str(path), None, None, default_nodes=1)
    assert (t.name, t.nodes, t.duration_s) == ("mine", 3, 100.0)
    assert [(e.kind, e.node) for e in t.events] == [
        ("notice", 2),
        ("join", 3),
        ("loss", 3),
        ("notice", 0),
    ]
    assert [(e.at, e.kind, e.node) for e in t.timeline()] == [
        (10, "notice", 2),
        (30, "gone", 2),
        (40, "join", 3),
        (50, "loss", 3),
        (60, "notice", 0),
        (90, "gone", 0),
    ]


def test_span_stretches_times_to_the_duration_but_never_a_deadline():
    t = check_trace(
        _trace([{"at": 600, "kind": "notice", "node": 0, "deadline_s": 30}], span_s=1200),
        "t",
        1,
        120.0,
    )
    (e,) = t.events
    assert (e.at, e.deadline_s) == (60.0, 30.0)


def test_a_yaml_trace_loads_too(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("duration_s: 30\nevents:\n  - {at: 5, kind: loss, node: 1}\n")
    t = load_trace(str(path), 2, None, default_nodes=2)
    assert [(e.kind, e.node) for e in t.events] == [("loss", 1)]


# --- each refusal, naming the event ----------------------------------------------------------


def test_a_node_the_cluster_lacks_is_refused_naming_the_event():
    msg = _refused(_trace([{"at": 5, "kind": "loss", "node": 4}]))
    assert "events[0]" in msg and "node 4 does not exist then" in msg
    assert "raise --nodes" in msg


def test_a_node_already_gone_or_noticed_is_refused():
    gone = _refused(
        _trace([{"at": 5, "kind": "loss", "node": 1}, {"at": 9, "kind": "loss", "node": 1}])
    )
    assert "events[1]" in gone and "node 1 is gone by then" in gone
    noticed = _refused(
        _trace(
            [
                {"at": 5, "kind": "notice", "node": 0, "deadline_s": 20},
                {"at": 9, "kind": "loss", "node": 0},
            ]
        )
    )
    assert "events[1]" in noticed and "has a notice already" in noticed


@pytest.mark.parametrize("deadline", [0, -5, None, "soon"])
def test_a_deadline_that_is_not_above_zero_is_refused(deadline):
    event = {"at": 5, "kind": "notice", "node": 0}
    if deadline is not None:
        event["deadline_s"] = deadline
    msg = _refused(_trace([event]))
    assert "events[0] (notice at 5s for node 0)" in msg and "must be seconds > 0" in msg


def test_events_past_the_duration_are_refused():
    late = _refused(_trace([{"at": 70, "kind": "loss", "node": 0}]), duration=60)
    assert "events[0] (loss at 70s) is past the run's duration (60s)" in late
    going = _refused(
        _trace([{"at": 50, "kind": "notice", "node": 0, "deadline_s": 20}]), duration=60
    )
    assert "its node goes at 70s" in going and "raise --duration to 70" in going


def test_unknown_fields_kinds_and_shapes_are_refused_with_the_fix():
    assert "did you mean 'events'" in _refused({"evnts": []})
    assert "kind 'preempt'; give one of notice, loss, join" in _refused(
        _trace([{"at": 1, "kind": "preempt", "node": 0}])
    )
    assert "a join takes at, kind" in _refused(_trace([{"at": 1, "kind": "join", "node": 0}]))
    assert "non-empty list" in _refused(_trace([]))


def test_a_trace_without_a_duration_lasts_past_its_last_event():
    t = check_trace(
        _trace([{"at": 40, "kind": "notice", "node": 0, "deadline_s": 20}]), "t", 1, None
    )
    assert t.duration_s == 75.0  # its node goes at 60 s, and a quarter more
    assert (
        check_trace(_trace([{"at": 1, "kind": "loss", "node": 0}]), "t", 1, None).duration_s == 30
    )


def test_an_unknown_trace_name_lists_the_built_in_ones():
    with pytest.raises(TraceError) as ei:
        load_trace("stromy", None, None, 2)
    assert "did you mean 'stormy'" in str(ei.value)
    assert all(name in str(ei.value) for name in BUILTIN)


# --- the built-in traces -------------------------------------------------------------------------


@pytest.mark.parametrize("nodes", [1, 2, 3])
@pytest.mark.parametrize("name", list(BUILTIN))
def test_every_built_in_trace_is_valid_for_any_cluster_and_fits_its_duration(name, nodes):
    t = load_trace(name, nodes, None, 2)
    assert t.about and t.events and t.nodes == nodes
    assert all(0 <= e.at <= t.duration_s for e in t.timeline())


def test_the_built_in_traces_have_their_shape():
    gentle = load_trace("gentle", 2, None, 2)
    assert [e.kind for e in gentle.events] == ["notice", "join"]
    stormy = load_trace("stormy", 2, 120, 2)
    assert stormy.count("notice") >= 3 and stormy.count("loss") == 1 and stormy.count("join")
    deadlines = sorted(e.deadline_s for e in stormy.events if e.kind == "notice")
    assert deadlines[0] <= 5 < deadlines[-1]  # one short deadline among them
    for name, notice in (("aws-2min", 120), ("gcp-30s", 30), ("azure-30s", 30)):
        t = load_trace(name, 3, None, 2)
        assert {e.deadline_s for e in t.events if e.kind == "notice"} == {notice}, name
        assert f"{notice} s" in t.about and "scaled to the duration" in t.about
        longer = load_trace(name, 3, t.duration_s * 2, 2)
        # The pattern stretches with the duration; the cloud's notice does not.
        assert longer.events[0].at > t.events[0].at
        assert longer.events[0].deadline_s == t.events[0].deadline_s
    with pytest.raises(TraceError, match="needs at least 360s"):
        load_trace("aws-2min", 2, 200, 2)


# --- what a rehearsal makes of its runs ----------------------------------------------------------


def test_the_first_differing_step_and_the_tolerance():
    ref = {1: 3.0, 2: 2.5, 3: 2.0}
    assert first_difference(dict(ref), ref).first is None
    d = first_difference({1: 3.0, 2: 2.5000001, 3: 2.1}, ref)
    assert d.first == 3 and d.identical == 1 and d.compared == 3
    assert first_difference({1: 3.0, 2: 2.5, 3: 2.1}, ref, upto=2).first is None


def _drifting_run(replay_error=0.0, restore_error=0.0, last_error=0.0):
    """A reference at 2 replicas, and a job whose groups ran at 2, 1, 1 and 2 replicas
    (resumed from steps 60, 150 and 250); at 1 replica its losses drift from the
    reference's, quadratically in the steps since, 1e-4 relative at step 160."""

    def ref(s):
        return 2.0 + 1.0 / s

    def drifted(s):
        return ref(s) * (1 + 1e-8 * (s - 60) ** 2)

    def group(i, replicas, restored, steps, loss):
        return {"attempt": f"g{i}", "replicas": replicas, "restored_from": restored,
                "losses": [[s, loss(s)] for s in steps]}  # fmt: skip

    attempts = [
        group(0, 2, None, range(1, 81), ref),
        group(1, 1, 60, range(61, 201), lambda s: drifted(s) * (1 + restore_error * (s < 70))),
        group(2, 1, 150, range(151, 251), lambda s: drifted(s) * (1 + replay_error)),
        group(3, 2, 250, range(251, 301), lambda s: drifted(s) * (1 + last_error * (s > 252))),
    ]
    losses = {s: v for a in attempts for s, v in a["losses"]}
    reference = {s: ref(s) for s in range(1, 301)}
    return losses, reference, attempts, [group(0, 2, None, range(1, 301), ref)]


def test_a_job_at_another_replica_count_is_compared_with_the_reference_then_with_its_replays():
    losses, reference, attempts, ref_attempts = _drifting_run()
    assert first_difference(losses, reference).first == 160  # compared step for step
    d = first_difference(losses, reference, None, 1e-4, attempts, ref_attempts)
    assert d.first is None and d.drift_from == 61
    assert d.replayed == 50  # steps 151-200, trained by group 1 and again by group 2
    # Steps 251-255, which no group trained before, within 10 times the drift at 246-250.
    assert d.bounded == 5 and d.unchecked == []
    assert d.compared == 110 + 50 + 5
    (line,) = _judge(diff=d).reasons
    assert "up to 50 steps after step 61" in line and "50 of later resumed groups'" in line
    assert "5 with the uninterrupted run within 10 times the drift" in line
    # Without the reference's steps before the resume at 250, it cannot be checked.
    gap = {s: v for s, v in reference.items() if not 245 < s <= 250}
    d = first_difference(losses, gap, None, 1e-4, attempts, ref_attempts)
    assert d.first is None and d.unchecked == [250]
    assert "not checked: the groups resumed from step(s) 250" in _judge(diff=d).reasons[0]
    # The same run with no group at another replica count is compared step for step.
    same = [{**a, "replicas": 2} for a in attempts]
    assert first_difference(losses, reference, None, 1e-4, same, ref_attempts).first == 160


def test_a_resume_that_differs_from_its_replay_or_the_reference_is_found():
    losses, reference, attempts, ref_attempts = _drifting_run(replay_error=1e-3)
    d = first_difference(losses, reference, None, 1e-4, attempts, ref_attempts)
    assert d.first == 151 and "resumed from step 150" in d.against
    line = _judge(diff=d, data_pure=(True, ""), first_restart_step=60).reasons[0]
    assert line.startswith("resume differs from the group before it") and "Spotline's" in line
    losses, reference, attempts, ref_attempts = _drifting_run(restore_error=1e-2)
    d = first_difference(losses, reference, None, 1e-4, attempts, ref_attempts)
    assert d.first == 61 and d.against == "the uninterrupted run"
    # A resume that no group trained past, off by 1% where the drift was 4e-4.
    losses, reference, attempts, ref_attempts = _drifting_run(last_error=1e-2)
    d = first_difference(losses, reference, None, 1e-4, attempts, ref_attempts)
    assert d.first == 253 and d.against == "the uninterrupted run"


def _applied(kind, attempt, committed, hit=True):
    return Applied(at=10.0, t=100.0, kind=kind, node=1, node_id="n1", step=30,
                   committed=committed, attempt=attempt, hit=hit)  # fmt: skip


def test_a_restore_behind_a_commit_is_a_lost_commit():
    attempts = [{"restored_from": None}, {"restored_from": 20}]
    assert lost_commits(attempts, [_applied("loss", 0, 20)]) == []
    (line,) = lost_commits(attempts, [_applied("loss", 0, 25)])
    assert "resumed from step 20, behind step 25" in line


def _judge(**over):
    from spotline.chaos.verdict import Difference

    args = dict(
        state="stopped",
        error=None,
        diff=Difference(40, 40, None, 0.0),
        first_restart_step=20,
        data_pure=None,
        lost=[],
        reports=[],
        unreplayed=0,
        goodput=0.9,
        min_goodput=None,
        tolerance=1e-4,
    )
    return judge(**{**args, **over})


def test_the_verdict_says_why_and_blames_the_job_for_its_own_data():
    from spotline.chaos.verdict import Difference

    ok = _judge()
    assert ok.verdict == "PASS" and ok.exact_resume and "exact resume" in ok.reasons[0]
    differs = Difference(40, 21, 21, 0.1, 2.0, 2.2)
    impure = _judge(diff=differs, data_pure=(False, "data.kind 'x:Y' gave other tokens"))
    assert impure.verdict == "FAIL" and impure.not_exactly_resumable
    assert impure.first_differing_step == 21
    assert "not exactly resumable: step 21" in impure.reasons[0]
    assert "not a pure function of the step" in impure.reasons[0]
    early = _judge(diff=Difference(40, 9, 10, 0.1, 2.0, 2.2), data_pure=(True, ""))
    assert early.not_exactly_resumable and "before any interruption" in early.why_different
    ours = _judge(diff=differs, data_pure=(True, "same"))
    assert not ours.not_exactly_resumable and "Spotline's failure" in ours.reasons[0]
    assert "below --min-goodput" in _judge(min_goodput=0.95).reasons[0]
    assert "train.steps" in _judge(unreplayed=2).reasons[0]
    failed = _judge(state="failed", error="boom")
    assert failed.verdict == "FAIL" and "the job failed: boom" in failed.reasons


def test_a_trace_whose_faults_reach_no_rank_of_the_job_rehearsed_nothing():
    from spotline.chaos.verdict import EventReport

    missed = EventReport(at=8.1, kind="loss", node=1, node_id="n1", hit=False, step=90)
    joined = EventReport(at=12.0, kind="join", node=2, node_id="n2", hit=False, step=120)
    v = _judge(reports=[missed, joined])
    assert v.verdict == "FAIL"
    (line,) = [r for r in v.reasons if "no fault of the trace" in r]
    assert "the loss at 8.1s (node 1) found none of its ranks" in line
    hit = EventReport(at=8.1, kind="loss", node=0, node_id="n0", hit=True, step=90)
    assert _judge(reports=[missed, hit]).verdict == "PASS"


def test_a_checkpoint_interval_far_above_the_loss_spacing_is_named_with_what_costs_less():
    from spotline.chaos.verdict import EventReport
    from spotline.config import load_spec

    spec = load_spec(
        QUICKSTART,
        {
            "checkpoint.interval_steps": 5000,
            "recovery.peer_snapshots": False,
            "recovery.peer_cost_budget": 0.03,
        },
    )
    loss = EventReport(at=30.0, kind="loss", node=0, node_id="n0", hit=True, step=90)
    loss.steps_lost = 90
    (line,) = settings_costs(spec, [loss], steps_per_s=3.0, peer=None, waited_s=0.0)
    assert "checkpoint.interval_steps 5000 loses up to 5000 steps" in line
    assert "90 step(s) were lost" in line
    assert "recovery.peer_snapshots: true would lose at most k steps" in line
    assert "recovery.peer_cost_budget, 3% of training" in line  # the job's own budget
    assert "checkpoint.interval_steps 9 " in line  # a tenth of the ~90 steps between losses


# --- the fit check and the command line ------------------------------------------------------


def test_a_spec_too_big_for_the_machine_is_refused_with_the_flags_that_fit(tmp_path):
    from spotline.chaos.adapt import adapt, check_fits, set_flags
    from spotline.config import SpecError, load_spec

    big = load_spec(QUICKSTART, {"model.d_model": 2048, "model.n_layers": 24})

    def adapted(scale):
        return adapt(big, name="q", checkpoint_uri=f"file://{tmp_path}/c",
                     staging_dir=str(tmp_path), scale_model=scale)  # fmt: skip

    shrunk = adapted(True)
    with pytest.raises(SpecError) as ei:
        check_fits(adapted(False), 60.0, 8 * 2**30, shrunk, set_flags(shrunk.scaled))
    msg = str(ei.value)
    assert "too big for this machine" in msg and "rerun with --scale-model" in msg
    assert "--set model.d_model=128" in msg and "--set model.n_layers=4" in msg
    assert check_fits(shrunk, 60.0, 8 * 2**30, None, "").ranks == 4


def test_the_rehearsal_says_what_it_changed(tmp_path):
    from spotline.chaos.adapt import adapt
    from spotline.config import load_spec

    spec = load_spec(QUICKSTART, {"preemption.sources": [{"kind": "aws"}]})
    a = adapt(spec, name="q-chaos", checkpoint_uri=f"file://{tmp_path}/c",
              staging_dir=str(tmp_path))  # fmt: skip
    assert a.spec.resources.device == "cpu"
    assert [s.resources for s in a.spec.resources.stages] == [{"spot_gpu": 1}] * 2
    assert [s.kind for s in a.spec.preemption.sources] == ["ray-drain"]
    text = "\n".join(a.changes)
    assert "preemption.sources" in text and "aws read them" in text
    assert "checkpoint.uri" in text and a.spec.model == spec.model  # the model is the user's
    assert load_spec(QUICKSTART).preemption.sources == []
    kept = adapt(load_spec(QUICKSTART), name="q", checkpoint_uri="file:///x", staging_dir="/x")
    assert kept.spec.preemption.sources == []  # no notice source stays none


def test_chaos_refuses_bad_input_in_one_line_before_starting_anything(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"events": [{"at": 5, "kind": "loss", "node": 7}]}))
    out = tmp_path / "out"
    assert main(["chaos", QUICKSTART, "--trace", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "events[0]" in err and "node 7" in err
    assert main(["chaos", QUICKSTART, "--trace", "gentle", "--duration", "20",
                 "--set", "model.d_model=4096", "--out", str(out)]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "too big for this machine" in err and "--scale-model" in err
    out.mkdir()
    (out / "verdict.md").write_text("an earlier report")
    assert main(["chaos", QUICKSTART, "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_the_first_resume_skips_a_group_that_never_started():
    from spotline.chaos.run import first_resume

    failed_start = {"losses": [], "restored_from": None}
    trained = {"losses": [[1, 3.0], [2, 2.9]], "restored_from": None}
    assert first_resume([failed_start, trained]) is None
    assert first_resume([failed_start, trained, {"losses": [], "restored_from": 2}]) == 2
    assert first_resume([trained, {"losses": [], "restored_from": None}]) == 0


def test_the_verdict_names_its_two_goodputs_and_the_rehearsals_node_death_timing():
    from spotline.chaos.report import render_verdict

    loss = {"at": 12.0, "kind": "loss", "node": 1, "hit": True, "steps_lost": 4}
    loss["training_again_s"] = 5.5
    f = {
        "verdict": "PASS",
        "job": "quickstart",
        "trace": {"name": "gentle", "about": "one loss", "duration_s": 40},
        "nodes": 3,
        "reasons": ["every check passed"],
        "exact_resume": True,
        "compared_steps": 100,
        "identical_steps": 100,
        "goodput": 0.93,
        "committed_steps": 90,
        "chaos": {"to_last_commit_s": 30.0, "state": "finished", "steps": 100, "first_step_s": 8},
        "reference": {"to_last_commit_s": 28.0},
        "steps_lost": 4,
        "events": [loss],
        "settings": [],
        "changes": [],
        "footprint": "small",
    }
    text = render_verdict(f)
    assert "**committed-step goodput**: 93.0%" in text
    assert "`device_time.png` is where the job's device time went" in text
    assert "3 failed health checks 1s apart, where Ray's default is 5 checks 3s apart" in text
    # No loss in the trace: nothing to say about how soon a loss is seen.
    f["events"] = [{**loss, "kind": "notice", "hit": True, "committed_step": 10}]
    f["events"][0].update(notice_to_commit_s=1.0, deadline_s=30)
    assert "health checks" not in render_verdict(f)
