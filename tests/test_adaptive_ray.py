"""The adaptive global batch end to end on a local Ray cluster (2 stages x 2 replicas,
real DeepSpeed pipelines over gloo): the batch grows at checkpoint boundaries, every
manifest records the schedule, status and the report show it, and a SIGKILL resume
gives the uninterrupted run's per-step losses bit for bit."""

from __future__ import annotations

import math
import shutil

import pytest

import spotline
from conftest import assert_resumed_exactly, run_killing_a_rank, tiny_spec
from spotline.checkpoint import SUMMARY_ARTIFACT, CheckpointStore
from spotline.report import load_json, status_rows, write_report

pytestmark = pytest.mark.ray

# The quickstart's tiny shape, at one sequence of 8 tokens per micro-batch: a batch of 2
# (one micro-batch per replica) starts below the noise scale this model reaches by step
# 10 (about 4 sequences), so the first boundary grows it.
ADAPTIVE = {
    "model.seq_len": 8,
    "train.global_batch_size": 4,
    "train.batch_schedule": "adaptive",
    "train.adaptive.min_batch_size": 2,
    "train.adaptive.max_batch_size": 16,
}


@pytest.fixture(scope="module")
def adaptive_run(ray_session, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adaptive")
    spec = tiny_spec(tmp, "adaptive", **ADAPTIVE)
    result = spotline.Job(spec).run(verbose=False)
    return spec, result


def test_batch_grows_at_checkpoint_boundaries_and_is_recorded(adaptive_run, tmp_path):
    spec, result = adaptive_run
    assert result.state == "finished" and sorted(result.losses) == list(range(1, 31))
    store = CheckpointStore(result.checkpoint_uri)
    assert store.committed_steps() == [10, 20, 30]
    rec = store.load_manifest(30).extra["batch"]
    history = rec["history"]
    assert rec["schedule"] == "adaptive" and history[0] == [1, 2]
    # It grew, only right after a boundary (every 10 steps), in whole micro-batches at
    # 2 replicas, within the bounds, never shrinking, at most doubling.
    assert len(history) > 1, rec
    sizes = [b for _, b in history]
    assert sizes == sorted(sizes) and sizes[-1] <= 16
    for (_, prev), (first, size) in zip(history, history[1:], strict=False):
        assert (first - 1) % 10 == 0 and size % 2 == 0 and size <= 2 * prev
    # The decision at each boundary is the rule applied to the recorded estimate.
    for step, est in rec["estimates"]:
        before = next(b for f, b in reversed(history) if f <= step)
        after = next(b for f, b in reversed(history) if f <= step + 1)
        assert after == min(16, 2 * before, max(before, 2 * math.ceil(est / 2))), (step, est)
    assert rec["global_batch_size"] == sizes[-1]
    assert rec["lr_scale"] == pytest.approx(math.sqrt(sizes[-1] / 2))
    assert rec["micro_batches_per_step"] == sizes[-1] // 2
    # Each manifest holds the schedule as it stood at its step.
    m10 = store.load_manifest(10).extra["batch"]
    assert m10["history"] == [h for h in history if h[0] <= 11]
    # Status and the summary show the batch in force and the noise scale.
    summary = load_json(store.read_artifact(SUMMARY_ARTIFACT))
    b = summary["batch"]
    assert b["schedule"] == "adaptive" and b["global_batch_size"] == sizes[-1]
    assert b["noise_scale"] is not None and b["noise_scale"] > 0
    assert result.batch == b or result.batch["history"] == b["history"]
    assert summary["history"][-1]["global_batch_size"] == sizes[-1]
    row = dict(status_rows(summary))["global batch"]
    assert row.startswith(f"{sizes[-1]} sequences (adaptive)"), row
    paths = write_report(summary, None, tmp_path)
    assert all(p.stat().st_size > 0 for p in paths)


def test_sigkill_resume_gives_identical_losses(adaptive_run, tmp_path):
    ref_spec, ref = adaptive_run
    spec = tiny_spec(tmp_path, "adaptive-kill", **ADAPTIVE)
    result = run_killing_a_rank(spec, after_commit=10, rank=3)
    assert_resumed_exactly(result, ref, after_commit=10)
    want = CheckpointStore(ref.checkpoint_uri).load_manifest(30).extra["batch"]
    got = CheckpointStore(result.checkpoint_uri).load_manifest(30).extra["batch"]
    assert got["history"] == want["history"] and got["noise"] == want["noise"]


def test_resume_on_fewer_replicas_keeps_the_batch_in_force(adaptive_run, tmp_path, capsys):
    ref_spec, ref = adaptive_run
    shutil.copytree(ref.checkpoint_uri.removeprefix("file://"), tmp_path / "ckpt")
    want = CheckpointStore(ref.checkpoint_uri).load_manifest(30).extra["batch"]
    over = {**ADAPTIVE, "elastic.min_replicas": 1, "elastic.max_replicas": 1, "train.steps": 34}
    spec = tiny_spec(tmp_path, "adaptive", **over)  # the job that owns these checkpoints
    result = spotline.Job(spec).run(verbose=True)
    assert "resharded from 2 stage(s) x 2 replica(s) to 2 x 1" in capsys.readouterr().out
    (attempt,) = result.attempts
    assert attempt["restored_from"] == 30 and sorted(result.losses) == list(range(31, 35))
    m = CheckpointStore(result.checkpoint_uri).load_manifest(34)
    got = m.extra["batch"]
    # The same global batch and history, as whole micro-batches on the one replica left.
    assert got["history"] == want["history"]
    assert got["global_batch_size"] == want["global_batch_size"]
    assert m.topology["replicas"] == 1
    assert got["micro_batches_per_step"] == want["global_batch_size"] // spec.micro_batch_size()
