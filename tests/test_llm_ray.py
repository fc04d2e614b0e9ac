"""A real language model end to end on a local Ray cluster: a tiny Llama with a BPE
tokenizer trained here, on a dataset `spotline prepare` wrote, as 2 stages x 2 replicas;
SIGKILL resume, export to Hugging Face, and init_from that export.

Nothing comes from a model hub: the tokenizer is trained on Python's own email package.
"""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

import spotline
from conftest import run_killing_a_rank
from spotline.checkpoint import CheckpointStore
from spotline.config import SpecError, load_spec
from spotline.preflight import preflight

pytestmark = pytest.mark.ray

EMAIL = str(Path(sysconfig.get_paths()["stdlib"]) / "email")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """(tokenizer dir, dataset dir): BPE of 512 on the email package, the package prepared."""
    from spotline.data import load_tokenizer_at
    from spotline.data.prepare import prepare
    from spotline.data.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("llm")
    tok_dir = root / "tokenizer"
    train_bpe([EMAIL], str(tok_dir), vocab_size=512)
    data_dir = root / "prepared"
    prepare(EMAIL, load_tokenizer_at(str(tok_dir)), str(data_dir), workers=1, progress=False)
    return tok_dir, data_dir


def llama_spec(tmp: Path, prepared, name: str, **over):
    tok_dir, data_dir = prepared
    raw = {
        "name": name,
        "model": {
            "kind": "llama",
            "n_layers": 2,
            "d_model": 64,
            "n_heads": 4,
            "n_kv_heads": 2,
            "ffn_hidden": 128,
            "seq_len": 32,
        },
        "tokenizer": {"kind": "huggingface", "path": str(tok_dir)},
        "data": {"kind": "tokens", "uri": str(data_dir), "cache_dir": str(tmp / "cache")},
        "parallel": {"pipeline_stages": 2, "micro_batches": 2},
        "elastic": {"min_replicas": 2, "max_replicas": 2},
        "train": {"steps": 30, "global_batch_size": 8, "warmup_steps": 5, "log_every": 10},
        "checkpoint": {
            "uri": f"file://{tmp}/ckpt",
            "interval_steps": 10,
            "staging_dir": str(tmp / "staging"),
        },
        "resources": {"cpus_per_worker": 0.5},
    }
    return load_spec(raw, over)


@pytest.fixture(scope="module")
def reference(ray_session, prepared, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llama-ref")
    spec = llama_spec(tmp, prepared, "llama-ref")
    return spec, spotline.Job(spec).run(verbose=False), tmp


def test_a_tiny_llama_trains_as_2_stages_x_2_replicas(reference):
    spec, result, _ = reference
    assert result.state == "finished" and sorted(result.losses) == list(range(1, 31))
    first, last = result.losses[1], result.losses[30]
    assert first == pytest.approx(torch.log(torch.tensor(512.0)).item(), abs=0.5)
    early = sum(result.losses[s] for s in range(1, 6)) / 5
    late = sum(result.losses[s] for s in range(26, 31)) / 5
    assert late < early - 0.6 and last < first - 0.6, result.losses
    store = CheckpointStore(result.checkpoint_uri)
    m = store.load_manifest(30)
    # The spec hash covers what the data is, resolved by the preflight.
    assert m.extra["spec"]["tokenizer.sha256"] == spec.tokenizer.sha256
    assert m.extra["spec"]["data.sources"][0]["index_sha256"]
    assert m.extra["vocab_size"] == 512
    # The tokenizer travels with the checkpoints, for export.
    assert store.read_artifact("tokenizer/tokenizer.json") is not None
    # The MFU figure comes from the Llama formula.
    from spotline.models import model_def

    assert result.tokens_per_s > 0 and model_def(spec).flops_per_token > 0


def test_sigkill_resume_gives_identical_losses(reference, prepared, tmp_path):
    ref_spec, ref, _ = reference
    spec = llama_spec(tmp_path, prepared, "llama-kill")
    result = run_killing_a_rank(spec, after_commit=10, rank=1)
    assert result.failures == 1
    assert result.attempts[1]["restored_from"] >= 10
    assert result.losses == ref.losses


def _spotline_logits(spec, weights: dict, ids: torch.Tensor) -> torch.Tensor:
    from spotline.models import build_sequential, model_def

    model = build_sequential(model_def(spec))
    model.load_state_dict(weights, strict=True)
    with torch.no_grad():
        return model.eval()(ids)


def test_export_loads_in_transformers_and_init_from_it_gives_the_same_model(
    reference, prepared, tmp_path, capsys
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spotline.checkpoint import reshard
    from spotline.cli import main

    spec, result, ref_tmp = reference
    out = tmp_path / "hf"
    assert main(["export", result.checkpoint_uri, "--out", str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    # Into the same folder again: refused, naming what it would replace, unless told to.
    capsys.readouterr()
    assert main(["export", result.checkpoint_uri, "--out", str(out)]) == 2
    assert "it would replace config.json, model.safetensors" in capsys.readouterr().err
    assert main(["export", result.checkpoint_uri, "--out", str(out), "--overwrite"]) == 0
    hf_model = AutoModelForCausalLM.from_pretrained(out).eval()
    hf_tok = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([hf_tok.encode("From: someone@example.com\nSubject: hello")[:32]])
    # Spotline's own forward on the committed weights of step 30.
    store = CheckpointStore(result.checkpoint_uri)
    manifest = store.load_manifest(30)
    weights = reshard.full_params(manifest.extra["index"], reshard.store_reader(store, 30))
    ours = _spotline_logits(spec, weights, ids)
    with torch.no_grad():
        theirs = hf_model(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)

    # init_from the export: a new job's model starts from exactly those weights...
    from spotline.models import build_sequential, init_from_hf, model_def

    fresh = llama_spec(tmp_path, prepared, "llama-init", **{"model.init_from": str(out)})
    preflight(fresh)  # resolves the tokenizer; checks the export's config.json shape
    model = build_sequential(model_def(fresh))
    init_from_hf(model, fresh)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids), ours, rtol=1e-5, atol=1e-5)
    # ...and so does its first pipelined step: its loss is the exported model's loss on
    # the job's first batch.
    one = llama_spec(
        tmp_path,
        prepared,
        "llama-init",
        **{
            "model.init_from": str(out),
            "train.steps": 1,
            "elastic.min_replicas": 1,
            "elastic.max_replicas": 1,
        },
    )
    first = spotline.Job(one).run(verbose=False).losses[1]
    from spotline.data import Sampler, open_dataset

    data = open_dataset(one)
    sampler = Sampler(data.train, 32, one.micro_batch_size(), one.data.seed)
    batches = sampler.micro_batches(0, 0, 1, one.grad_accum(1))
    with torch.no_grad():
        losses = [model_def(one).loss(hf_model(x).logits, y) for x, y in batches]
    assert first == pytest.approx(float(torch.stack(losses).mean()), rel=1e-4)


def test_another_tokenizer_or_shape_is_refused_before_anything_starts(
    reference, prepared, tmp_path
):
    from spotline.data.tokenizer import train_bpe

    spec, result, ref_tmp = reference
    other = tmp_path / "other-tokenizer"
    train_bpe([EMAIL], str(other), vocab_size=600)
    shutil.copytree(ref_tmp / "ckpt", tmp_path / "ckpt")
    again = llama_spec(tmp_path, prepared, "llama-ref", **{"tokenizer.path": str(other)})
    with pytest.raises(SpecError) as ei:
        preflight(again)
    # The dataset was prepared with the first tokenizer: refused before the checkpoint is.
    assert "was prepared with tokenizer" in str(ei.value)
    wider = llama_spec(tmp_path, prepared, "llama-ref", **{"model.d_model": 128})
    with pytest.raises(SpecError, match="model.d_model: 64 there, 128 here"):
        preflight(wider)


def test_a_custom_model_reaches_the_workers_through_runtime_env(ray_session, tmp_path):
    """The SDK (and `spotline run`) path: runtime_env.working_dir ships the user's code to
    the controller, which hands it to every worker."""
    from conftest import tiny_spec

    here = str(Path(__file__).parent)
    spec = tiny_spec(
        tmp_path,
        "custom-sdk",
        **{
            "model": {
                "kind": "custom",
                "provider": "custom_model:PROVIDER",
                "config": {"width": 16, "depth": 2},
                "seq_len": 32,
            },
            "runtime_env.working_dir": here,
            "runtime_env.excludes": ["*.pyc", "__pycache__"],
            "train.steps": 4,
            "checkpoint.interval_steps": 2,
        },
    )
    result = spotline.Job(spec).run(verbose=False)
    assert result.state == "finished" and sorted(result.losses) == [1, 2, 3, 4]


def test_backfill_evaluates_and_decodes_with_a_llama_target(ray_session, prepared, tmp_path):
    """Backfill works on any model kind: eval of the committed llama, and speculative
    decoding with a draft that shares its BPE tokenizer, equal to greedy decoding."""
    spec = llama_spec(
        tmp_path,
        prepared,
        "llama-backfill",
        **{
            "elastic.min_replicas": 1,
            "elastic.max_replicas": 1,
            "train.steps": 10,
            "checkpoint.interval_steps": 5,
            "backfill": {
                "enabled": True,
                "baseline_steps": 2,
                "finish_timeout_s": 240,
                "tasks": [
                    {"kind": "eval", "every_steps": 100},
                    {
                        "kind": "speculative",
                        "prompts": ["From: ", "Subject: "],
                        "max_new_tokens": 6,
                        "gamma": 2,
                        "every_steps": 100,
                        "draft": {"n_layers": 1, "d_model": 16, "train_steps": 3},
                    },
                ],
            },
        },
    )
    result = spotline.Job(spec).run(verbose=False)
    results = [t["result"] for t in result.backfill["tasks"] if t["result"]]
    # The final checkpoint is always evaluated: its loss is the job's own held-out loss.
    (final,) = [r for r in results if r["kind"] == "eval" and r["step"] == 10]
    assert final["loss"] == pytest.approx(result.heldout_loss, rel=1e-5)
    spec_runs = [r for r in results if r["kind"] == "speculative"]
    assert spec_runs and all(r["all_equal_target_greedy"] for r in spec_runs)
    assert all(r["new_tokens"] == 2 * 6 for r in spec_runs)


def test_export_of_an_altered_step_is_one_line_that_names_another_step(reference, tmp_path, capsys):
    """An altered file is refused naming the step, the file and a step to export instead;
    the user's input is bad, so: exit 2, one line, no 'Spotline bug'."""
    from spotline.cli import main

    _, result, _ = reference
    src = Path(result.checkpoint_uri.removeprefix("file://"))
    copy = tmp_path / "ckpt"
    shutil.copytree(src, copy)  # the reference's own checkpoints stay intact
    store = CheckpointStore(str(copy))
    steps = store.committed_steps()
    latest = steps[-1]
    # A byte of a master weight: what an export reads (never the optimizer state).
    index = store.load_manifest(latest).extra["index"]
    entry = next(e for e in index if e["kind"] == "fp32")
    victim = entry["file"]
    path = copy / CheckpointStore.step_name(latest) / victim
    data = bytearray(path.read_bytes())
    data[entry["offset"]] ^= 0xFF
    path.write_bytes(bytes(data))
    code = main(["export", str(copy), "--out", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert f"step {latest} of file://{copy}: {victim} is corrupt" in lines[0]
    assert f"--step {steps[-2]}" in lines[0] and "Spotline bug" not in err
    assert main(["export", str(copy), "--out", str(tmp_path / "hf"), "--step", str(steps[-2])]) == 0


def test_an_error_in_the_users_model_code_fails_once_naming_their_module(ray_session, tmp_path):
    """The blocks' forward raises in the workers: one attempt, no retry, and the error
    names the user's module, not a rendezvous or a Spotline bug."""
    from conftest import tiny_spec

    spec = tiny_spec(
        tmp_path,
        "faulty-model",
        **{
            "model": {
                "kind": "custom",
                "provider": "faulty_model:PROVIDER",
                "config": {"width": 16, "depth": 2},
                "seq_len": 32,
            },
            "runtime_env.working_dir": str(Path(__file__).parent),
            "runtime_env.excludes": ["*.pyc", "__pycache__"],
            "train.steps": 4,
            "failure.max_failures": 3,
        },
    )
    with pytest.raises(spotline.JobFailed) as ei:
        spotline.Job(spec).run(verbose=False)
    res = ei.value.result
    assert res.failures == 0 and len(res.attempts) == 1, res.attempts
    assert "error in your code" in res.error and "faulty_model.BrokenMixer.forward" in res.error
    assert "width 16 is not supported by this block" in res.error
    assert "max_failures" not in res.error and "Spotline bug" not in res.error
