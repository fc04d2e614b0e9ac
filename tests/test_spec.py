"""Job spec: YAML loading, did-you-mean errors, cross-field rules, overrides, hash, preflight.

No Ray, no DeepSpeed, no network: the S3 preflight case talks only to the loopback
moto server of conftest.py, and fails before it would even do that.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import spotline
from spotline.checkpoint import CheckpointStore, StorageError
from spotline.cli import main
from spotline.config import JobSpec, SpecError, load_spec, parse_override_list
from spotline.data import CorpusError
from spotline.preflight import preflight

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
_YAMLS = sorted(p for p in (REPO / "configs").rglob("*") if p.suffix in (".yaml", ".yml"))
SWEEPS = [p for p in _YAMLS if "\nparam_space:" in p.read_text()]  # `spotline sweep` files
CONFIGS = [p for p in _YAMLS if p not in SWEEPS]
QUICKSTART = REPO / "configs" / "quickstart.yaml"


def _spec_error(raw: dict[str, Any] | str | Path | None = None, overrides=None) -> str:
    with pytest.raises(SpecError) as ei:
        load_spec(raw, overrides)
    return str(ei.value)


# --- loading ------------------------------------------------------------------------


def test_configs_are_found() -> None:
    assert QUICKSTART in CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_config_loads(path: Path) -> None:
    spec = load_spec(path)
    e = spec.elastic
    assert spec.micro_batch_size() >= 1
    assert spec.replica_counts()[0] == e.min_replicas
    for replicas in spec.replica_counts():
        ga = spec.grad_accum(replicas)
        assert ga >= 1
        if e.batch_policy == "constant":
            assert spec.global_batch(replicas) == spec.train.global_batch_size


def test_quickstart_values() -> None:
    spec = load_spec(QUICKSTART)
    assert spec.name == "quickstart"
    assert spec.parallel.pipeline_stages == 2
    assert spec.elastic.min_replicas == spec.elastic.max_replicas == 2
    assert spec.resolved_checkpoint_uri() == "file://./spotline-runs/quickstart/checkpoints"


def test_defaults_are_valid() -> None:
    assert load_spec() == JobSpec()


def test_missing_yaml_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    msg = _spec_error(missing)
    assert str(missing) in msg
    assert "does not exist" in msg


@pytest.mark.parametrize(("text", "kind"), [("- a\n- b\n", "list"), ("42\n", "int")])
def test_non_mapping_yaml(tmp_path: Path, text: str, kind: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    msg = _spec_error(path)
    assert "must hold a mapping at the top" in msg
    assert f"(got {kind})" in msg


def test_invalid_yaml_syntax(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("train: {steps: 3\n")
    assert "is not valid YAML" in _spec_error(path)


def test_empty_yaml_is_refused(tmp_path: Path) -> None:
    # An empty file would otherwise validate as a default job nobody asked for.
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing here\n")
    msg = _spec_error(path)
    assert str(path) in msg and "is empty" in msg


def test_exponent_floats_in_yaml_are_floats(tmp_path: Path) -> None:
    # PyYAML (YAML 1.1) reads `1e-3` as a string; the untyped deepspeed section keeps it as is.
    path = tmp_path / "exp.yaml"
    path.write_text("train:\n  lr: 1e-3\ndeepspeed:\n  eps: 1e-8\n  steps: 10\n")
    spec = load_spec(path)
    assert spec.train.lr == pytest.approx(1e-3)
    assert spec.deepspeed == {"eps": pytest.approx(1e-8), "steps": 10}
    assert isinstance(spec.deepspeed["eps"], float)


# --- unknown keys -------------------------------------------------------------------


def test_unknown_key_in_section_suggests_the_field() -> None:
    msg = _spec_error({"parallel": {"pipline": 2}})
    assert "unknown field 'pipline' in parallel; did you mean 'pipeline_stages'?" in msg


def test_unknown_top_level_key_suggests_the_section() -> None:
    msg = _spec_error({"modle": {"n_layers": 2}})
    assert "unknown field 'modle' in the top level; did you mean 'model'?" in msg


def test_unknown_key_with_no_close_match_lists_valid_fields() -> None:
    msg = _spec_error({"train": {"zzzzzz": 1}})
    assert "unknown field 'zzzzzz' in train; valid fields:" in msg
    assert "global_batch_size" in msg


def test_unknown_key_via_override() -> None:
    msg = _spec_error(QUICKSTART, ["parallel.pipline=2"])
    assert "did you mean 'pipeline_stages'?" in msg
    assert str(QUICKSTART) in msg


# --- cross-field rules --------------------------------------------------------------


def test_pipeline_stages_above_n_layers() -> None:
    msg = _spec_error({"model": {"n_layers": 2}, "parallel": {"pipeline_stages": 3}})
    assert "parallel.pipeline_stages (3) must be <= model.n_layers (2)" in msg


def test_pipeline_stages_equal_to_n_layers_is_fine() -> None:
    spec = load_spec({"model": {"n_layers": 2}, "parallel": {"pipeline_stages": 2}})
    assert spec.parallel.pipeline_stages == 2


@pytest.mark.parametrize(("batch", "micro", "hi"), [(16, 3, 2), (10, 4, 1), (12, 5, 2)])
def test_global_batch_not_divisible_by_full_size_suggests_the_step_unit(
    batch: int, micro: int, hi: int
) -> None:
    raw = {
        "train": {"global_batch_size": batch},
        "parallel": {"micro_batches": micro},
        "elastic": {"min_replicas": 1, "max_replicas": hi},
    }
    msg = _spec_error(raw)
    assert f"train.global_batch_size ({batch}) must be divisible by parallel.micro_batches" in msg
    assert f"multiple of {micro * hi}" in msg
    raw["train"]["global_batch_size"] = micro * hi * 2
    assert load_spec(raw).micro_batch_size() == 2


@pytest.mark.parametrize(("micro", "lo", "hi"), [(1, 2, 3), (2, 3, 4), (1, 3, 4), (2, 5, 8)])
def test_constant_batch_needs_min_replicas_to_divide_the_micro_batches(
    micro: int, lo: int, hi: int
) -> None:
    raw = {
        "train": {"global_batch_size": micro * hi * 4},
        "parallel": {"micro_batches": micro},
        "elastic": {"min_replicas": lo, "max_replicas": hi},
    }
    msg = _spec_error(raw)
    assert "elastic.batch_policy 'constant'" in msg
    assert f"elastic.min_replicas ({lo}) must divide" in msg
    choices = msg.split("Set min_replicas to one of ", 1)[1].split("]", 1)[0] + "]"
    fix = max(d for d in json.loads(choices) if d <= lo)
    raw["elastic"]["min_replicas"] = fix
    spec = load_spec(raw)
    assert fix in spec.replica_counts() and hi in spec.replica_counts()
    for d in spec.replica_counts():
        assert spec.global_batch(d) == micro * hi * 4
    # The scaled policy runs at every count in [min, max].
    raw["elastic"].update(min_replicas=lo, batch_policy="scaled")
    assert load_spec(raw).replica_counts() == list(range(lo, hi + 1))


def test_constant_policy_runs_only_at_counts_that_divide_the_micro_batches() -> None:
    spec = load_spec(
        {
            "train": {"global_batch_size": 64},
            "parallel": {"micro_batches": 4},
            "elastic": {"min_replicas": 1, "max_replicas": 16},
        }
    )
    assert spec.replica_counts() == [1, 2, 4, 8, 16]


def test_constant_policy_changes_micro_batches_per_step_not_their_size() -> None:
    spec = load_spec(
        {
            "train": {"global_batch_size": 48},
            "parallel": {"micro_batches": 3},
            "elastic": {"min_replicas": 1, "max_replicas": 4},
        }
    )
    assert spec.micro_batch_size() == 4
    assert [spec.grad_accum(d) for d in (1, 2, 3, 4)] == [12, 6, 4, 3]
    assert {spec.global_batch(d) for d in (1, 2, 3, 4)} == {48}
    assert {spec.lr_scale(d) for d in (1, 2, 3, 4)} == {1.0}
    assert spec.batch_record(2)["micro_batches_per_step"] == 6


def test_scaled_policy_scales_batch_and_lr_by_the_square_root_rule() -> None:
    spec = load_spec(
        {
            "train": {"global_batch_size": 32},
            "parallel": {"micro_batches": 2},
            "elastic": {"min_replicas": 1, "max_replicas": 4, "batch_policy": "scaled"},
        }
    )
    assert [spec.global_batch(d) for d in (1, 2, 4)] == [8, 16, 32]
    assert [spec.grad_accum(d) for d in (1, 2, 4)] == [2, 2, 2]
    assert spec.lr_scale(1) == pytest.approx(0.5)
    assert spec.lr_scale(4) == 1.0
    rec = spec.batch_record(1)
    assert rec["policy"] == "scaled" and "sqrt" in rec["rule"] and rec["global_batch_size"] == 8


def test_batch_policy_is_part_of_the_spec_hash() -> None:
    base = load_spec(QUICKSTART)
    scaled = load_spec(QUICKSTART, {"elastic.batch_policy": "scaled"})
    assert scaled.spec_hash() != base.spec_hash()


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_2_and_3_rejected_with_pipeline(zero: int) -> None:
    msg = _spec_error({"parallel": {"pipeline_stages": 2, "zero_stage": zero}})
    assert f"parallel.zero_stage={zero} cannot be combined with" in msg
    assert "parallel.pipeline_stages=2" in msg


@pytest.mark.parametrize("zero", [0, 1])
def test_zero_0_and_1_allowed_with_pipeline(zero: int) -> None:
    spec = load_spec({"parallel": {"pipeline_stages": 2, "zero_stage": zero}})
    assert spec.parallel.zero_stage == zero


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_every_zero_stage_allowed_without_pipeline(zero: int) -> None:
    spec = load_spec({"parallel": {"pipeline_stages": 1, "zero_stage": zero}})
    assert spec.parallel.zero_stage == zero


def test_zero_stage_out_of_range() -> None:
    assert "parallel.zero_stage" in _spec_error({"parallel": {"zero_stage": 4}})


def test_min_replicas_above_max() -> None:
    msg = _spec_error({"elastic": {"min_replicas": 3, "max_replicas": 2}})
    assert "elastic.min_replicas (3) must be <= elastic.max_replicas (2)" in msg


def test_d_model_not_divisible_by_n_heads() -> None:
    msg = _spec_error({"model": {"d_model": 130, "n_heads": 4}})
    # Named once, in the config's syntax (not "model: model.d_model ...").
    assert (
        "invalid job spec (<dict>): model.d_model (130) must be divisible by model.n_heads (4)"
        in msg
    )


def test_errors_in_several_sections_are_all_reported() -> None:
    msg = _spec_error({"train": {"steps": 0}, "model": {"dropout": 1.5}})
    assert "train.steps" in msg
    assert "model.dropout" in msg


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"train": {"steps": 0}}, "train.steps"),
        ({"train": {"lr": 0}}, "train.lr"),
        ({"model": {"seq_len": 1}}, "model.seq_len"),
        ({"data": {"heldout_fraction": 0.5}}, "data.heldout_fraction"),
        ({"checkpoint": {"keep_last": 0}}, "checkpoint.keep_last"),
        ({"failure": {"max_failures": -2}}, "failure.max_failures"),
        ({"resources": {"device": "tpu"}}, "resources.device"),
    ],
)
def test_field_bounds(raw: dict[str, Any], field: str) -> None:
    assert f"invalid job spec (<dict>): {field}: " in _spec_error(raw)


def test_train_steps_zero_shows_the_value() -> None:
    assert "train.steps: Input should be greater than 0 (got 0)" in _spec_error(
        {"train": {"steps": 0}}
    )


def test_empty_checkpoint_uri() -> None:
    msg = _spec_error({"checkpoint": {"uri": "  "}})
    assert "invalid job spec (<dict>): checkpoint.uri is empty; use e.g. file:///" in msg


def test_bad_job_name() -> None:
    msg = _spec_error({"name": "has space"})
    assert "name 'has space' must be 1-63 letters" in msg


# --- overrides ----------------------------------------------------------------------


def test_dict_overrides() -> None:
    spec = load_spec(QUICKSTART, {"train.steps": 50, "model.d_model": 64, "data.seed": 7})
    assert (spec.train.steps, spec.model.d_model, spec.data.seed) == (50, 64, 7)
    assert spec.model.n_layers == 4  # untouched siblings kept


def test_string_overrides_are_yaml_typed() -> None:
    parsed = parse_override_list(
        ["train.steps=50", "train.lr=1e-3", "name=run-b", "data.file_suffixes=[.py]"]
    )
    assert parsed == {
        "train.steps": 50,
        "train.lr": pytest.approx(1e-3),
        "name": "run-b",
        "data.file_suffixes": [".py"],
    }
    assert type(parsed["train.steps"]) is int
    assert type(parsed["train.lr"]) is float
    spec = load_spec(QUICKSTART, ["train.steps=50", "train.lr=1e-3"])
    assert spec.train.steps == 50
    assert spec.train.lr == pytest.approx(1e-3)


def test_string_override_value_may_contain_equals() -> None:
    assert parse_override_list(["name=a=b"]) == {"name": "a=b"}


@pytest.mark.parametrize("bad", ["train.steps", "=5"])
def test_malformed_override_string(bad: str) -> None:
    msg = _spec_error(None, [bad])
    assert repr(bad) in msg
    assert "train.steps=50" in msg  # shows the right form


def test_override_into_a_value_is_rejected() -> None:
    msg = _spec_error(QUICKSTART, {"train.steps.x": 1})
    assert "override train.steps.x: train.steps is a value, not a section" in msg


def test_override_into_a_default_value_is_rejected() -> None:
    # train.steps is not in the dict (a default), so the override makes it a section.
    assert "train.steps" in _spec_error(None, ["train.steps.x=1"])


def test_overrides_do_not_touch_the_input_dict() -> None:
    raw = {"train": {"steps": 10}}
    spec = load_spec(raw, {"train.steps": 20})
    assert spec.train.steps == 20
    assert raw == {"train": {"steps": 10}}


# --- derived values -----------------------------------------------------------------


def test_spec_hash_is_stable_and_ignores_run_only_fields() -> None:
    base = load_spec(QUICKSTART)
    h = base.spec_hash()
    assert len(h) == 16
    assert load_spec(QUICKSTART).spec_hash() == h
    same = {
        "train.steps": 5,
        "train.log_every": 1,
        "checkpoint.uri": "s3://bucket/elsewhere",
        "name": "other-name",
        "elastic.min_replicas": 1,
    }
    for key, value in same.items():
        assert load_spec(QUICKSTART, {key: value}).spec_hash() == h, key


@pytest.mark.parametrize(
    ("key", "value"),
    [("model.d_model", 64), ("data.seed", 1), ("train.lr", 1e-4), ("parallel.precision", "bf16")],
)
def test_spec_hash_changes_with_the_math(key: str, value: Any) -> None:
    base = load_spec(QUICKSTART)
    assert load_spec(QUICKSTART, {key: value}).spec_hash() != base.spec_hash()


def test_topology() -> None:
    spec = load_spec(
        QUICKSTART,
        {
            "elastic.min_replicas": 1,
            "elastic.max_replicas": 4,
            "parallel.micro_batches": 3,
            "train.global_batch_size": 24,
        },
    )
    assert spec.topology(2) == {
        "pipeline_stages": 2,
        "replicas": 2,
        "world_size": 4,
        "zero_stage": 1,
        "micro_batches": 6,
        "micro_batch_size": 2,
        "precision": "fp32",
    }
    t4 = spec.topology(4)
    assert (t4["world_size"], t4["micro_batches"], t4["micro_batch_size"]) == (8, 3, 2)


# --- the SDK ------------------------------------------------------------------------


def test_job_with_overrides_returns_a_new_job() -> None:
    job = spotline.Job.from_yaml(QUICKSTART)
    other = job.with_overrides({"train.steps": 50, "model.d_model": 64})
    assert other is not job
    assert (other.spec.train.steps, other.spec.model.d_model) == (50, 64)
    assert (job.spec.train.steps, job.spec.model.d_model) == (300, 128)
    assert other.spec.name == job.spec.name == "quickstart"


def test_job_with_overrides_validates() -> None:
    job = spotline.Job.from_yaml(QUICKSTART)
    with pytest.raises(SpecError, match="parallel.zero_stage=3 cannot be combined"):
        job.with_overrides(["parallel.zero_stage=3"])
    with pytest.raises(SpecError, match="train.steps is a value, not a section"):
        job.with_overrides({"train.steps.x": 1})
    assert job.spec.parallel.zero_stage == 1


def test_job_from_yaml_with_string_overrides() -> None:
    job = spotline.Job.from_yaml(QUICKSTART, ["train.steps=7"])
    assert job.spec.train.steps == 7


# --- preflight ----------------------------------------------------------------------


def _write_corpus(root: Path, n_bytes: int = 4000) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    line = "def f(x):\n    return x + 1\n"
    text = (line * (n_bytes // len(line) + 1))[:n_bytes]
    (root / "a.py").write_text(text)
    return root


def _local_raw(tmp_path: Path, **over: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "name": "pf",
        "model": {"n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 16},
        "data": {"corpus": str(_write_corpus(tmp_path / "corpus"))},
        "checkpoint": {"uri": f"file://{tmp_path}/ckpt/{{job}}"},
    }
    return load_spec(raw, over).model_dump()


def test_preflight_good_local_spec(tmp_path: Path) -> None:
    store = preflight(load_spec(_local_raw(tmp_path)))
    assert isinstance(store, CheckpointStore)
    assert store.uri == f"file://{tmp_path}/ckpt/pf"
    # the probe object was removed again
    assert [p.name for p in (tmp_path / "ckpt" / "pf").iterdir()] == []


def test_preflight_makes_a_relative_uri_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    store = preflight(load_spec(_local_raw(tmp_path, **{"checkpoint.uri": "file://./rel/{job}"})))
    assert store.uri == f"file://{tmp_path}/rel/pf"
    assert (tmp_path / "rel" / "pf").is_dir()


@pytest.mark.parametrize("uri", ["s3://", "s3://Bad_Bucket/p", "file://relative"])
def test_preflight_malformed_storage_uri(tmp_path: Path, uri: str) -> None:
    spec = load_spec(_local_raw(tmp_path, **{"checkpoint.uri": uri}))
    with pytest.raises(StorageError) as ei:
        preflight(spec)
    assert f"checkpoint.uri {uri!r} is not usable" in str(ei.value)


def test_preflight_missing_corpus_dir(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-corpus"
    spec = load_spec(_local_raw(tmp_path, **{"data.corpus": str(missing)}))
    with pytest.raises(CorpusError) as ei:
        preflight(spec)
    assert f"data.corpus: {missing} does not exist" in str(ei.value)


def test_preflight_empty_corpus_dir(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    spec = load_spec(_local_raw(tmp_path, **{"data.corpus": str(empty)}))
    with pytest.raises(CorpusError) as ei:
        preflight(spec)
    assert "data.corpus: no text files found" in str(ei.value)
    assert "data.file_suffixes" in str(ei.value)


def test_preflight_corpus_with_only_other_suffixes(tmp_path: Path) -> None:
    other = tmp_path / "binaries"
    other.mkdir()
    (other / "a.bin").write_bytes(b"x" * 5000)
    (other / "b.pyc").write_bytes(b"x" * 5000)
    spec = load_spec(_local_raw(tmp_path, **{"data.corpus": f"file://{other}"}))
    with pytest.raises(CorpusError) as ei:
        preflight(spec)
    assert "data.corpus" in str(ei.value)
    assert "data.file_suffixes" in str(ei.value)


def test_preflight_corpus_too_small_for_seq_len(tmp_path: Path) -> None:
    small = _write_corpus(tmp_path / "small", n_bytes=1000)  # held-out: 50 bytes
    spec = load_spec(_local_raw(tmp_path, **{"data.corpus": str(small), "model.seq_len": 64}))
    with pytest.raises(CorpusError) as ei:
        preflight(spec)
    msg = str(ei.value)
    assert "has 1000 bytes, too few for sequences of 65 tokens" in msg
    assert "model.seq_len" in msg
    # the same corpus is fine for short sequences
    preflight(load_spec(spec.model_dump(), {"model.seq_len": 16}))


def test_preflight_s3_without_credentials(
    s3_server: str, aws_isolated_env: None, tmp_path: Path
) -> None:
    spec = load_spec(
        _local_raw(
            tmp_path,
            **{
                "checkpoint.uri": "s3://spotline-nocreds/ckpt",
                "checkpoint.endpoint_url": s3_server,
            },
        )
    )
    with pytest.raises(StorageError) as ei:
        preflight(spec)
    msg = str(ei.value)
    assert "no AWS credentials found for s3://spotline-nocreds/ckpt" in msg
    assert "AWS_ACCESS_KEY_ID" in msg
    assert "checkpoint.storage_options" in msg


# --- CLI ----------------------------------------------------------------------------


def test_cli_validate_offline_ok(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(REPO)
    assert main(["validate", "configs/quickstart.yaml", "--offline"]) == 0
    out = capsys.readouterr().out
    assert f"quickstart: OK (spec hash {load_spec(QUICKSTART).spec_hash()})" in out


def test_cli_validate_offline_with_set(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(QUICKSTART), "--offline", "--set", "name=renamed"]) == 0
    assert "renamed: OK" in capsys.readouterr().out


def test_cli_validate_bad_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("parallel:\n  pipline: 2\n")
    assert main(["validate", str(bad), "--offline"]) == 2
    captured = capsys.readouterr()
    assert "unknown field 'pipline' in parallel; did you mean 'pipeline_stages'?" in captured.err
    assert captured.err.startswith("spotline: ")
    assert "OK" not in captured.out


def test_cli_validate_online_reports_a_bad_corpus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text(
        f"checkpoint:\n  uri: file://{tmp_path}/ckpt\ndata:\n  corpus: {tmp_path}/missing\n"
    )
    assert main(["validate", str(cfg)]) == 2
    assert "data.corpus:" in capsys.readouterr().err


# --- backfill -----------------------------------------------------------------------


def test_backfill_needs_a_pipeline() -> None:
    msg = _spec_error({"backfill": {"enabled": True}})
    assert "backfill.enabled needs parallel.pipeline_stages >= 2" in msg
    assert "backfill.enabled: false" in msg


def test_backfill_task_kind_lists_the_valid_ones() -> None:
    msg = _spec_error(QUICKSTART, {"backfill": {"tasks": [{"kind": "evl"}]}})
    assert "backfill.tasks[0]" in msg and "'eval', 'speculative'" in msg


def test_speculative_completion_must_fit_the_context() -> None:
    task = {"kind": "speculative", "prompts": ["x"], "max_new_tokens": 128}
    msg = _spec_error(QUICKSTART, {"backfill": {"enabled": True, "tasks": [task]}})
    assert "backfill.tasks[0].max_new_tokens (128) must be < model.seq_len (128)" in msg


def test_draft_heads_must_divide_width() -> None:
    task = {"kind": "speculative", "prompts": ["x"], "draft": {"d_model": 30, "n_heads": 4}}
    msg = _spec_error(QUICKSTART, {"backfill": {"tasks": [task]}})
    assert "draft.d_model (30) must be divisible by draft.n_heads (4)" in msg


def test_prompts_file_is_read_before_any_worker_starts(tmp_path: Path) -> None:
    spec = load_spec(REPO / "configs" / "backfill.yaml")
    spec.checkpoint.uri = f"file://{tmp_path}/ckpt"
    spec.data.max_bytes = 100_000
    missing = spec.model_copy(deep=True)
    missing.backfill.tasks[1].prompts = str(tmp_path / "nope.txt")
    with pytest.raises(ValueError, match=r"backfill.tasks\[1\].prompts: cannot read .*nope.txt"):
        preflight(missing)
    import os

    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        preflight(spec)
    finally:
        os.chdir(cwd)
    prompts = spec.backfill.tasks[1].prompts
    assert isinstance(prompts, list) and prompts[0] == "def __init__(self"


def test_config_imports_nothing_from_the_runtime() -> None:
    """config/ is pure data and validation: besides itself it imports only the registry
    of named parts (the DeepSpeed config of a group is train/'s)."""
    import ast

    for path in (Path(spotline.__file__).parent / "config").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                if name.split(".")[0] == "spotline":
                    assert name.startswith(("spotline.config", "spotline.registry")), (
                        path.name,
                        name,
                    )
