"""Tokenizers, prepared token datasets, sampling and prefetch, on small local inputs.

One small BPE tokenizer is trained per module (the `tokenizers` library's own trainer,
on a few hundred KB of Python's standard library); nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import spotline.data.prepare as prep
from spotline.config import load_spec
from spotline.data import (
    ArrayStream,
    ByteTokenizer,
    CorpusError,
    DataError,
    HuggingFaceTokenizer,
    Mixture,
    Prefetcher,
    Sampler,
    ShardError,
    TextDataset,
    TokenDataset,
    load_tokenizer,
    load_tokenizer_at,
    open_dataset,
    read_index,
    train_bpe,
)
from spotline.data.prepare import prepare
from spotline.data.tokenizer import text_files, tokenizer_files

pytestmark = pytest.mark.unit

SAMPLES = [
    "",
    "hello",
    "héllo wörld",
    "日本語 🚀\n\ttabs  and   spaces",
    "def f(x):\n    return x ** 2  # <|endoftext|> inside",
]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bpe")
    train_bpe("stdlib", str(out), vocab_size=512, max_bytes=300_000)
    return out


@pytest.fixture(scope="module")
def bpe(bpe_dir) -> HuggingFaceTokenizer:
    return HuggingFaceTokenizer(bpe_dir)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    """A few dozen stdlib files (about 150 KB), copied so the test owns them."""
    out = tmp_path_factory.mktemp("corpus")
    used = 0
    for i, f in enumerate(text_files("stdlib")[40:]):
        data = f.read_bytes()
        if not 500 < len(data) < 20_000:
            continue
        (out / f"{i:04d}_{f.name}").write_bytes(data)
        used += len(data)
        if used > 150_000:
            break
    return out


def _expected(tok, texts: list[str]) -> np.ndarray:
    eos = prep.separator_id(tok)
    return np.concatenate([np.asarray(tok.encode(t) + [eos], dtype=np.int64) for t in texts])


def _texts(folder: Path) -> list[str]:
    return [p.read_bytes().decode("utf-8", "replace") for p in sorted(folder.iterdir())]


def _all_tokens(out: Path) -> np.ndarray:
    index = json.loads((out / "index.json").read_text())
    return np.concatenate([np.load(out / s["path"]) for s in index["shards"]]).astype(np.int64)


def _tokens_spec(tmp_path: Path, uri, tok_dir: Path | None = None, **extra):
    raw = {"data.kind": "tokens", "data.cache_dir": str(tmp_path / "cache"), "model.seq_len": 32}
    raw["data.uri" if isinstance(uri, (str, Path)) else "data.sources"] = (
        str(uri) if isinstance(uri, (str, Path)) else uri
    )
    if tok_dir is not None:
        raw |= {"tokenizer.kind": "huggingface", "tokenizer.path": str(tok_dir)}
    return load_spec(None, raw | extra)


# --- tokenizers ------------------------------------------------------------------------


@pytest.mark.parametrize("text", SAMPLES)
def test_byte_tokenizer_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert (tok.vocab_size, tok.eos_id, tok.sha256) == (256, None, "byte")
    raw = b"\xff\xfe not utf-8 \x80"  # any bytes survive a surrogateescape decode
    assert bytes(tok.encode(raw.decode("utf-8", "surrogateescape"))) == raw


@pytest.mark.parametrize("text", SAMPLES)
def test_bpe_round_trip(bpe: HuggingFaceTokenizer, text: str) -> None:
    ids = bpe.encode(text)
    assert all(0 <= i < bpe.vocab_size for i in ids)
    assert bpe.decode(ids) == text
    assert bpe.encode_batch([text, text]) == [ids, ids]


def test_bpe_identity_and_special_tokens(bpe, bpe_dir: Path) -> None:
    assert bpe.vocab_size == 512
    assert bpe.sha256 == hashlib.sha256((bpe_dir / "tokenizer.json").read_bytes()).hexdigest()
    assert bpe.eos_id == bpe.backend.token_to_id("<|endoftext|>") == bpe.bos_id
    assert len(bpe.encode("import os\nimport sys\n")) < len("import os\nimport sys\n")
    config = json.loads((bpe_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["eos_token"] == "<|endoftext|>"
    # Without tokenizer_config.json the well-known name is found.
    alone = bpe_dir.parent / "alone"
    alone.mkdir(exist_ok=True)
    (alone / "tokenizer.json").write_bytes((bpe_dir / "tokenizer.json").read_bytes())
    assert HuggingFaceTokenizer(alone / "tokenizer.json").eos_id == bpe.eos_id


def test_auto_tokenizer_loads_train_bpe_output(bpe, bpe_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(bpe_dir))
    assert hf.eos_token == "<|endoftext|>"
    assert hf.eos_token_id == bpe.eos_id
    for text in SAMPLES:
        assert hf.encode(text, add_special_tokens=False) == bpe.encode(text)
        assert hf.decode(bpe.encode(text)) == text


def test_train_bpe_refuses_a_vocabulary_smaller_than_the_bytes(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="vocab_size .* must be at least 257"):
        train_bpe("stdlib", str(tmp_path), vocab_size=200)


def test_load_tokenizer_from_a_dir_a_file_and_a_uri(bpe, bpe_dir: Path, tmp_path: Path) -> None:
    from spotline.config.model import TokenizerSpec

    cache = str(tmp_path / "cache")
    for path in (str(bpe_dir), str(bpe_dir / "tokenizer.json"), f"file://{bpe_dir}"):
        tok = load_tokenizer(TokenizerSpec(kind="huggingface", path=path), cache_dir=cache)
        assert (tok.sha256, tok.vocab_size, tok.eos_id) == (bpe.sha256, 512, bpe.eos_id)
    # Any other fsspec URI is copied into the cache first (memory:// stands in for S3).
    import fsspec

    mem = fsspec.filesystem("memory")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        mem.pipe_file(f"/tok-test/{name}", (bpe_dir / name).read_bytes())
    tok = load_tokenizer(
        TokenizerSpec(kind="huggingface", path="memory://tok-test"), cache_dir=cache
    )
    assert tok.sha256 == bpe.sha256 and tok.eos_id == bpe.eos_id
    assert str(tok.path).startswith(cache)
    assert isinstance(load_tokenizer_at("byte"), ByteTokenizer)
    assert load_tokenizer_at(str(bpe_dir), cache_dir=cache).sha256 == bpe.sha256
    pinned = TokenizerSpec(kind="huggingface", path=str(bpe_dir), sha256=bpe.sha256)
    assert load_tokenizer(pinned, cache_dir=cache).sha256 == bpe.sha256
    job = load_spec(None, {"tokenizer.kind": "huggingface", "tokenizer.path": str(bpe_dir)})
    files = tokenizer_files(job)
    assert set(files) == {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    assert tokenizer_files(load_spec(None, {})) == {}


def test_load_tokenizer_errors_name_the_field(bpe_dir: Path, tmp_path: Path) -> None:
    from spotline.config.model import TokenizerSpec

    def err(path: str, **kw) -> str:
        spec = TokenizerSpec(kind="huggingface", path=path, **kw)
        with pytest.raises(DataError) as ei:
            load_tokenizer(spec, cache_dir=str(tmp_path / "cache"))
        return str(ei.value)

    assert f"tokenizer.path: {tmp_path / 'nope'} does not exist" in err(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "does not exist (or has no tokenizer.json)" in err(str(empty))
    bogus = tmp_path / "bogus.json"
    bogus.write_text('{"hello": "world"}')
    assert err(str(bogus)).startswith(f"tokenizer.path: not a tokenizer.json: {bogus}")
    assert "tokenizer.path: not a tokenizer.json" in err(str(Path(__file__)))
    msg = err(str(bpe_dir), sha256="0" * 64)
    assert msg.startswith("tokenizer.sha256 is 000000000000...") and "another tokenizer" in msg
    assert "\n" not in msg


# --- prepare ----------------------------------------------------------------------------


def test_prepare_text_files(bpe, corpus_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    index = prepare(str(corpus_dir), bpe, str(out), shard_tokens=10_000, progress=False)
    texts = _texts(corpus_dir)
    want = _expected(bpe, texts)
    assert index["total_tokens"] == want.size == sum(len(bpe.encode(t)) + 1 for t in texts)
    assert index["documents"] == len(texts)
    assert len(index["shards"]) == -(-want.size // 10_000)
    assert [s["tokens"] for s in index["shards"][:-1]] == [10_000] * (len(index["shards"]) - 1)
    np.testing.assert_array_equal(_all_tokens(out), want)
    assert (index["dtype"], index["vocab_size"], index["eos_id"]) == ("uint16", 512, bpe.eos_id)
    assert index["tokenizer_sha256"] == bpe.sha256
    assert index["format"] == "spotline-tokens" and index["version"] == 1
    # Document starts: each shard's .docs.npy, relative to the shard.
    starts = np.concatenate([[0], np.cumsum([len(bpe.encode(t)) + 1 for t in texts])[:-1]])
    got = [np.load(out / s["docs_path"]) + k * 10_000 for k, s in enumerate(index["shards"])]
    np.testing.assert_array_equal(np.concatenate(got), starts)
    assert sum(s["documents"] for s in index["shards"]) == len(texts)
    for s in index["shards"]:  # what the index says is what is on disk
        data = (out / s["path"]).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (s["bytes"], s["sha256"])
        assert np.load(out / s["path"], mmap_mode="r", allow_pickle=False).dtype == np.uint16
    assert read_index(str(out)) == (
        index,
        hashlib.sha256((out / "index.json").read_bytes()).hexdigest(),
    )


def _write_jsonl(path: Path, rows: list) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write((json.dumps(row) if row is not None else "") + "\n")


def test_prepare_jsonl_field_across_parts(
    bpe, corpus_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    # Lines straddle part boundaries; one worker tokenizes in this process (the pool of
    # workers has its own test, in test_data_tokens_procs.py).
    monkeypatch.setattr(prep, "PART_BYTES", 700)
    texts = [t[:300] for t in _texts(corpus_dir)] * 3
    src = tmp_path / "in"
    src.mkdir()
    rows = [{"id": i, "body": t} for i, t in enumerate(texts)]
    _write_jsonl(src / "a.jsonl", rows[:40] + [None] + rows[40:60])  # a blank line is skipped
    _write_jsonl(src / "b.json", rows[60:])
    index = prepare(
        str(src), bpe, str(tmp_path / "ds"), text_field="body", progress=False, workers=1
    )
    assert index["documents"] == len(texts)
    np.testing.assert_array_equal(_all_tokens(tmp_path / "ds"), _expected(bpe, texts))
    with pytest.raises(
        DataError,
        match=r"a\.jsonl: the line at byte 0 has no field 'text' \(it has: id, body\); set text_field",
    ):
        prepare(str(src), bpe, str(tmp_path / "ds2"), progress=False, workers=1)
    (src / "c.jsonl").write_text('{"body": "ok"}\nnot json\n')
    with pytest.raises(DataError, match=r"c\.jsonl: the line at byte 15 is not JSON"):
        prepare(str(src), bpe, str(tmp_path / "ds3"), text_field="body", progress=False, workers=1)


def test_prepare_parquet_column(bpe, corpus_dir: Path, tmp_path: Path, monkeypatch) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    monkeypatch.setattr(prep, "PART_BYTES", 2_000)  # several parts, tokenized in this process
    texts = [t[:500] for t in _texts(corpus_dir)]
    src = tmp_path / "in"
    src.mkdir()
    table = pa.table({"n": list(range(len(texts))), "content": texts})
    pq.write_table(table, src / "data.parquet", row_group_size=7)
    index = prepare(
        str(src / "data.parquet"),
        bpe,
        str(tmp_path / "ds"),
        column="content",
        progress=False,
        workers=1,
    )
    assert index["documents"] == len(texts)
    assert index["inputs"][0]["column"] == "content"
    np.testing.assert_array_equal(_all_tokens(tmp_path / "ds"), _expected(bpe, texts))
    with pytest.raises(DataError, match=r"no column 'text' \(it has: n, content\); set column"):
        prepare(str(src), bpe, str(tmp_path / "ds2"), progress=False, workers=1)


def test_prepare_missing_pyarrow_says_what_to_install(monkeypatch) -> None:
    import builtins

    real = builtins.__import__

    def no_pyarrow(name, *a, **kw):
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(DataError, match="pip install pyarrow"):
        prep._import_pyarrow()


def test_prepare_resumes(bpe, corpus_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(prep, "PART_BYTES", 10_000)
    calls: list[tuple] = []
    real = prep._tokenize_part

    def counting(part):
        calls.append(part)
        return real(part)

    monkeypatch.setattr(prep, "_tokenize_part", counting)
    out = tmp_path / "ds"
    kw = dict(shard_tokens=5_000, workers=1, progress=False)
    first = prepare(str(corpus_dir), bpe, str(out), **kw)
    n_parts = len(calls)
    blob = (out / "index.json").read_bytes()
    stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.npy")}
    assert len(first["shards"]) > 6 and n_parts > 3

    # Interrupted after the last shard (no index): everything is verified and kept.
    (out / "index.json").unlink()
    calls.clear()
    assert prepare(str(corpus_dir), bpe, str(out), **kw) == first
    assert calls == []
    assert (out / "index.json").read_bytes() == blob
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.npy")} == stamps

    # Killed mid-way: the records of the last shards are gone (and the index).
    (out / "index.json").unlink()
    n = len(first["shards"])
    for k in range(n // 2, n):
        (out / "_parts" / f"shard-{k:05d}.json").unlink()
    calls.clear()
    assert prepare(str(corpus_dir), bpe, str(out), **kw) == first
    assert 0 < len(calls) < n_parts  # only the parts of the missing shards were redone
    assert (out / "index.json").read_bytes() == blob
    for k in range(n // 2):
        assert (out / f"shard-{k:05d}.npy").stat().st_mtime_ns == stamps[f"shard-{k:05d}.npy"]

    # A recorded shard that no longer matches its record is made again.
    shard = out / "shard-00002.npy"
    shard.write_bytes(shard.read_bytes()[:-2] + b"\x00\x00")
    (out / "index.json").unlink()
    calls.clear()
    assert prepare(str(corpus_dir), bpe, str(out), **kw) == first
    assert calls and (out / "index.json").read_bytes() == blob

    # Another tokenizer at the same output replaces it only when told to, and then
    # leaves no stale shards.
    def files(index: dict) -> set[str]:
        return {s["path"] for s in index["shards"]} | {s["docs_path"] for s in index["shards"]}

    calls.clear()
    again = prepare(str(corpus_dir), ByteTokenizer(), str(out), overwrite=True, **kw)
    assert len(calls) == n_parts and again["tokenizer_sha256"] == "byte"
    assert len(again["shards"]) > n
    assert {p.name for p in out.glob("shard-*")} == files(again)
    assert prepare(str(corpus_dir), bpe, str(out), overwrite=True, **kw) == first
    assert {p.name for p in out.glob("shard-*")} == files(first)
    assert {p.name for p in (out / "_parts").glob("shard-*")} == {
        f"shard-{k:05d}.json" for k in range(n)
    }
    assert (out / "index.json").read_bytes() == blob


class _WideTokenizer(ByteTokenizer):
    vocab_size = 70_000
    eos_id = 69_999
    sha256 = "wide"


def test_dtype_follows_the_vocabulary(tmp_path: Path) -> None:
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.txt").write_bytes("hello wörld".encode())
    small = prepare(str(src), ByteTokenizer(), str(tmp_path / "u16"), progress=False)
    assert small["dtype"] == "uint16" and small["eos_id"] is None and small["doc_separator"] == 10
    np.testing.assert_array_equal(_all_tokens(tmp_path / "u16"), list("hello wörld\n".encode()))
    wide = prepare(str(src), _WideTokenizer(), str(tmp_path / "u32"), progress=False)
    assert wide["dtype"] == "uint32"
    arr = np.load(tmp_path / "u32" / wide["shards"][0]["path"])
    assert arr.dtype == np.uint32 and arr[-1] == 69_999


def test_prepare_input_errors(bpe, tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        prepare(str(tmp_path / "nope"), bpe, str(tmp_path / "o"), progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no files to prepare"):
        prepare(str(tmp_path / "empty"), bpe, str(tmp_path / "o"), progress=False)
    assert not (tmp_path / "o" / "index.json").exists()


# --- token datasets ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def prepared(bpe, corpus_dir: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "ds"
    prepare(str(corpus_dir), bpe, str(out), shard_tokens=4_000, progress=False)
    return out


def test_windows_across_shard_boundaries(prepared: Path, bpe_dir: Path, tmp_path: Path) -> None:
    ds = TokenDataset(_tokens_spec(tmp_path, prepared, bpe_dir))
    full = _all_tokens(prepared)
    assert ds.train.size + ds.heldout.size == full.size
    starts = np.array([0, 3_990, 7_999, 8_000, 11_500, ds.train.size - 50])
    np.testing.assert_array_equal(
        ds.train.windows(starts, 50), np.stack([full[s : s + 50] for s in starts])
    )
    # A window longer than a shard spans three of them.
    np.testing.assert_array_equal(ds.train.windows(np.array([3_000]), 9_000)[0], full[3_000:12_000])
    with pytest.raises(IndexError):
        ds.train.windows(np.array([ds.train.size - 10]), 50)
    assert ds.train.windows(np.array([1]), 8).dtype == np.int64


def test_heldout_is_the_tail(prepared: Path, bpe_dir: Path, tmp_path: Path) -> None:
    spec = _tokens_spec(tmp_path, prepared, bpe_dir, **{"data.heldout_fraction": 0.2})
    ds = open_dataset(spec)
    full = _all_tokens(prepared)
    split = int(full.size * 0.8)
    assert (ds.train.size, ds.heldout.size) == (split, full.size - split)
    np.testing.assert_array_equal(
        ds.heldout.windows(np.array([0]), 100)[0], full[split : split + 100]
    )
    assert ds.describe()["sources"][0]["index_sha256"] == read_index(str(prepared))[1]


def test_shards_are_opened_on_demand(prepared: Path, bpe_dir: Path, tmp_path: Path) -> None:
    ds = TokenDataset(_tokens_spec(tmp_path, prepared, bpe_dir))
    assert ds.train.opened() == []
    ds.train.windows(np.array([4_100]), 10)
    assert ds.train.opened() == [1]


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.is_file():
            (dst / p.name).write_bytes(p.read_bytes())
    return dst


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "missing"])
def test_a_damaged_shard_raises_shard_error(
    prepared: Path, bpe_dir: Path, tmp_path: Path, damage: str
) -> None:
    ds_dir = _copy(prepared, tmp_path / "copy")
    shard = ds_dir / "shard-00001.npy"
    data = shard.read_bytes()
    if damage == "truncated":
        shard.write_bytes(data[:-100])
    elif damage == "corrupt":
        shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    else:
        shard.unlink()
    ds = TokenDataset(_tokens_spec(tmp_path, ds_dir, bpe_dir))
    ds.train.windows(np.array([10]), 10)  # shard 0 is fine
    with pytest.raises(ShardError) as ei:
        ds.train.windows(np.array([4_010]), 10)
    msg = str(ei.value)
    assert f"shard {ds_dir}/shard-00001.npy is {damage}" in msg
    assert "prepare the dataset again" in msg and "\n" not in msg
    assert isinstance(ei.value, DataError)


def test_dataset_errors_name_the_field(prepared: Path, bpe_dir: Path, tmp_path: Path) -> None:
    empty = tmp_path / "nothing"
    empty.mkdir()
    with pytest.raises(
        DataError, match=rf"^data\.uri: no index\.json at {empty}: run `spotline prepare` first"
    ):
        TokenDataset(_tokens_spec(tmp_path, empty, bpe_dir))
    (empty / "index.json").write_text('{"format": "other"}')
    with pytest.raises(DataError, match=r"data\.uri: .* is not a Spotline token index"):
        read_index(str(empty))
    # The byte tokenizer's job cannot train on a BPE dataset.
    with pytest.raises(DataError) as ei:
        TokenDataset(_tokens_spec(tmp_path, prepared))
    msg = str(ei.value)
    sha = read_index(str(prepared))[0]["tokenizer_sha256"]
    assert msg.startswith(f"data.uri: {prepared} was prepared with tokenizer {sha[:12]}...")
    assert "tokenizer.sha256 is byte" in msg
    other = _tokens_spec(tmp_path, prepared, bpe_dir, **{"tokenizer.sha256": "a" * 64})
    with pytest.raises(DataError, match=r"tokenizer\.sha256 is aaaaaaaaaaaa"):
        TokenDataset(other)
    pinned = _tokens_spec(
        tmp_path,
        [{"uri": str(prepared), "index_sha256": "b" * 64}, {"uri": str(prepared)}],
        bpe_dir,
    )
    with pytest.raises(
        DataError, match=r"^data\.sources\[0\]\.index_sha256: the index at .* hashes to"
    ):
        TokenDataset(pinned)
    tiny = _tokens_spec(tmp_path, prepared, bpe_dir, **{"model.seq_len": 4_000})
    with pytest.raises(DataError, match=r"data\.uri: .* too few for sequences of 4001 tokens"):
        TokenDataset(tiny)


def test_text_dataset_with_bpe_and_bytes(bpe_dir: Path, corpus_dir: Path, bpe) -> None:
    spec = load_spec(None, {"data.corpus": str(corpus_dir), "model.seq_len": 32})
    ds = open_dataset(spec)
    assert isinstance(ds, TextDataset) and ds.train.tokens.dtype == np.uint8
    raw = b"\n".join(p.read_bytes() for p in sorted(corpus_dir.iterdir()))
    assert ds.train.tokens.tobytes() + ds.heldout.tokens.tobytes() == raw
    spec = load_spec(
        None,
        {
            "data.corpus": str(corpus_dir),
            "model.seq_len": 32,
            "tokenizer.kind": "huggingface",
            "tokenizer.path": str(bpe_dir),
        },
    )
    ds = open_dataset(spec, bpe)
    whole = np.concatenate([ds.train.tokens, ds.heldout.tokens]).astype(np.int64)
    np.testing.assert_array_equal(whole, _expected(bpe, _texts(corpus_dir)))
    assert ds.tokenizer_sha256 == bpe.sha256
    with pytest.raises(CorpusError, match="data.corpus: .* does not exist"):
        open_dataset(load_spec(None, {"data.corpus": str(corpus_dir / "nope")}))
    assert CorpusError is DataError and issubclass(ShardError, DataError)


# --- sampling ---------------------------------------------------------------------------


def _replica_rows(sampler: Sampler, step: int, replicas: int, slots: int = 8) -> torch.Tensor:
    xs = []
    for r in range(replicas):
        for x, y in sampler.micro_batches(step, r, replicas, slots // replicas):
            assert torch.equal(x[:, 1:], y[:, :-1])
            xs.append(torch.cat([x, y[:, -1:]], dim=1))
    return torch.cat(xs)


def test_sampling_is_a_function_of_seed_and_step_at_any_replica_count(
    prepared, bpe_dir, tmp_path
) -> None:
    ds = TokenDataset(_tokens_spec(tmp_path, prepared, bpe_dir))
    a = Sampler(ds.train, seq_len=32, micro_batch_size=2, seed=11)
    b = Sampler(TokenDataset(_tokens_spec(tmp_path, prepared, bpe_dir)).train, 32, 2, 11)
    for step in (0, 1, 250):
        rows = torch.from_numpy(a.global_rows(step, 16))
        for replicas in (1, 2, 4):
            assert torch.equal(_replica_rows(a, step, replicas), rows)
            assert torch.equal(_replica_rows(b, step, replicas), rows)
    assert not torch.equal(_replica_rows(a, 0, 1), _replica_rows(a, 1, 1))
    other = Sampler(ds.train, 32, 2, 12)
    assert not torch.equal(_replica_rows(a, 3, 1), _replica_rows(other, 3, 1))


def test_a_sampler_over_a_stream_draws_what_it_drew_from_the_array() -> None:
    tokens = np.random.default_rng(0).integers(0, 256, size=5000, dtype=np.uint8)
    old = Sampler(tokens, 16, 2, 5)
    new = Sampler(ArrayStream(tokens), 16, 2, 5)
    for step in (0, 9):
        np.testing.assert_array_equal(old.global_rows(step, 8), new.global_rows(step, 8))
        assert old.global_rows(step, 8).dtype == np.uint8  # as before: the array's dtype
        for (x, y), (x2, y2) in zip(
            old.micro_batches(step, 1, 2, 2), new.micro_batches(step, 1, 2, 2), strict=True
        ):
            assert torch.equal(x, x2) and torch.equal(y, y2)


def test_mixture_sampling() -> None:
    low = ArrayStream(np.arange(0, 1000, dtype=np.int64) % 100)  # ids < 100
    high = ArrayStream(1000 + np.arange(0, 3000, dtype=np.int64))  # ids >= 1000
    mix = [(low, 3.0), (high, 1.0)]
    s = Sampler(mix, seq_len=8, micro_batch_size=4, seed=3)
    rows = s.global_rows(0, 4000)
    from_low = (rows < 100).all(axis=1)
    assert (from_low | (rows >= 1000).all(axis=1)).all()  # a row never mixes sources
    assert 0.72 < from_low.mean() < 0.78  # weight 3:1
    # Rows of the high stream are its windows: consecutive ids.
    hi_rows = rows[~from_low]
    assert (np.diff(hi_rows, axis=1) == 1).all()
    again = Sampler(Mixture(mix), seq_len=8, micro_batch_size=4, seed=3)
    np.testing.assert_array_equal(again.global_rows(0, 4000), rows)
    for step in (0, 5):
        full = torch.from_numpy(s.global_rows(step, 32))
        for replicas in (1, 2, 4):
            assert torch.equal(_replica_rows(s, step, replicas, slots=8), full)
    assert not np.array_equal(s.global_rows(1, 64), s.global_rows(2, 64))
    with pytest.raises(ValueError, match="need at least 10 tokens"):
        Sampler([(low, 1.0), (ArrayStream(np.zeros(9)), 1.0)], 8, 1, 0)


def test_mixture_of_prepared_datasets(prepared, bpe_dir, tmp_path, bpe, corpus_dir) -> None:
    other = tmp_path / "other"
    prepare(str(corpus_dir), bpe, str(other), shard_tokens=50_000, progress=False)
    spec = _tokens_spec(
        tmp_path,
        [{"uri": str(prepared), "weight": 1.0}, {"uri": str(other), "weight": 2.0}],
        bpe_dir,
    )
    ds = TokenDataset(spec)
    assert isinstance(ds.train, Mixture) and len(ds.sources) == 2
    s = Sampler(ds.train, 32, 2, 0)
    assert s.global_rows(4, 64).shape == (64, 33)
    assert Sampler(ds.heldout, 32, 2, 1).global_rows(0, 4).shape == (4, 33)


# --- prefetch ---------------------------------------------------------------------------


def test_prefetcher_returns_batches_in_order_and_builds_ahead() -> None:
    started: dict[int, threading.Event] = {}
    threads = set()

    def make(step: int) -> int:
        threads.add(threading.current_thread().name)
        started.setdefault(step, threading.Event()).set()
        return step * 10

    with Prefetcher(make) as pf:
        for step in range(5):
            out, stall = pf.get(step)
            assert out == step * 10 and stall >= 0.0
            # The next step is being built while the caller works on this one.
            assert started.setdefault(step + 1, threading.Event()).wait(5)
        assert pf.get(2)[0] == 20  # a rewind (after a restore) is built on demand
        assert pf.get(3)[0] == 30
    assert all(name.startswith("spotline-prefetch") for name in threads)


def test_prefetcher_reports_the_stall() -> None:
    now = [0.0]

    def slow(step: int) -> int:
        now[0] += 0.05  # a build takes 0.05 s of the prefetcher's clock
        return step

    with Prefetcher(slow, enabled=False, clock=lambda: now[0]) as pf:
        out, stall = pf.get(7)
        # Built synchronously: the whole build is waited for.
        assert out == 7 and stall == pytest.approx(0.05)
    with Prefetcher(slow, clock=lambda: now[0]) as pf:
        assert pf.get(0)[1] == pytest.approx(0.05)  # nothing was built ahead of the first step


def test_prefetcher_raises_the_builders_exception_in_the_caller() -> None:
    def make(step: int) -> int:
        if step == 2:
            raise KeyError("bad step")
        return step

    for enabled in (True, False):
        with Prefetcher(make, enabled=enabled) as pf:
            assert pf.get(0)[0] == 0
            assert pf.get(1)[0] == 1
            with pytest.raises(KeyError, match="bad step"):
                pf.get(2)
            assert pf.get(3)[0] == 3
    pf = Prefetcher(make)
    pf.close()
    with pytest.raises(RuntimeError, match="after close"):
        pf.get(0)


class _FlakyShards:
    """An HTTP server on 127.0.0.1 serving a prepared dataset, which drops the
    connection of the first `drops` requests for shard files (no answer at all)."""

    def __init__(self, root: Path, drops: int):
        import functools
        import threading
        from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

        self.dropped = 0
        flaky = self

        class Handler(SimpleHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _drop(self) -> bool:
                if "shard-" in self.path and flaky.dropped < drops:
                    flaky.dropped += 1
                    self.close_connection = True
                    return True
                return False

            def do_GET(self) -> None:
                if not self._drop():
                    super().do_GET()

            def do_HEAD(self) -> None:
                if not self._drop():
                    super().do_HEAD()

        handler = functools.partial(Handler, directory=str(root))
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.uri = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("drops", [2, 50])
def test_a_dropped_shard_download_is_retried_a_missing_one_never(
    prepared: Path, bpe_dir: Path, tmp_path: Path, drops: int, monkeypatch
) -> None:
    from spotline import constants

    monkeypatch.setattr(constants, "SPOTLINE_STORAGE_RETRIES", 4)
    served = _FlakyShards(prepared, drops)
    try:
        ds = TokenDataset(_tokens_spec(tmp_path, served.uri, bpe_dir))
        if drops == 2:  # two dropped connections, then the shard: it trains on it
            got = ds.train.windows(np.array([100]), 10)[0]
            np.testing.assert_array_equal(got, _all_tokens(prepared)[100:110])
            assert served.dropped == 2
            assert ds.cache.downloads == [f"{served.uri}/shard-00000.npy"]
        else:  # the server never answers: a ShardError after the retries, nothing cached
            with pytest.raises(ShardError, match="cannot reach the server"):
                ds.train.windows(np.array([100]), 10)
            assert 4 <= served.dropped < 50  # tried again (4 attempts), then given up
            assert not list((tmp_path / "cache" / "shards").glob("*.npy"))
    finally:
        served.close()
    # A shard that is not there is not retried: it is missing.
    missing = _copy(prepared, tmp_path / "gone")
    (missing / "shard-00000.npy").unlink()
    served = _FlakyShards(missing, 0)
    try:
        ds = TokenDataset(_tokens_spec(tmp_path / "m", served.uri, bpe_dir))
        with pytest.raises(ShardError) as e:
            ds.train.windows(np.array([100]), 10)
        assert "missing" in str(e.value) or "404" in str(e.value) or "not" in str(e.value)
    finally:
        served.close()
