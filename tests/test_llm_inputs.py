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
    raw = {
        "name": "inputs",
        "model": {"kind": "llama", "n_layers": 2, "d_model": 32, "n_heads": 4, "seq_len": 16},
        "tokenizer": {"kind": "huggingface", "path": str(root / "tok")},
        "data": {"kind": "tokens", "uri": str(root / "data"), "cache_dir": str(tmp / "cache")},
        "train": {"global_batch_size": 4},
        "checkpoint": {"uri": f"file://{tmp}/ckpt", "staging_dir": str(tmp / "stage")},
    }
    return load_spec(raw, over)


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
