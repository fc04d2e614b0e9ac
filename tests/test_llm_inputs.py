"""Bad input for real language models: each fails in the preflight, before any worker
starts, with one line that names the field or the file. No Ray."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest

from spotline.config import SpecError, load_spec
from spotline.controller.policies import classify
from spotline.data import DataError, ShardError
from spotline.preflight import check_offline, preflight

pytestmark = pytest.mark.unit

JSON_PKG = str(Path(sysconfig.get_paths()["stdlib"]) / "json")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from spotline.data import load_tokenizer_at
    from spotline.data.prepare import prepare
    from spotline.data.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("inputs")
    train_bpe([JSON_PKG], str(root / "tok"), vocab_size=300)
    prepare(JSON_PKG, load_tokenizer_at(str(root / "tok")), str(root / "data"), workers=1,
            progress=False)  # fmt: skip
    return root


def spec(root: Path, tmp: Path, **over):
    return load_spec(_raw(root, tmp), over)


def _raw(root: Path, tmp: Path) -> dict:
    return {
        "name": "inputs",
        "model": {"kind": "llama", "n_layers": 2, "d_model": 32, "n_heads": 4, "seq_len": 16},
        "tokenizer": {"kind": "huggingface", "path": str(root / "tok")},
        "data": {"kind": "tokens", "uri": str(root / "data"), "cache_dir": str(tmp / "cache")},
        "train": {"global_batch_size": 4},
        "checkpoint": {"uri": f"file://{tmp}/ckpt", "staging_dir": str(tmp / "stage")},
    }


def _refused(s) -> str:
    with pytest.raises((SpecError, DataError)) as ei:
        preflight(s)
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


def test_a_good_spec_resolves_tokenizer_vocabulary_and_dataset(prepared, tmp_path):
    s = spec(prepared, tmp_path)
    preflight(s)
    assert s.tokenizer.sha256 and s.tokenizer.vocab_size == 300 and s.vocab_size() == 300
    assert s.data.sources[0].index_sha256
    assert s.hashed_fields()["tokenizer.sha256"] == s.tokenizer.sha256


def test_a_provider_that_cannot_be_imported(prepared, tmp_path):
    s = spec(prepared, tmp_path, model={"kind": "custom", "provider": "no_such_pkg.m:P"})
    msg = _refused(s)
    assert "model.provider" in msg and "cannot import module 'no_such_pkg.m'" in msg
    assert "runtime_env" in msg


def test_a_provider_config_that_fails_its_own_validation(prepared, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    s = spec(prepared, tmp_path, model={"kind": "custom", "provider": "custom_model:PROVIDER",
                                         "config": {"width": 0, "dpeth": 2}})  # fmt: skip
    msg = _refused(s)
    assert "model.config.width: Input should be greater than 0" in msg
    assert "model.config.dpeth" in msg


@pytest.mark.parametrize("what", ["missing", "not a tokenizer"])
def test_a_tokenizer_path_that_is_missing_or_not_a_tokenizer(prepared, tmp_path, what):
    path = tmp_path / "tok.json"
    if what == "not a tokenizer":
        path.write_text('{"hello": "world"}')
    msg = _refused(spec(prepared, tmp_path, **{"tokenizer.path": str(path)}))
    assert "tokenizer.path" in msg and str(path) in msg


def test_a_vocabulary_larger_than_the_model(prepared, tmp_path):
    msg = _refused(spec(prepared, tmp_path, **{"model.vocab_size": 100}))
    assert "model.vocab_size (100) is smaller than the tokenizer's vocabulary (300" in msg


def test_kv_heads_must_divide_heads(prepared, tmp_path):
    with pytest.raises(SpecError, match=r"model.n_kv_heads \(3\) must divide model.n_heads \(4\)"):
        spec(prepared, tmp_path, **{"model.n_kv_heads": 3})


def test_a_data_uri_with_no_index(prepared, tmp_path):
    empty = tmp_path / "not-prepared"
    empty.mkdir()
    msg = _refused(spec(prepared, tmp_path, **{"data.uri": str(empty)}))
    assert "data.uri" in msg and "spotline prepare" in msg


def test_a_dataset_prepared_with_another_tokenizer(prepared, tmp_path):
    from spotline.data.tokenizer import train_bpe

    train_bpe([JSON_PKG], str(tmp_path / "other"), vocab_size=320)
    msg = _refused(spec(prepared, tmp_path, **{"tokenizer.path": str(tmp_path / "other")}))
    assert "data.uri" in msg and "was prepared with tokenizer" in msg


def test_init_from_a_checkpoint_of_another_shape(prepared, tmp_path):
    from spotline.models import build_sequential, model_def
    from spotline.models.hf import save_hf

    s = spec(prepared, tmp_path, **{"model.vocab_size": 300})
    md = model_def(s)
    save_hf(tmp_path / "hf", s.model, 300, build_sequential(md).state_dict())
    ok = spec(prepared, tmp_path, **{"model.init_from": str(tmp_path / "hf")})
    preflight(ok)
    wider = spec(prepared, tmp_path, **{"model.init_from": str(tmp_path / "hf"),
                                         "model.d_model": 64})  # fmt: skip
    msg = _refused(wider)
    assert "model.d_model (64) disagrees with hidden_size 32" in msg


def test_a_bad_shard_met_while_training_stops_the_job_naming_it(prepared, tmp_path):
    from spotline.data import open_dataset

    data = tmp_path / "data"
    shutil.copytree(prepared / "data", data)
    index = json.loads((data / "index.json").read_text())
    shard = data / index["shards"][0]["path"]
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0xFF  # one flipped bit in the tokens, not the header
    shard.write_bytes(bytes(raw))
    s = spec(prepared, tmp_path, **{"data.uri": str(data)})
    check_offline(s)  # the index is fine: only reading the shard finds it
    with pytest.raises(ShardError) as ei:
        ds = open_dataset(s)
        ds.train.windows(__import__("numpy").array([0]), 8)
    assert index["shards"][0]["path"] in str(ei.value) and "sha256" in str(ei.value)
    # And a worker that meets it is not restarted: a restart would read the same bytes.
    kind = classify([ei.value])
    assert kind.name == "bad data" and not kind.retryable


# --- model.init_from: every safetensors header is checked in the preflight -------------


def _hf_checkpoint(prepared, tmp_path) -> tuple[dict, Path]:
    """(a spec's overrides, a good HF checkpoint of its model) in tmp_path/hf."""
    from spotline.models import build_sequential, model_def
    from spotline.models.hf import save_hf

    s = spec(prepared, tmp_path, **{"model.vocab_size": 300})
    save_hf(tmp_path / "hf", s.model, 300, build_sequential(model_def(s)).state_dict())
    return {"model.vocab_size": 300, "model.init_from": str(tmp_path / "hf")}, tmp_path / "hf"


def _damage(hf: Path, how: str) -> str:
    """Damage the checkpoint at `hf` as `how` says; the file the refusal must name."""
    import torch
    from safetensors.torch import load_file, save_file

    st = hf / "model.safetensors"
    raw = st.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    if how == "absurd header length":
        st.write_bytes((2**62).to_bytes(8, "little") + raw[8:])
    elif how == "header not JSON":
        st.write_bytes(raw[:8] + b"\x89PNG" + b"x" * (n - 4) + raw[8 + n :])
    elif how == "truncated":
        st.write_bytes(raw[: len(raw) - 16])
    elif how == "missing tensor":
        state = load_file(str(st))
        del state["model.layers.1.mlp.up_proj.weight"]
        save_file(state, str(st))
        return "model.layers.1.mlp.up_proj.weight is missing"
    elif how == "wrong shape":
        state = load_file(str(st))
        state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 32)
        save_file(state, str(st))
        return "model.layers.0.self_attn.k_proj.weight in"
    elif how == "only a pickle":
        st.unlink()
        (hf / "pytorch_model.bin").write_bytes(b"\x80\x04never unpickled")
        return "pytorch_model.bin"
    return str(st)


HOW = ["absurd header length", "header not JSON", "truncated", "missing tensor",
       "wrong shape", "only a pickle"]  # fmt: skip


@pytest.mark.parametrize("how", HOW)
def test_init_from_with_bad_weights_is_refused_by_validate(prepared, tmp_path, capsys, how):
    import yaml

    from spotline.cli import main

    over, hf = _hf_checkpoint(prepared, tmp_path)
    raw = _raw(prepared, tmp_path)
    raw["model"].update(vocab_size=300, init_from=over["model.init_from"])
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert main(["validate", str(config)]) == 0
    capsys.readouterr()
    named = _damage(hf, how)
    assert main(["validate", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith("spotline: model.init_from: ") and named in err, err
    assert not (tmp_path / "cache" / "hf").exists()  # a local checkpoint is read in place


@pytest.mark.parametrize("how", ["header not JSON", "wrong shape", "only a pickle"])
def test_bad_weights_met_by_a_worker_are_final(prepared, tmp_path, how):
    from spotline.models import build_sequential, init_from_hf, model_def

    over, hf = _hf_checkpoint(prepared, tmp_path)
    s = spec(prepared, tmp_path, **over)
    model = build_sequential(model_def(s))
    init_from_hf(model, s)
    named = _damage(hf, how)
    with pytest.raises(SpecError) as ei:
        init_from_hf(model, s)
    assert named in str(ei.value) and "\n" not in str(ei.value)
    kind = classify([ei.value])
    assert not kind.retryable and kind.name == "invalid spec"


def test_init_from_s3_reads_only_the_headers(prepared, tmp_path, s3_bucket):
    over, hf = _hf_checkpoint(prepared, tmp_path)
    for f in hf.iterdir():
        s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=f"hf/{f.name}", Body=f.read_bytes())
    uri = f"s3://{s3_bucket.name}/hf"
    over = {**over, "model.init_from": uri, "data.endpoint_url": s3_bucket.endpoint_url,
            "data.storage_options": {"key": "testing", "secret": "testing"}}  # fmt: skip
    check_offline(spec(prepared, tmp_path, **over))
    assert not (tmp_path / "cache" / "hf").exists()  # nothing downloaded by the preflight

    wrong = spec(prepared, tmp_path, **{**over, "model.ffn_hidden": 64})
    with pytest.raises(SpecError, match="model.ffn_hidden") as ei:
        check_offline(wrong)
    assert "intermediate_size" in str(ei.value)
    _damage(hf, "header not JSON")
    st = (hf / "model.safetensors").read_bytes()
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key="hf/model.safetensors", Body=st)
    with pytest.raises(SpecError) as ei:
        check_offline(spec(prepared, tmp_path, **over))
    assert f"{uri}/model.safetensors is not a safetensors file" in str(ei.value)
