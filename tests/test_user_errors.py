"""Errors that are the user's: their own code, their files, their URIs and addresses.

Each ends a command in one line on stderr that names what to fix, with a non-zero
exit, no traceback, and is never called a Spotline bug. An error raised inside the
user's code names their module and line and is never retried.
"""

from __future__ import annotations

import pickle
import sys
import textwrap
from pathlib import Path

import pytest

from spotline.cli import main
from spotline.config import SpecError, load_spec
from spotline.controller.policies import Fail, FailurePolicy, classify
from spotline.registry import UserCodeError, blames_user_code, user_code_error

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
QUICKSTART = REPO / "configs" / "quickstart.yaml"


def _one_line(argv: list[str], capsys) -> str:
    """The command's only stderr line; it must have failed as a user's error does."""
    code = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, (argv, code, err)
    assert len(lines) == 1 and lines[0].startswith("spotline: "), (argv, err)
    assert "Traceback" not in err and "Spotline bug" not in err, err
    return lines[0]


def _custom(tmp_path: Path, provider: str, working_dir: Path = TESTS) -> list[str]:
    return [
        "validate",
        str(QUICKSTART),
        "--offline",
        "--set",
        f"checkpoint.uri=file://{tmp_path}/ckpt",
        "--set",
        f"model={{kind: custom, provider: '{provider}', config: {{width: 16, depth: 2}}, "
        "seq_len: 32}",
        "--set",
        "parallel.pipeline_stages=1",
        "--set",
        f"runtime_env.working_dir={working_dir}",
    ]


# --- errors in the user's own code ----------------------------------------------------


def test_a_provider_whose_build_raises_is_called_the_users_error(tmp_path, capsys) -> None:
    line = _one_line(_custom(tmp_path, "faulty_model:RAISES"), capsys)
    assert "error in your code" in line
    assert "ValueError: depth 2 must be a multiple of 3" in line
    assert "faulty_model.RaisingProvider.build" in line and "faulty_model.py line" in line
    assert "model.provider 'faulty_model:RAISES'" in line


def test_a_module_that_fails_to_import_is_called_the_users_error(tmp_path, capsys) -> None:
    (tmp_path / "user_syntax_error.py").write_text("def build(:\n")
    (tmp_path / "user_import_raises.py").write_text(
        textwrap.dedent(
            """
            import os
            SIZE = int(os.environ.get("USER_SIZE_NOT_SET", "twelve"))
            """
        )
    )
    line = _one_line(_custom(tmp_path, "user_syntax_error:PROVIDER", tmp_path), capsys)
    assert "error in your code" in line and "'user_syntax_error'" in line
    assert "SyntaxError" in line and "model.provider" in line
    line = _one_line(_custom(tmp_path, "user_import_raises:PROVIDER", tmp_path), capsys)
    assert "error in your code" in line and "ValueError" in line
    assert "user_import_raises" in line and "line 3" in line


def test_an_error_in_a_users_layer_is_theirs_and_final(tmp_path) -> None:
    """What a worker does with its traceback (the frames do not cross Ray): the error
    raised in the user's forward becomes a UserCodeError naming the module and line,
    which survives pickling, and the failure policy does not retry it."""
    import torch

    from spotline.models import build_sequential, model_def

    sys.path.insert(0, str(TESTS))
    spec = load_spec(
        None,
        {
            "model": {"kind": "custom", "provider": "faulty_model:PROVIDER", "seq_len": 8},
            "checkpoint.uri": f"file://{tmp_path}/c",
        },
    )
    model = build_sequential(model_def(spec))

    @blames_user_code
    def train_step() -> None:
        model(torch.zeros(1, 8, dtype=torch.long))

    with pytest.raises(UserCodeError) as ei:
        train_step()
    err = pickle.loads(pickle.dumps(ei.value))  # as Ray ships it to the controller
    assert isinstance(err, UserCodeError) and err.module == "faulty_model"
    assert "faulty_model.BrokenMixer.forward, faulty_model.py line" in str(err)
    assert "ValueError: width 32 is not supported by this block" in str(err)
    kind = classify([err], "training failed")
    assert not kind.retryable
    decision = FailurePolicy(max_failures=3).decide(1, f"training failed: {err}", kind)
    assert isinstance(decision, Fail) and "max_failures" not in decision.reason


def test_an_error_outside_the_users_code_is_not_called_theirs() -> None:
    def spotline_side() -> None:
        raise KeyError("a bug")

    try:
        spotline_side()
    except KeyError as e:
        assert user_code_error(e) is None


def test_a_framework_failure_inside_a_call_from_user_code_is_not_theirs(
    tmp_path, monkeypatch
) -> None:
    """A collective that fails inside the user's forward (a ZeRO-3 gather hook, a lost
    peer) is the framework's, and transient: only what fails in their own frames is
    theirs."""
    from spotline.registry import import_object

    (tmp_path / "user_calls_framework.py").write_text(
        textwrap.dedent(
            """
            from spotline.config.urls import check_scheme

            def through_spotline():
                check_scheme("hdfs://nn/x", "field", ("file",))

            def own():
                return {}["missing"]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    through = import_object("user_calls_framework:through_spotline", "backfill.tasks[0].kind")
    own = import_object("user_calls_framework:own", "backfill.tasks[0].kind")
    with pytest.raises(ValueError) as ei:
        through()
    assert user_code_error(ei.value) is None
    with pytest.raises(KeyError) as ei:
        own()
    theirs = user_code_error(ei.value)
    assert theirs is not None and "user_calls_framework.own" in str(theirs)
    assert "backfill.tasks[0].kind 'user_calls_framework:own'" in str(theirs)


def test_integrity_errors_in_a_worker_are_final() -> None:
    from spotline.checkpoint import CorruptCheckpointError
    from spotline.checkpoint.layout import CheckpointFormatError

    for e in (
        CorruptCheckpointError(20, "rank_00000/params.safetensors", "sha256 mismatch"),
        CheckpointFormatError("rank_00000/meta.json", "not a valid JSON file"),
    ):
        assert not classify([e]).retryable, e


# --- URIs in schemes Spotline does not read -------------------------------------------


@pytest.mark.parametrize(
    "override,field",
    [
        ("checkpoint.uri=hdfs://nn/ckpt", "checkpoint.uri"),
        ("data.corpus=hdfs://nn/corpus", "data.corpus"),
        ("data={kind: tokens, uri: 'hdfs://nn/ds'}", "data.uri"),
        (
            "data={kind: tokens, sources: [{uri: /d/a}, {uri: 'hdfs://nn/b'}]}",
            "data.sources[1].uri",
        ),
        ("tokenizer={kind: huggingface, path: 'hdfs://nn/tok'}", "tokenizer.path"),
        ("checkpoint.resume_from={uri: 'hdfs://nn/other'}", "checkpoint.resume_from.uri"),
    ],
)
def test_an_unsupported_scheme_is_one_line_at_load(override, field, tmp_path, capsys) -> None:
    argv = ["validate", str(QUICKSTART), "--offline", "--set", override]
    line = _one_line(argv, capsys)
    assert f"{field}: the scheme 'hdfs://' is not supported" in line
    assert "s3://" in line and "plain local path" in line


def test_init_from_in_an_unsupported_scheme_is_refused_at_load() -> None:
    model = {"kind": "llama", "n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2}
    with pytest.raises(SpecError, match="model.init_from: the scheme 'ftp://'"):
        load_spec(None, {"model": {**model, "init_from": "ftp://host/llama"}})


def test_cli_uri_arguments_in_an_unsupported_scheme(tmp_path, capsys) -> None:
    out = str(tmp_path / "o")
    line = _one_line(["prepare", "hdfs://nn/raw", "--tokenizer", "byte", "--out", out], capsys)
    assert "INPUT: the scheme 'hdfs://' is not supported" in line
    line = _one_line(["prepare", str(tmp_path), "--tokenizer", "byte", "--out", "az://c/p"], capsys)
    assert "--out: the scheme 'az://' is not supported" in line
    line = _one_line(["export", str(tmp_path), "--out", "hdfs://nn/model"], capsys)
    assert "--out: the scheme 'hdfs://' is not supported" in line


def test_export_from_a_path_that_does_not_exist_says_so(tmp_path, capsys) -> None:
    line = _one_line(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "o")], capsys)
    assert f"file://{tmp_path}/nope does not exist" in line
    line = _one_line(["export", str(tmp_path), "--out", str(tmp_path / "o")], capsys)
    assert "holds no committed checkpoint" in line


def test_the_spec_and_the_store_agree_on_checkpoint_schemes() -> None:
    from spotline.config.urls import CHECKPOINT_SCHEMES
    from spotline.storage.checkpoint_root import BACKENDS as _BACKENDS

    assert set(_BACKENDS) == set(CHECKPOINT_SCHEMES)


def test_a_prompts_file_that_is_not_utf8_says_so(tmp_path, capsys) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("caf\xe9\n".encode("latin-1"))
    task = f"backfill={{enabled: true, tasks: [{{kind: speculative, prompts: '{prompts}'}}]}}"
    argv = ["validate", str(QUICKSTART), "--offline", "--set", task]
    line = _one_line(argv, capsys)
    assert "backfill.tasks[0].prompts" in line and "is not UTF-8 text" in line
    assert "save it as UTF-8" in line


# --- overrides ----------------------------------------------------------------------


@pytest.mark.parametrize("key", ["train.steps", "train.seed", "name"])
def test_an_override_below_a_value_says_to_set_the_value(key, capsys) -> None:
    line = _one_line(["validate", str(QUICKSTART), "--offline", "--set", f"{key}.x=1"], capsys)
    assert f"{key} is a value, not a section" in line
    assert f"--set {key}=VALUE" in line


def test_a_model_that_raises_gives_no_host_step_and_leaves_the_error_to_the_workers(
    tmp_path, monkeypatch
) -> None:
    """`spotline plan` times a CPU job's passes on the host; a model whose forward
    raises gives no measurement (nothing kept in the cache) instead of stopping it: the
    workers report the error as the user's, naming their code."""
    from spotline.planning import host_step as hs
    from spotline.planning.plan import planned_bounds

    sys.path.insert(0, str(TESTS))
    monkeypatch.setattr(hs, "CACHE_DIR", tmp_path / "cache")
    spec = load_spec(
        None,
        {
            "model": {
                "kind": "custom",
                "provider": "faulty_model:PROVIDER",
                "config": {"width": 16, "depth": 2},
                "seq_len": 8,
            },
            "checkpoint.uri": f"file://{tmp_path}/c",
        },
    )
    assert hs.host_step(spec, 1, planned_bounds(spec, 1)) is None
    assert not list((tmp_path / "cache").glob("host-step-*"))
