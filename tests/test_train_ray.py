"""End-to-end training on a local Ray cluster with real DeepSpeed engines (gloo, CPU).

One uninterrupted reference run is shared (conftest's `reference_run`): the loss
test reads it, and the SIGKILL, corrupt-checkpoint and damaged-final-manifest tests
compare their per-step losses to it.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest

import spotline
from conftest import assert_resumed_exactly, run_killing_a_rank, tiny_spec
from spotline.checkpoint import SUMMARY_ARTIFACT, CheckpointStore, hash_file

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def reference(reference_run):
    return reference_run


def test_quickstart_shape_trains_and_commits(reference):
    spec, result, tmp = reference
    assert result.state == "finished"
    assert result.steps == 30
    assert sorted(result.losses) == list(range(1, 31))
    first, last = result.losses[1], result.losses[30]
    assert first == pytest.approx(math.log(256), abs=0.3)  # untrained byte model
    assert last < first - 1.0, result.losses
    assert result.heldout_loss is not None and result.heldout_loss < first - 0.5
    store = CheckpointStore(result.checkpoint_uri)
    assert store.committed_steps() == [10, 20, 30]
    m = store.load_manifest(30)
    assert m.topology["pipeline_stages"] == 2 and m.topology["replicas"] == 2
    assert m.data_position == {"next_step": 30, "seed": spec.data.seed}
    # Each rank wrote its own share (safetensors) and meta (JSON), under its group's
    # attempt, and nothing else: no pickled DeepSpeed files.
    names = [f.path for f in m.files]
    attempt = m.extra["attempt"]
    assert sorted(names) == sorted(
        f"a-{attempt}/rank_{r:05d}/{f}"
        for r in range(4)
        for f in ("meta.json", "state.safetensors")
    )
    # About 1x the state: fp32 master + 2 moments of every parameter once (the module
    # weights are fp32 here, the master itself, and not written twice); the metas hold
    # RNG state and the index.
    from spotline.planning.checkpoint_time import checkpoint_bytes

    tensors = sum(f.size for f in m.files if f.path.endswith(".safetensors"))
    assert 1.0 <= tensors / checkpoint_bytes(spec) < 1.1
    assert all(b < 30 for b in result.checkpoint_blocked_s)


def test_sigkill_mid_step_resumes_with_identical_losses(reference, tmp_path):
    ref_spec, ref, _ = reference
    spec = tiny_spec(tmp_path, "sigkill")
    assert spec.spec_hash() == ref_spec.spec_hash()
    result = run_killing_a_rank(spec, after_commit=10, rank=3)
    assert_resumed_exactly(result, ref, after_commit=10)
    # Its node lives on, and with it the keeper holding every rank's newest copy: the
    # next group restored from that memory (bit-exact, as above), at a k measured from
    # the cost of a copy.
    assert result.attempts[1]["restored_via"] == "peer memory"
    peer = result.peer_memory
    assert peer["chosen"] == "measured" and peer["every_steps"] >= 1 and peer["cost_s"] > 0
    assert peer["restores"][0]["step"] == result.attempts[1]["restored_from"]


def _copy_unfinished(ref_tmp, tmp_path) -> None:
    """The reference job's checkpoints as if it died after committing its last step and
    before recording its end (no stored summary): a rerun restores that step rather
    than reporting a finished job."""
    shutil.copytree(ref_tmp / "ckpt", tmp_path / "ckpt")
    (tmp_path / "ckpt" / "artifacts" / SUMMARY_ARTIFACT).unlink()


def test_corrupt_latest_checkpoint_falls_back_to_previous(reference, tmp_path, capsys):
    ref_spec, ref, ref_tmp = reference
    uri = f"file://{tmp_path}/ckpt"
    _copy_unfinished(ref_tmp, tmp_path)
    store = CheckpointStore(uri)
    victim = next(f for f in store.load_manifest(30).files if f.path.endswith(".safetensors"))
    assert "rank_00000" in victim.path  # a rank every new rank reads from
    path = tmp_path / "ckpt" / "step_00000030" / victim.path
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))

    # Same spec (train.steps sets the LR schedule), so retrained steps must match exactly.
    spec = tiny_spec(tmp_path, "reference")  # the job that owns these checkpoints
    result = spotline.Job(spec).run(verbose=True)
    out = capsys.readouterr().out
    assert "checkpoint step 30" in out and "failed verification" in out
    assert "falling back to step 20" in out
    assert "quarantined checkpoint step 30" in out
    (attempt,) = result.attempts
    assert attempt["restored_from"] == 20
    # Step 30 was saved again beside the quarantined files, which stay for inspection.
    record = json.loads((tmp_path / "ckpt" / "step_00000030" / "quarantine.json").read_text())
    assert record["file"] == victim.path and path.exists()
    bad_attempt = json.loads(record["manifest"])["extra"]["attempt"]
    assert store.load_manifest(30).extra["attempt"] != bad_attempt
    # Steps 21..30 were retrained from step 20 and match the reference exactly.
    assert [s for s, _ in attempt["losses"]] == list(range(21, 31))
    for step, loss in attempt["losses"]:
        assert loss == ref.losses[step]
    assert result.steps == 30


def test_a_finished_job_with_a_truncated_final_manifest_trains_it_again(
    reference, tmp_path, capsys
):
    ref_spec, ref, ref_tmp = reference
    shutil.copytree(ref_tmp / "ckpt", tmp_path / "ckpt")  # finished, with its summary
    final = tmp_path / "ckpt" / "step_00000030" / "manifest.json"
    final.write_bytes(final.read_bytes()[: final.stat().st_size // 2])

    spec = tiny_spec(tmp_path, "reference")  # the job that owns these checkpoints
    result = spotline.Job(spec).run(verbose=True)
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "already finished at step 30" in line]
    assert said, out
    for line in said:
        assert "manifest.json" in line and "not valid JSON" in line, line
        assert "again from step 20" in line and "quarantined" in line, line
    assert "reporting it from its stored summary" not in out
    # It fell back to step 20 and trained steps 21..30 again, as the reference did.
    assert result.state == "finished" and result.steps == 30
    (attempt,) = result.attempts
    assert attempt["restored_from"] == 20
    assert [s for s, _ in attempt["losses"]] == list(range(21, 31))
    for step, loss in attempt["losses"]:
        assert loss == ref.losses[step]
    # Step 30 is committed again, beside the damaged manifest's record.
    store = CheckpointStore(result.checkpoint_uri)
    assert store.committed_steps() == [10, 20, 30]
    record = json.loads((tmp_path / "ckpt" / "step_00000030" / "quarantine.json").read_text())
    assert record["file"] == "manifest.json" and "not valid JSON" in record["reason"]
    summary = json.loads(store.read_artifact(SUMMARY_ARTIFACT))
    assert summary["state"] == "finished" and summary["committed_steps"][-1] == 30


def test_resume_on_fewer_replicas_reshards(reference, tmp_path, capsys):
    ref_spec, ref, ref_tmp = reference
    shutil.copytree(ref_tmp / "ckpt", tmp_path / "ckpt")
    over = {"elastic.min_replicas": 1, "elastic.max_replicas": 1, "train.steps": 36}
    spec = tiny_spec(tmp_path, "reference", **over)  # the job that owns these checkpoints
    result = spotline.Job(spec).run(verbose=True)
    assert "resharded from 2 stage(s) x 2 replica(s) to 2 x 1" in capsys.readouterr().out
    (attempt,) = result.attempts
    assert attempt["restored_from"] == 30 and attempt["replicas"] == 1
    assert sorted(result.losses) == list(range(31, 37))
    # The trained weights came back: far below an untrained model's ~ln(256).
    assert result.losses[31] < ref.losses[1] - 1.0
    m = CheckpointStore(result.checkpoint_uri).load_manifest(36)
    assert m.topology["replicas"] == 1 and m.topology["micro_batch_size"] == 4


def test_max_failures_exhausted_is_a_clear_failure(ray_session, tmp_path):
    spec = tiny_spec(tmp_path, "nofail", **{"failure.max_failures": 0, "train.steps": 400})
    with pytest.raises(spotline.JobFailed) as info:
        run_killing_a_rank(spec, after_commit=10, rank=1)
    msg = str(info.value)
    assert "failure.max_failures=0" in msg
    assert "worker process died" in msg
    assert info.value.result.state == "failed"


@pytest.mark.parametrize(
    ("zero", "precision"),
    [(2, "fp32"), (3, "bf16")],
)
def test_pp1_zero_stages_train_save_and_resume(ray_session, tmp_path, zero, precision):
    over = {
        "parallel.pipeline_stages": 1,
        "parallel.zero_stage": zero,
        "parallel.precision": precision,
        "train.steps": 6,
        "checkpoint.interval_steps": 3,
    }
    spec = tiny_spec(tmp_path, f"zero{zero}", **over)
    first = spotline.Job(spec).run(verbose=False)
    assert first.committed_steps == [3, 6]
    assert first.losses[6] < first.losses[1]
    longer = spotline.Job(spec).with_overrides({"train.steps": 9})
    second = longer.run(verbose=False)
    assert second.attempts[0]["restored_from"] == 6
    assert sorted(second.losses) == [7, 8, 9]
    assert all(math.isfinite(v) for v in second.losses.values())


def test_s3_checkpoints_commit_and_resume(ray_session, s3_bucket, tmp_path):
    # Also the bf16 pipeline (BF16 optimizer with ZeRO-1) save/load path.
    over = {
        "parallel.precision": "bf16",
        "checkpoint.uri": s3_bucket.uri("jobs/s3"),
        "checkpoint.endpoint_url": s3_bucket.endpoint_url,
        # Workers are long-lived processes of the shared cluster: hand them the keys.
        "checkpoint.storage_options": {"key": "testing", "secret": "testing"},
        "elastic.min_replicas": 1,
        "elastic.max_replicas": 1,
        "train.steps": 4,
        "checkpoint.interval_steps": 2,
    }
    spec = tiny_spec(tmp_path, "s3job", **over)
    result = spotline.Job(spec).run(verbose=False)
    assert result.committed_steps == [2, 4]
    keys = [
        o["Key"]
        for o in s3_bucket.client.list_objects_v2(Bucket=s3_bucket.name, Prefix="jobs/s3/")[
            "Contents"
        ]
    ]
    assert "jobs/s3/step_00000004/manifest.json" in keys
    resumed = spotline.Job(spec).with_overrides({"train.steps": 6}).run(verbose=False)
    assert resumed.attempts[0]["restored_from"] == 4
    assert sorted(resumed.losses) == [5, 6]


def test_bad_uri_fails_before_any_worker_starts(ray_session, tmp_path):
    import ray

    spec = tiny_spec(tmp_path, "baduri", **{"checkpoint.uri": "file://nowhere/x"})
    before = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    with pytest.raises(spotline.checkpoint.StorageError, match="checkpoint.uri"):
        spotline.Job(spec).run(verbose=False)
    after = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    assert not any("baduri" in n for n in after - before)


def test_a_pickle_in_the_checkpoint_runs_no_code_and_falls_back(reference, tmp_path, capsys):
    """The attack: a pickle put in the store in place of a stage file, with its sha256 and
    size updated in the manifest. The resume must fail to parse it (safetensors holds no
    code), say so, fall back to the previous commit, and never run the payload."""
    import pickle

    ref_spec, ref, ref_tmp = reference
    _copy_unfinished(ref_tmp, tmp_path)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    step_dir = tmp_path / "ckpt" / "step_00000030"
    manifest_path = step_dir / "manifest.json"
    raw = json.loads(manifest_path.read_text())
    victim = next(f for f in raw["files"] if f["path"].endswith("rank_00000/state.safetensors"))
    bomb = step_dir / victim["path"]
    bomb.write_bytes(pickle.dumps({"params": Payload()}))
    victim["size"] = bomb.stat().st_size
    victim["sha256"] = hash_file(bomb)
    manifest_path.write_text(json.dumps(raw))

    spec = tiny_spec(tmp_path, "reference")  # the job that owns these checkpoints
    result = spotline.Job(spec).run(verbose=True)
    out = capsys.readouterr().out
    assert not marker.exists(), "the checkpoint ran code"
    # The bytes do not match the tensors the index records: refused before any is used
    # (and nothing in a checkpoint is ever unpickled, whatever its hashes say).
    assert "checkpoint step 30" in out and "failed verification" in out
    assert "falling back to step 20" in out
    (attempt,) = result.attempts
    assert attempt["restored_from"] == 20
    for step, loss in attempt["losses"]:
        assert loss == ref.losses[step]


def test_the_plan_is_close_to_what_the_quickstart_measures(ray_session, tmp_path):
    """The quickstart itself (2 stages x 2 replicas): the summary puts the plan beside
    the run, and the plan's memory per stage and bubble hold against the measurement."""
    from pathlib import Path

    config = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    job = spotline.Job.from_yaml(
        config,
        {
            "train.steps": 16,
            "checkpoint.uri": f"file://{tmp_path}/ckpt",
            "checkpoint.staging_dir": str(tmp_path / "staging"),
        },
    )
    result = job.run(verbose=False)
    assert result.state == "finished"
    plan = result.plan
    assert plan["replicas"] == 2
    predicted, measured = plan["predicted"], plan["measured"]
    assert sorted(measured["memory_bytes"]) == [0, 1]  # every stage measured itself
    for stage, planned in predicted["memory_bytes"].items():
        assert planned == pytest.approx(measured["memory_bytes"][stage], rel=0.20), stage
    # Within 10 points of the step: (p-1)/(m+p-1) is 20% here.
    assert measured["bubble_fraction"] > 0
    assert abs(predicted["bubble_fraction"] - measured["bubble_fraction"]) <= 0.10
    assert predicted["step_s"] > 0 and measured["step_s"] > 0
    # One prediction: the run reports the step `spotline plan` predicts on this host,
    # timed before its ranks started.
    assert predicted["step_s"] == pytest.approx(job.plan().step.step_s, rel=1e-9)
    assert predicted["step_basis"].startswith("this host's measured passes")
    text = result.summary()
    assert "plan vs run" in text and "stage 1 memory" in text
