"""Hostile but fair input: no code runs from a checkpoint, no secret leaves the spec, and
every bad input gets one clear line before anything starts.

No Ray here: each case must fail in the driver, before any worker would start (the
tests assert that Ray was never initialised by the failing call).
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from spotline.checkpoint import (
    CheckpointMismatchError,
    CheckpointStore,
    CorruptCheckpointError,
    Manifest,
    StorageError,
    hash_file,
)
from spotline.checkpoint.coordinator import CommitCoordinator
from spotline.checkpoint.layout import CheckpointFormatError, load_tensors, save_tensors
from spotline.cli import main
from spotline.config import SpecError, load_spec, redact
from spotline.config.redact import install_log_redaction, join_secrets, split_secrets
from spotline.controller.policies import Fail, FailurePolicy, Restart, classify
from spotline.preflight import check_offline, preflight
from spotline.train.ds_config import deepspeed_config

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"
KEY_ID = "AKIAIOSFODNN7EXAMPLE"


def _local(tmp_path: Path, **over: Any):
    raw = {
        "name": "hard",
        "model": {"n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 32},
        "data": {"max_bytes": 200_000},
        "train": {"steps": 10, "global_batch_size": 4},
        "parallel": {"micro_batches": 4},
        "checkpoint": {"uri": f"file://{tmp_path}/ckpt", "staging_dir": str(tmp_path / "stage")},
    }
    return load_spec(raw, over)


def _spotline_actors() -> set[str]:
    import ray

    if not ray.is_initialized():
        return set()
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}


@pytest.fixture
def no_worker_starts():
    """The test's failing calls start nothing: no Ray if none ran, no new actor if one did."""
    import ray

    was_up = ray.is_initialized()
    before = _spotline_actors()
    yield
    assert ray.is_initialized() == was_up, "Ray was started"
    assert _spotline_actors() <= before, "an actor was started"


# --- 1. nothing from storage is unpickled -------------------------------------------


class _Payload:
    """Unpickling this runs `touch <marker>`: what a hostile checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _pickle_bomb(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps({"params": _Payload(marker)}))


def test_a_pickled_stage_file_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    bomb = tmp_path / "stage_000.safetensors"
    _pickle_bomb(bomb, marker)
    with pytest.raises(CheckpointFormatError, match="not a valid safetensors file"):
        load_tensors(bomb)
    assert not marker.exists()
    # torch's weights-only loader (used for a draft's .pt file) refuses it too.
    as_pt = tmp_path / "draft.pt"
    as_pt.write_bytes(bomb.read_bytes())
    with pytest.raises(pickle.UnpicklingError):
        torch.load(as_pt, weights_only=True)
    assert not marker.exists()


def test_state_files_round_trip_bit_exact_through_safetensors(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {"0.tok.weight/fp32/0": torch.randn(21, generator=g), "1.b/exp_avg/3": torch.randn(3)}
    meta = {"adam_step": 12.0, "lr_scheduler": {"base_lrs": [0.003], "lr_lambdas": [None]}}
    path = tmp_path / "state.safetensors"
    save_tensors(path, tensors, meta)
    back, back_meta = load_tensors(path)
    assert back_meta == meta
    for k, t in tensors.items():
        assert torch.equal(back[k], t)


def test_every_file_spotline_writes_is_safetensors_or_json() -> None:
    # The code paths: no torch.save/torch.load(weights_only=False)/pickle in the package.
    src = REPO / "platform" / "spotline"
    offenders = []
    for path in src.rglob("*.py"):
        text = path.read_text()
        # (".save_checkpoint(": DeepSpeed's engine method pickles; Tune's hook of the same
        # name, defined by the sweep trial, writes JSON.)
        for needle in ("weights_only=False", "pickle.load", "torch.save(", ".save_checkpoint("):
            if needle in text:
                offenders.append(f"{path.relative_to(src)}: {needle}")
    assert not offenders, offenders


def _committed_step(store: CheckpointStore, tmp_path: Path, step: int, key: bytes | None) -> Path:
    spec = _local(tmp_path)
    data = tmp_path / f"f{step}.bin"
    data.write_bytes(os.urandom(64))
    entry = store.upload_file(data, step, "spotline/rank_00000.json")
    m = Manifest(
        step=step,
        files=[entry],
        topology={"pipeline_stages": 1, "replicas": 1},
        data_position={"next_step": step},
        spec_hash=spec.spec_hash(),
        created_at=1.0,
        extra={"job": "hard", "index": []},
    )
    store.commit(m)
    return Path(store.uri.removeprefix("file://")) / store.step_name(step) / "manifest.json"


def test_signed_manifests_refuse_a_forged_one_before_reading_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPOTLINE_TEST_SIGNING_KEY", "k" * 32)
    store = CheckpointStore(f"file://{tmp_path}/ckpt", signing_key_env="SPOTLINE_TEST_SIGNING_KEY")
    _committed_step(store, tmp_path, 10, None)
    path20 = _committed_step(store, tmp_path, 20, None)
    assert json.loads(path20.read_text())["signature"]
    # Whoever can write the bucket rewrites step 20's manifest (a new file, new sha256).
    forged = json.loads(path20.read_text())
    evil = tmp_path / "evil.bin"
    evil.write_bytes(b"evil")
    forged["files"] = [{"path": "spotline/rank_00000.json", "size": 4, "sha256": hash_file(evil)}]
    path20.write_text(json.dumps(forged))
    with pytest.raises(CorruptCheckpointError, match="signature does not verify"):
        store.load_manifest(20)
    # The restore path falls back past it to the last manifest that verifies.
    log: list[str] = []
    loaded: list[int] = []

    class Group:
        replicas, attempt = 1, "a"

        def restore(self, manifest: Manifest) -> int:
            loaded.append(manifest.step)
            return manifest.step

    coordinator = CommitCoordinator(_local(tmp_path), store, lambda msg, *a: log.append(msg))
    step, manifest = coordinator.restore(Group(), sleep=lambda s: None)
    assert (step, loaded) == (10, [10])
    assert "signature does not verify" in log[0] and "falling back to step 10" in log[0]
    # Without the key the store refuses to run at all, rather than trusting anything.
    monkeypatch.delenv("SPOTLINE_TEST_SIGNING_KEY")
    with pytest.raises(StorageError, match="SPOTLINE_TEST_SIGNING_KEY, which is not set"):
        store.load_manifest(10)


def test_an_unsigned_manifest_is_refused_when_signing_is_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = CheckpointStore(f"file://{tmp_path}/ckpt")
    _committed_step(plain, tmp_path, 10, None)
    monkeypatch.setenv("SPOTLINE_TEST_SIGNING_KEY", "k" * 32)
    signed = CheckpointStore(f"file://{tmp_path}/ckpt", signing_key_env="SPOTLINE_TEST_SIGNING_KEY")
    with pytest.raises(CorruptCheckpointError, match="manifest is not signed"):
        signed.load_manifest(10)


# --- 2. secrets never leave the spec ------------------------------------------------


def _s3_raw(**options: Any) -> dict[str, Any]:
    return {
        "name": "sec",
        "checkpoint": {
            "uri": "s3://bucket/prefix",
            "endpoint_url": "http://127.0.0.1:9",
            "storage_options": {"key": KEY_ID, "secret": SECRET, **options},
        },
    }


def test_redact_masks_secret_keys_storage_options_and_known_values() -> None:
    spec = load_spec(_s3_raw())
    dumped = redact(spec.model_dump())
    assert dumped["checkpoint"]["storage_options"] == {"key": "***", "secret": "***"}
    assert dumped["checkpoint"]["keep_last"] == 3  # not a secret for having 'ke' in it
    assert redact({"auth": {"user": "me", "ttl": 5}, "api_key": "x" * 10, "steps": 3}) == {
        "auth": {"user": "***", "ttl": "***"},
        "api_key": "***",
        "steps": 3,
    }
    # Free text that echoes a value of a spec built in this process.
    assert (
        redact(f"botocore said: bad key {KEY_ID} / {SECRET}") == "botocore said: bad key *** / ***"
    )


def test_refused_storage_options_never_echo_the_secret(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ({"secert": "x"}, {"config_kwargs": "not-a-mapping"}):
        with pytest.raises(StorageError) as ei:
            load_spec(_s3_raw(**bad))
            check_offline(load_spec(_s3_raw(**bad)))
        assert SECRET not in str(ei.value) and KEY_ID not in str(ei.value)
    from spotline.preflight import open_store

    with pytest.raises(StorageError) as ei:
        open_store(load_spec(_s3_raw(secert="x")))
    msg = str(ei.value)
    assert "s3fs takes no option 'secert'; did you mean 'secret'?" in msg
    assert SECRET not in msg
    with pytest.raises(StorageError, match=r"config_kwargs must be a mapping"):
        open_store(load_spec(_s3_raw(config_kwargs="nope")))


def test_log_records_are_redacted(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    load_spec(_s3_raw())
    install_log_redaction()
    with caplog.at_level(logging.INFO):
        logging.getLogger("botocore.test").info("connecting with %s and %s", KEY_ID, SECRET)
    assert SECRET not in caplog.text and KEY_ID not in caplog.text and "***" in caplog.text


def test_secrets_travel_apart_from_the_spec_on_submit() -> None:
    raw = load_spec(_s3_raw()).model_dump(mode="json")
    public, secrets = split_secrets(raw)
    blob = json.dumps(public)
    assert SECRET not in blob and KEY_ID not in blob
    assert join_secrets(json.loads(blob), secrets) == raw


# --- 3. the preflight catches what it can ---------------------------------------------


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def test_another_jobs_checkpoints_are_refused_before_anything_is_written(
    no_worker_starts, tmp_path: Path
) -> None:
    theirs = _local(tmp_path, name="theirs")
    store = CheckpointStore(theirs.resolved_checkpoint_uri())
    step_file = tmp_path / "x.json"
    step_file.write_text("{}")
    entry = store.upload_file(step_file, 10, "spotline/rank_00000.json")
    store.commit(
        Manifest(
            step=10,
            files=[entry],
            topology=theirs.topology(1),
            data_position={"next_step": 10},
            spec_hash=theirs.spec_hash(),
            created_at=1.0,
            extra={"job": "theirs", "spec": theirs.hashed_fields()},
        )
    )
    store.write_artifact("summary.json", json.dumps({"name": "theirs", "state": "done"}).encode())
    before = _snapshot(tmp_path / "ckpt")
    ours = _local(tmp_path, name="ours", **{"model.d_model": 64})
    with pytest.raises(SpecError) as ei:
        preflight(ours)
    msg = str(ei.value)
    assert theirs.resolved_checkpoint_uri().removeprefix("file://") in msg
    assert "belongs to job 'theirs', and this job is 'ours'" in msg
    assert "model.d_model: 32 there, 64 here" in msg
    assert "Nothing was written there" in msg and "checkpoint.uri" in msg
    assert _snapshot(tmp_path / "ckpt") == before
    # The same job name with another spec is refused the same way...
    with pytest.raises(SpecError, match="was written with spec hash"):
        preflight(_local(tmp_path, name="theirs", **{"train.seed": 7}))
    # ...but a retuned optimizer hyperparameter may resume (it is applied from the spec).
    preflight(_local(tmp_path, name="theirs", **{"train.lr": 0.01, "train.warmup_steps": 3}))
    # A job that only left a summary (it failed before its first commit) owns it too.
    only_summary = tmp_path / "other"
    CheckpointStore(f"file://{only_summary}").write_artifact(
        "summary.json", json.dumps({"name": "theirs"}).encode()
    )
    with pytest.raises(SpecError, match="belongs to job 'theirs'"):
        preflight(_local(tmp_path, name="ours", **{"checkpoint.uri": f"file://{only_summary}"}))


def _commit_step(spec, step: int, tmp_path: Path) -> None:
    store = CheckpointStore(spec.resolved_checkpoint_uri())
    f = tmp_path / f"rank{step}.json"
    f.write_text("{}")
    entry = store.upload_file(f, step, "spotline/rank_00000.json")
    store.commit(
        Manifest(
            step=step,
            files=[entry],
            topology=spec.topology(1),
            data_position={"next_step": step},
            spec_hash=spec.spec_hash(),
            created_at=1.0,
            extra={"job": spec.name, "spec": spec.hashed_fields()},
        )
    )


def test_resume_from_is_checked_before_anything_starts(no_worker_starts, tmp_path: Path) -> None:
    donor = _local(tmp_path, name="donor", **{"checkpoint.uri": f"file://{tmp_path}/donor"})
    _commit_step(donor, 10, tmp_path)
    _commit_step(donor, 20, tmp_path)
    src = donor.resolved_checkpoint_uri()

    def ours(**over: Any):
        return _local(tmp_path, name="ours", **{"checkpoint.resume_from.uri": src, **over})

    preflight(ours(**{"train.lr": 1e-4, "train.weight_decay": 0.0}))  # newest step, retuned
    preflight(ours(**{"checkpoint.resume_from.step": 10}))
    with pytest.raises(SpecError) as ei:
        preflight(ours(**{"checkpoint.resume_from.step": 15}))
    assert "checkpoint.resume_from: step 15 is not committed" in str(ei.value)
    assert "[10, 20]" in str(ei.value)
    with pytest.raises(SpecError) as ei:
        preflight(ours(**{"model.d_model": 64}))
    msg = str(ei.value)
    assert msg.startswith("checkpoint.resume_from: step 20") and "model.d_model" in msg
    assert "train.lr" in msg  # says what may change
    with pytest.raises(SpecError, match="holds no committed step"):
        preflight(ours(**{"checkpoint.resume_from.uri": f"file://{tmp_path}/empty"}))


def test_retuned_fields_are_exactly_the_optimizer_hyperparameters(tmp_path: Path) -> None:
    base = _local(tmp_path)
    theirs = base.hashed_fields()
    assert base.retuned_fields(base.spec_hash(), theirs) == []
    lr = _local(tmp_path, **{"train.lr": 1e-4, "train.grad_clip": 0.5})
    assert lr.retuned_fields(base.spec_hash(), theirs) == [
        "train.grad_clip: 1.0 -> 0.5",
        "train.lr: 0.003 -> 0.0001",
    ]
    for field, value in (("train.seed", 1), ("model.d_model", 64), ("data.seed", 9)):
        other = _local(tmp_path, **{field: value})
        assert other.retuned_fields(base.spec_hash(), theirs) is None, field
    assert lr.retuned_fields(base.spec_hash(), None) is None  # no record: the hash decides


def test_the_controller_refuses_too_and_overwrites_no_summary(tmp_path: Path) -> None:
    from spotline.controller import Controller
    from spotline.controller.state import Failed

    theirs = _local(tmp_path, name="theirs")
    store = CheckpointStore(theirs.resolved_checkpoint_uri())
    store.write_artifact("summary.json", b'{"name": "theirs", "state": "finished"}')
    before = _snapshot(tmp_path / "ckpt")
    ours = _local(tmp_path, name="ours")
    ctl = Controller(ours, store, group_factory=None, cluster=None)  # never gets that far
    ctl.cluster = type("C", (), {"close": lambda self: None})()
    ctl.step()
    assert isinstance(ctl.state, Failed) and "belongs to job 'theirs'" in ctl.state.error
    assert _snapshot(tmp_path / "ckpt") == before
    with pytest.raises(CheckpointMismatchError):
        store.check_owner(ours)


def test_unwritable_staging_dir_fails_in_the_preflight(no_worker_starts, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    spec = _local(tmp_path, **{"checkpoint.staging_dir": str(blocker / "staging")})
    with pytest.raises(SpecError) as ei:
        check_offline(spec)
    assert "checkpoint.staging_dir" in str(ei.value) and "not a writable directory" in str(ei.value)


def test_a_model_far_too_big_fails_with_the_fields_to_change(
    no_worker_starts, tmp_path: Path
) -> None:
    spec = _local(tmp_path, **{"model.d_model": 10_000_000, "model.n_heads": 1})
    with pytest.raises(SpecError) as ei:
        check_offline(spec)
    msg = str(ei.value)
    assert "parameters and needs about" in msg and "TB per device" in msg
    for field in ("model.d_model", "parallel.pipeline_stages", "parallel.zero_stage"):
        assert field in msg
    ok = _local(tmp_path)
    check_offline(ok)
    # A stated device size is used as is (a remote GPU cluster).
    small = _local(tmp_path, **{"model.d_model": 4096, "resources.device_memory_gb": 1})
    with pytest.raises(SpecError, match=r"resources.device_memory_gb"):
        check_offline(small, local_cluster=False)


@pytest.mark.parametrize(
    ("key", "value", "owner"),
    [
        ("train_batch_size", 64, "train.global_batch_size"),
        ("gradient_accumulation_steps", 3, "parallel.micro_batches"),
        ("zero_optimization", {"stage": 2}, "parallel.zero_stage"),
        ("bf16", {"enabled": True}, "parallel.precision"),
        ("gradient_clipping", 0.5, "train.grad_clip"),
    ],
)
def test_deepspeed_keys_that_contradict_the_spec_are_refused(key, value, owner) -> None:
    with pytest.raises(SpecError) as ei:
        load_spec(QUICKSTART, {f"deepspeed.{key}": value})
    assert f"deepspeed.{key.split('.')[0]}" in str(ei.value) and owner in str(ei.value)


def test_deepspeed_keys_that_agree_or_are_new_are_fine() -> None:
    spec = load_spec(QUICKSTART, {"deepspeed.train_batch_size": 16, "deepspeed.seed": 3})
    assert deepspeed_config(spec, 2)["train_batch_size"] == 16
    assert deepspeed_config(spec, 2)["seed"] == 3
    with pytest.raises(SpecError, match="deepspeed.optimizer cannot be set"):
        load_spec(QUICKSTART, {"deepspeed.optimizer": {"type": "Adam"}})


@pytest.mark.parametrize("field", ["checkpoint.endpoint_url", "data.endpoint_url"])
def test_endpoint_url_syntax(field: str) -> None:
    with pytest.raises(SpecError) as ei:
        load_spec(QUICKSTART, {field: "not a url"})
    assert f"{field}: 'not a url' must be an http(s) base URL" in str(ei.value)


# --- 4. failures are classified -----------------------------------------------------


@pytest.mark.parametrize(
    ("cause", "kind"),
    [
        (
            torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 51.00 GiB"),
            "out of memory",
        ),
        (
            RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried 51 GB"),
            "out of memory",
        ),
        (FileNotFoundError(2, "No such file", "/data/x"), "missing path"),
        (PermissionError(13, "Permission denied", "/stage"), "permission denied"),
        (CheckpointMismatchError("another job"), "checkpoint mismatch"),
        (ModuleNotFoundError("No module named 'my_model'"), "import error"),
        (SpecError("model.config.x: bad"), "invalid spec"),
    ],
)
def test_non_retryable_failures_fail_at_once_with_their_fix(cause, kind) -> None:
    k = classify([cause, RuntimeError("gloo: connection closed by peer")])
    assert k.name == kind and not k.retryable
    decision = FailurePolicy(max_failures=5).decide(1, "training failed", k)
    assert isinstance(decision, Fail)
    assert "Not retried" in decision.reason and "max_failures" not in decision.reason


@pytest.mark.parametrize(
    "cause",
    [
        RuntimeError("worker process died (killed, out of memory, or its node was lost)"),
        TimeoutError("no answer within 300s"),
        ConnectionResetError("peer reset"),
    ],
)
def test_transient_failures_are_retried_and_only_they_suggest_max_failures(cause) -> None:
    k = classify([cause])
    assert k.retryable
    policy = FailurePolicy(max_failures=1)
    assert isinstance(policy.decide(1, "x", k), Restart)
    last = policy.decide(2, "x", k)
    assert isinstance(last, Fail) and "Raise failure.max_failures" in last.reason


# --- 5. every CLI path: one clear line, a non-zero exit ------------------------------


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err
    return code, err


def _bad_cases(tmp_path: Path) -> list[tuple[list[str], str]]:
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("name: caf\xe9\n".encode("latin-1"))
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    dup = tmp_path / "dup.yaml"
    dup.write_text("train:\n  steps: 10\n  lr: 0.1\n  steps: 100000\n")
    cfg = [str(QUICKSTART), "--set", f"checkpoint.uri=file://{tmp_path}/c"]
    return [
        (["validate", str(latin1)], "is not UTF-8"),
        (["validate", str(empty)], "is empty"),
        (["validate", str(dup)], "duplicate key 'steps' at line 4 (first at line 2)"),
        (["validate", str(tmp_path / "nope.yaml")], "does not exist"),
        (["validate"], "give a config file"),
        (["validate", *cfg, "--set", "checkpoint.endpoint_url=not a url"], "http(s) base URL"),
        (
            [
                "validate",
                *cfg,
                "--set",
                "checkpoint.uri=s3://bucket-x/p",
                "--set",
                "checkpoint.storage_options.config_kwargs=3",
            ],
            "config_kwargs must be a mapping",
        ),
        (["validate", *cfg, "--set", "checkpoint.storage_options.anon=true"], "local path"),
        (["validate", *cfg, "--set", "model.d_model=10000000"], "TB per device"),
        (["plan", *cfg, "--device-memory-gb", "0.01"], "a device has 10.0 MB"),
        (["plan", str(empty)], "is empty"),
        (["run", str(empty)], "is empty"),
        (["run", *cfg, "--set", "parallel.pipline=2"], "did you mean 'pipeline_stages'"),
        (["submit", str(empty), "--address", "http://127.0.0.1:9"], "is empty"),
        (["status", "s3:/x"], "has no '//'"),
        (["report", "s3:/x"], "has no '//'"),
        (["trace", "s3:/x"], "has no '//'"),
        (["trace", str(tmp_path / "no" / "such")], "no/such does not exist"),
        (["status", str(tmp_path / "no" / "such")], "no/such does not exist"),
        (
            ["report", f"file://{tmp_path}/none", "--out", str(tmp_path / "r")],
            "none does not exist",
        ),
        (["status", str(tmp_path)], "holds no Spotline job"),  # it exists: nothing of a job
    ]


def test_every_subcommand_ends_in_one_line_and_a_non_zero_exit(
    no_worker_starts, tmp_path: Path, capsys
) -> None:
    for argv, expected in _bad_cases(tmp_path):
        code, err = _cli(argv, capsys)
        assert code == 2, (argv, code, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("spotline: "), (argv, err)
        assert expected in lines[0], (argv, lines[0])
        assert "Traceback" not in err


def test_validate_warns_when_a_jit_checkpoint_cannot_meet_the_notice(
    no_worker_starts, tmp_path: Path, capsys
) -> None:
    cfg = [str(QUICKSTART), "--offline", "--set", f"checkpoint.uri=file://{tmp_path}/c"]
    gcp = ["--set", 'preemption.sources=[{"kind": "gcp"}]']
    assert main(["validate", *cfg, *gcp]) == 0
    out = capsys.readouterr()
    assert ": OK" in out.out and out.err == ""  # a small state fits a 30 s notice
    slow = ["--set", "checkpoint.upload_max_mb_per_s=0.001"]
    assert main(["validate", *cfg, *gcp, *slow]) == 0  # a warning, not a refusal
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("spotline: warning: a just-in-time checkpoint")
    assert "gcp notice gives 30s" in err[0] and "checkpoint.upload_max_mb_per_s" in err[0]


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(SpecError):
        main(["--debug", "validate", str(empty)])


def test_an_unexpected_error_is_one_line_that_says_it_is_a_bug(
    monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    import spotline.cli as cli

    def boom(args):
        raise KeyError("surprise")

    monkeypatch.setattr(cli, "_dispatch", boom)
    code, err = _cli(["validate", str(QUICKSTART)], capsys)
    assert code == 1 and err.count("\n") == 1
    assert "unexpected error: KeyError" in err and "--debug" in err


# --- 6. ambiguity is an error --------------------------------------------------------


def test_a_second_section_is_a_duplicate_key(tmp_path: Path) -> None:
    path = tmp_path / "two.yaml"
    path.write_text("train:\n  steps: 10\nmodel:\n  n_layers: 2\ntrain:\n  lr: 0.1\n")
    with pytest.raises(SpecError, match=r"duplicate key 'train' at line 5 \(first at line 1\)"):
        load_spec(path)


def test_did_you_mean_inside_list_items() -> None:
    with pytest.raises(SpecError) as ei:
        load_spec(
            QUICKSTART,
            {
                "parallel.pipeline_stages": 2,
                "backfill.enabled": True,
                "backfill.tasks": [{"kind": "eval", "everyy_steps": 5}],
                "preemption.sources": [{"kind": "aws", "pol_interval_s": 1}],
            },
        )
    msg = str(ei.value)
    assert "unknown field 'everyy_steps' in backfill.tasks[0]; did you mean 'every_steps'?" in msg
    assert (
        "unknown field 'pol_interval_s' in preemption.sources[0]; did you mean 'poll_interval_s'?"
        in msg
    )


def test_storage_options_on_a_local_uri_are_refused(tmp_path: Path) -> None:
    spec = _local(tmp_path, **{"checkpoint.storage_options": {"key": "x"}})
    with pytest.raises(StorageError, match="local path, which takes none"):
        check_offline(spec)


# --- misleading or hint-free messages: the corpus ------------------------------------


def _corpus_error(corpus: str, **data: Any) -> str:
    from spotline.data import CorpusError, load_corpus

    spec = load_spec(None, {"data.corpus": corpus, **{f"data.{k}": v for k, v in data.items()}})
    with pytest.raises(CorpusError) as ei:
        load_corpus(spec.data)
    return str(ei.value)


def test_an_http_corpus_whose_server_is_down_says_so() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once this block ends: nothing listens there
    msg = _corpus_error(f"http://127.0.0.1:{port}/corpus/")
    assert f"cannot reach the server of http://127.0.0.1:{port}/corpus/" in msg
    assert "file_suffixes" not in msg


def test_a_missing_fsspec_package_names_what_to_install() -> None:
    assert "run: pip install gcsfs" in _corpus_error("gs://bucket/corpus")


def test_an_s3_corpus_has_its_own_endpoint_and_credentials(s3_bucket, monkeypatch) -> None:
    from spotline.data import load_corpus

    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key="text/a.txt", Body=b"hello " * 200)
    uri = f"s3://{s3_bucket.name}/text/"
    # No credentials anywhere: one line that says where to put them.
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    msg = _corpus_error(uri, endpoint_url=s3_bucket.endpoint_url)
    assert f"no AWS credentials found for {uri}" in msg and "data.storage_options" in msg
    # data.endpoint_url and data.storage_options point it at the server, nothing else.
    spec = load_spec(
        None,
        {
            "data.corpus": uri,
            "data.endpoint_url": s3_bucket.endpoint_url,
            "data.storage_options": {"key": "testing", "secret": "testing"},
            "model.seq_len": 16,
        },
    )
    assert load_corpus(spec.data, min_tokens=18).total_bytes == 1200
    assert "s3fs takes no option 'secrt'" in _corpus_error(
        uri, endpoint_url=s3_bucket.endpoint_url, storage_options={"secrt": "x"}
    )
