"""Backfill on a real pipeline job: bubbles measured, tasks run in them, training untouched.

One job with backfill on (an eval task and a speculative task from the spec, plus
three tasks from the SDK: one that raises, one whose process dies, one eval) runs
the reference job's exact spec. Its per-step losses must equal the backfill-off
reference run's, bit for bit.
"""

from __future__ import annotations

import json
import math
import os

import pytest

import spotline
from conftest import tiny_spec
from spotline.checkpoint import CheckpointStore

pytestmark = pytest.mark.ray


def raising_task(ctx):
    yield "crash-test"
    yield "crash-test"
    raise ValueError("backfill task blew up on purpose")


def dying_task(ctx):
    yield "crash-test"
    os._exit(3)  # the executor process dies, as on an out-of-memory kill


def _backfill(**extra):
    return {
        "enabled": True,
        "baseline_steps": 4,
        "rebaseline_every_steps": 20,
        "finish_timeout_s": 240,
        "tasks": [
            {"kind": "eval", "every_steps": 10},
            {
                "kind": "speculative",
                "prompts": ["def main(", "import sys\n"],
                "max_new_tokens": 8,
                "gamma": 3,
                "every_steps": 30,
                "draft": {"n_layers": 1, "d_model": 16, "train_steps": 5},
            },
        ],
        **extra,
    }


@pytest.fixture(scope="module")
def backfilled(reference_run, tmp_path_factory):
    ref_spec, ref, _ = reference_run
    tmp = tmp_path_factory.mktemp("backfill")
    # Checkpoints every 5 steps (the reference: 10), so tasks start early in the job;
    # where checkpoints go is not part of the training math.
    spec = tiny_spec(tmp, "backfilled", backfill=_backfill(), **{"checkpoint.interval_steps": 5})
    assert spec.spec_hash() == ref_spec.spec_hash()  # backfill is not part of the math
    run = spotline.Job(spec).start()
    handles = {
        "raise": run.backfill.submit(raising_task, retries=1),
        "die": run.backfill.submit(dying_task),
        "eval": run.backfill.submit({"kind": "eval", "batches": 2}),
    }
    sdk_eval = handles["eval"].result(timeout_s=300)
    trace = run.trace()
    result = run.wait(verbose=False)
    return spec, result, ref, sdk_eval, trace


def test_training_losses_are_unchanged_by_backfill_and_its_crashes(backfilled):
    _, result, ref, _, _ = backfilled
    assert result.state == "finished"
    assert result.losses == ref.losses  # exactly: backfill never touches training
    assert result.heldout_loss == ref.heldout_loss
    tasks = {t["name"]: t for t in result.backfill["tasks"]}
    assert tasks["raising_task"]["state"] == "failed"
    assert tasks["raising_task"]["attempts"] == 2  # retried once
    assert all("blew up on purpose" in e for e in tasks["raising_task"]["errors"])
    assert tasks["dying_task"]["state"] == "failed"
    assert "executor process died" in tasks["dying_task"]["error"]


def test_eval_task_equals_the_jobs_own_heldout_loss(backfilled):
    spec, result, _, sdk_eval, _ = backfilled
    evals = {
        t["result"]["step"]: t["result"]
        for t in result.backfill["tasks"]
        if t["name"] == "eval[0]" and t["state"] == "done"
    }
    # Every 10 steps at most (a task still queued moves to the newest commit, so the
    # first may run later than step 5), and always on the final checkpoint.
    steps = sorted(evals)
    assert steps[0] % 5 == 0 and steps[0] < 30 and steps[-1] == 30
    assert all(b - a >= 10 for a, b in zip(steps[:-2], steps[1:-1], strict=True))
    final = evals[spec.train.steps]
    # Same weights (the final checkpoint), same batches, evaluated by the pipeline
    # engine at the end of training vs. by the executor's whole-model snapshot.
    assert final["loss"] == pytest.approx(result.heldout_loss, rel=1e-5)
    assert final["perplexity"] == pytest.approx(math.exp(final["loss"]))
    assert evals[steps[0]]["loss"] > final["loss"]  # later weights are better
    assert sdk_eval["kind"] == "eval" and sdk_eval["batches"] == 2


def test_speculative_task_matches_greedy_and_stores_completions(backfilled):
    spec, result, _, _, _ = backfilled
    runs = [
        t["result"]
        for t in result.backfill["tasks"]
        if t["name"] == "speculative[1]" and t["state"] == "done"
    ]
    # Due at the first commit (5) and, whatever its every_steps, on the final one (30);
    # nothing else was due. Still queued at 30, the first moves there: it runs once.
    steps = sorted(r["step"] for r in runs)
    assert steps in ([5, 30], [30]), steps
    for r in runs:
        assert r["all_equal_target_greedy"]
        assert r["new_tokens"] == 2 * 8
        assert 0 <= r["acceptance_rate"] <= 1
        assert r["verifications"] >= math.ceil(8 / (3 + 1)) * 2
        assert r["tokens_per_s"] > 0 and r["target_only_tokens_per_s"] > 0
    store = CheckpointStore(result.checkpoint_uri)
    lines = store.read_artifact("backfill/speculative_step00000030.jsonl").decode().splitlines()
    rows = [json.loads(x) for x in lines]
    assert [r["prompt"] for r in rows] == ["def main(", "import sys\n"]
    assert all(len(r["tokens"]) == 8 and r["equals_target_greedy"] for r in rows)


def test_bubbles_are_measured_per_stage_and_partly_filled(backfilled):
    spec, result, _, _, trace = backfilled
    b = result.bubbles
    assert b["theory"] == pytest.approx(1 / 3)  # p=2, m=2
    for stage in (0, 1):
        assert 0 < b["per_stage"][stage]["bubble_fraction"] < 1
    assert b["filled_s"] > 0 and 0 < b["fill_fraction"] <= 1
    for stage in b["per_stage"].values():
        # Measured from the kernel: one working thread is never busy longer than its
        # windows were open, and busy time outside windows is reported, not dropped.
        assert stage["filled_s"] <= stage["open_s"] + 1e-3
        assert stage["overrun_s"] >= 0 and stage["overrun_fraction"] < 1
    assert result.backfill["baseline_step_s"] > 0
    # The live trace and the one stored with the checkpoints: a track per stage and
    # replica, each with compute and idle time.
    stored = json.loads(CheckpointStore(result.checkpoint_uri).read_artifact("trace.json"))
    from spotline.bubbles.trace import summarize

    for t in (trace, stored):
        tracks = summarize(t)
        for s in (0, 1):
            for r in (0, 1):
                track = tracks[f"stage-{s}/replica-{r}"]
                assert track["compute"] > 0 and track["idle"] > 0
    # Every recorded step runs the instructions, in order, of the simulated step each
    # stage's forecast starts from.
    from spotline.bubbles import StepRecorder

    tid = {
        e["args"]["name"]: e["tid"]
        for e in trace["traceEvents"]
        if e.get("ph") == "M" and e["name"] == "thread_name"
    }
    for s in (0, 1):
        seed = StepRecorder(s, 2, 2, micro_s=[1.0, 1.0]).seed_timeline()
        steps: dict[int, list[str]] = {}
        for e in trace["traceEvents"]:
            if e.get("ph") == "X" and e["tid"] == tid[f"stage-{s}/replica-0"]:
                steps.setdefault(e["args"]["step"], []).append(e["name"])
        assert steps and all(names == [i.name for i in seed] for names in steps.values())


def test_trace_cli_writes_the_stored_trace(backfilled, tmp_path):
    from spotline.cli import main

    _, result, _, _, _ = backfilled
    out = tmp_path / "t.json"
    assert main(["trace", result.checkpoint_uri, "--out", str(out)]) == 0
    assert json.loads(out.read_text())["traceEvents"]


def test_backfill_off_job_refuses_sdk_tasks(reference_run, tmp_path):
    spec = tiny_spec(tmp_path, "nobackfill", **{"train.steps": 2})
    run = spotline.Job(spec).start()
    with pytest.raises(Exception, match="backfill is off"):
        run.backfill.submit({"kind": "eval"})
    run.wait(verbose=False)
