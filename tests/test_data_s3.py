"""Prepared datasets on S3 (a moto server on 127.0.0.1): `prepare` writes to a bucket and a
`TokenDataset` streams it through the node-local cache, with data.endpoint_url and
data.storage_options (no credentials in the environment)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from spotline.config import load_spec
from spotline.data import DataError, ShardError, TokenDataset, load_tokenizer, read_index
from spotline.data.prepare import prepare
from spotline.data.tokenizer import text_files, train_bpe

pytestmark = pytest.mark.unit

CREDS = {"key": "testing", "secret": "testing"}


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bpe")
    train_bpe("stdlib", str(out), vocab_size=512, max_bytes=200_000)
    return out


@pytest.fixture
def no_env_creds(s3_bucket, monkeypatch):
    """Only data.storage_options can reach the bucket."""
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    return s3_bucket


def _spec(bucket, uri: str, tmp_path: Path, bpe_dir: Path, **extra):
    return load_spec(
        None,
        {
            "data.kind": "tokens",
            "data.uri": uri,
            "data.endpoint_url": bucket.endpoint_url,
            "data.storage_options": CREDS,
            "data.cache_dir": str(tmp_path / "cache"),
            "tokenizer.kind": "huggingface",
            "tokenizer.path": str(bpe_dir),
            "model.seq_len": 32,
        }
        | extra,
    )


def _corpus(tmp_path: Path) -> tuple[Path, list[str]]:
    src = tmp_path / "in"
    src.mkdir()
    rows = []
    for i, f in enumerate(text_files("stdlib")[100:160]):
        rows.append({"text": f.read_bytes()[:3000].decode("utf-8", "replace"), "n": i})
    (src / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return src, [r["text"] for r in rows]


def test_prepare_to_s3_and_stream_through_the_cache(no_env_creds, tmp_path, bpe_dir) -> None:
    bucket = no_env_creds
    tok = load_tokenizer(
        load_spec(
            None, {"tokenizer.kind": "huggingface", "tokenizer.path": str(bpe_dir)}
        ).tokenizer,
        cache_dir=str(tmp_path / "tc"),
    )
    src, texts = _corpus(tmp_path)
    uri = f"s3://{bucket.name}/datasets/small"
    index = prepare(
        str(src), tok, uri, shard_tokens=3_000, endpoint_url=bucket.endpoint_url,
        storage_options=CREDS, progress=False,
    )  # fmt: skip
    want = np.concatenate([np.asarray(tok.encode(t) + [tok.eos_id]) for t in texts])
    assert index["total_tokens"] == want.size and index["documents"] == len(texts)
    keys = {
        o["Key"]
        for o in bucket.client.list_objects_v2(Bucket=bucket.name, Prefix="datasets/small/")[
            "Contents"
        ]
    }
    n = len(index["shards"])
    assert n > 4
    assert f"datasets/small/{index['shards'][-1]['path']}" in keys
    assert "datasets/small/index.json" in keys and "datasets/small/_parts/plan.json" in keys
    got, sha = read_index(uri, endpoint_url=bucket.endpoint_url, storage_options=CREDS)
    assert got == index

    spec = _spec(bucket, uri, tmp_path, bpe_dir)
    ds = TokenDataset(spec, tok)
    cache = tmp_path / "cache" / "shards"
    assert not cache.exists() or not list(cache.glob("*.npy"))  # nothing read yet
    rows = ds.train.windows(np.array([100, 2_990]), 20)  # shard 0, and across into shard 1
    np.testing.assert_array_equal(rows, np.stack([want[100:120], want[2_990:3_010]]))
    touched = {index["shards"][0]["sha256"], index["shards"][1]["sha256"]}
    assert {p.stem for p in cache.glob("*.npy")} == touched
    assert ds.cache.downloads == [f"{uri}/shard-00000.npy", f"{uri}/shard-00001.npy"]
    assert ds.describe()["sources"][0]["index_sha256"] == sha

    # Another rank of this node: the cached shards are used as they are.
    rank2 = TokenDataset(spec, tok)
    np.testing.assert_array_equal(rank2.train.windows(np.array([2_990]), 20)[0], want[2_990:3_010])
    assert rank2.cache.downloads == []
    # The held-out tail's first window needs only the shard it starts in.
    np.testing.assert_array_equal(
        rank2.heldout.windows(np.array([0]), 10)[0], want[ds.train.size : ds.train.size + 10]
    )
    ks = sorted({ds.train.size // 3_000, (ds.train.size + 9) // 3_000})
    assert rank2.cache.downloads == [f"{uri}/{index['shards'][k]['path']}" for k in ks]
    assert len(list(cache.glob("*.npy"))) == 2 + len(ks) < n


def test_ranks_of_a_node_download_each_shard_once(no_env_creds, tmp_path, bpe_dir) -> None:
    import threading

    bucket = no_env_creds
    spec0 = load_spec(None, {"tokenizer.kind": "huggingface", "tokenizer.path": str(bpe_dir)})
    tok = load_tokenizer(spec0.tokenizer, cache_dir=str(tmp_path / "tc"))
    src, _ = _corpus(tmp_path)
    uri = f"s3://{bucket.name}/shared"
    prepare(
        str(src), tok, uri, shard_tokens=3_000, endpoint_url=bucket.endpoint_url,
        storage_options=CREDS, progress=False,
    )  # fmt: skip
    spec = _spec(bucket, uri, tmp_path, bpe_dir)
    ranks = [TokenDataset(spec, tok) for _ in range(4)]  # each its own cache object and fds
    barrier = threading.Barrier(len(ranks))
    rows: list = [None] * len(ranks)

    def read(i: int) -> None:
        barrier.wait()
        rows[i] = ranks[i].train.windows(np.array([3_500, 6_100]), 50)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(u for r in ranks for u in r.cache.downloads) == [
        f"{uri}/shard-00001.npy",
        f"{uri}/shard-00002.npy",
    ]
    for r in rows[1:]:
        np.testing.assert_array_equal(r, rows[0])


def test_a_corrupt_s3_shard_is_refused_and_not_cached(no_env_creds, tmp_path, bpe_dir) -> None:
    bucket = no_env_creds
    spec0 = load_spec(None, {"tokenizer.kind": "huggingface", "tokenizer.path": str(bpe_dir)})
    tok = load_tokenizer(spec0.tokenizer, cache_dir=str(tmp_path / "tc"))
    src, _ = _corpus(tmp_path)
    uri = f"s3://{bucket.name}/ds"
    prepare(
        str(src), tok, uri, shard_tokens=3_000, endpoint_url=bucket.endpoint_url,
        storage_options=CREDS, progress=False,
    )  # fmt: skip
    key = "ds/shard-00001.npy"
    body = bucket.client.get_object(Bucket=bucket.name, Key=key)["Body"].read()
    bucket.client.put_object(Bucket=bucket.name, Key=key, Body=body[:-1] + bytes([body[-1] ^ 7]))
    ds = TokenDataset(_spec(bucket, uri, tmp_path, bpe_dir), tok)
    with pytest.raises(ShardError, match=rf"shard {uri}/shard-00001\.npy is corrupt: its sha256"):
        ds.train.windows(np.array([3_100]), 10)
    assert [p.name for p in (tmp_path / "cache" / "shards").iterdir() if p.suffix == ".npy"] == []
    bucket.client.delete_object(Bucket=bucket.name, Key=key)
    with pytest.raises(ShardError, match=rf"shard {uri}/shard-00001\.npy is missing"):
        ds.train.windows(np.array([3_100]), 10)


def test_s3_input_tokenizer_and_errors(no_env_creds, tmp_path, bpe_dir) -> None:
    bucket = no_env_creds
    for name in ("tokenizer.json", "tokenizer_config.json"):
        bucket.client.put_object(
            Bucket=bucket.name, Key=f"tok/{name}", Body=(bpe_dir / name).read_bytes()
        )
    spec = _spec(bucket, f"s3://{bucket.name}/ds", tmp_path, bpe_dir)
    tspec = spec.tokenizer.model_copy(update={"path": f"s3://{bucket.name}/tok"})
    tok = load_tokenizer(
        tspec, endpoint_url=bucket.endpoint_url, storage_options=CREDS, cache_dir=str(tmp_path)
    )
    local = load_tokenizer(spec.tokenizer, cache_dir=str(tmp_path))
    assert (tok.sha256, tok.eos_id) == (local.sha256, local.eos_id)

    src, texts = _corpus(tmp_path)
    bucket.client.put_object(
        Bucket=bucket.name, Key="raw/docs.jsonl", Body=(src / "docs.jsonl").read_bytes()
    )
    index = prepare(
        f"s3://{bucket.name}/raw/", tok, str(tmp_path / "out"), endpoint_url=bucket.endpoint_url,
        storage_options=CREDS, progress=False,
    )  # fmt: skip
    assert index["documents"] == len(texts)
    assert index["total_tokens"] == sum(len(tok.encode(t)) + 1 for t in texts)

    with pytest.raises(DataError, match=rf"^data\.uri: no index\.json at s3://{bucket.name}/ds"):
        TokenDataset(spec, tok)
    bad = _spec(
        bucket,
        f"s3://{bucket.name}/ds",
        tmp_path,
        bpe_dir,
        **{"data.storage_options": {"secrt": "x"}},
    )
    with pytest.raises(DataError, match="s3fs takes no option 'secrt'"):
        TokenDataset(bad, tok)


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("../other/outside.npy", r"holds '\.\.'"),
        ("s3://{bucket}/other/outside.npy", r"names a scheme or drive \(s3:\)"),
        ("/{bucket}/other/outside.npy", "is absolute"),
    ],
)
def test_an_s3_index_whose_shard_leaves_the_dataset_is_refused(
    no_env_creds, tmp_path, bpe_dir, path, why
) -> None:
    """The object it names exists, with the sha256 the index gives: only its key leaves
    the dataset's prefix, and it is never read."""
    bucket = no_env_creds
    uri = f"s3://{bucket.name}/ds"
    spec = _spec(bucket, uri, tmp_path, bpe_dir)
    src, _ = _corpus(tmp_path)
    prepare(
        str(src), load_tokenizer(spec.tokenizer, cache_dir=str(tmp_path / "tc")), uri,
        shard_tokens=3_000, endpoint_url=bucket.endpoint_url,
        storage_options=CREDS, progress=False,
    )  # fmt: skip
    body = bucket.client.get_object(Bucket=bucket.name, Key="ds/shard-00000.npy")["Body"].read()
    bucket.client.put_object(Bucket=bucket.name, Key="other/outside.npy", Body=body)
    index = json.loads(
        bucket.client.get_object(Bucket=bucket.name, Key="ds/index.json")["Body"].read()
    )
    path = path.format(bucket=bucket.name)
    index["shards"][0]["path"] = path
    bucket.client.put_object(Bucket=bucket.name, Key="ds/index.json", Body=json.dumps(index))
    with pytest.raises(DataError) as ei:
        read_index(uri, endpoint_url=bucket.endpoint_url, storage_options=CREDS)
    assert str(ei.value).startswith(
        f"data.uri: {uri}/index.json shard 0 path {path!r} leaves the dataset ("
    )
    with pytest.raises(DataError, match=why):
        TokenDataset(spec)
    assert not (tmp_path / "cache" / "shards").exists()


def test_prepare_onto_an_s3_dataset_needs_overwrite_and_leaves_no_stale_shard(
    no_env_creds, tmp_path, bpe_dir
) -> None:
    from spotline.data import ByteTokenizer

    bucket = no_env_creds
    tok = load_tokenizer(
        load_spec(None, {"tokenizer.kind": "huggingface", "tokenizer.path": str(bpe_dir)})
        .tokenizer,
        cache_dir=str(tmp_path / "tc"),
    )  # fmt: skip
    src, _ = _corpus(tmp_path)
    uri = f"s3://{bucket.name}/ds"
    kw = dict(endpoint_url=bucket.endpoint_url, storage_options=CREDS, progress=False)

    def keys() -> set[str]:
        listed = bucket.client.list_objects_v2(Bucket=bucket.name, Prefix="ds/")["Contents"]
        return {o["Key"].removeprefix("ds/") for o in listed}

    # A neighbour whose name starts with the same letters is not in the way.
    bucket.client.put_object(Bucket=bucket.name, Key="ds-other/index.json", Body=b"{}")
    byte = prepare(str(src), ByteTokenizer(), uri, shard_tokens=3_000, **kw)
    before = {k: bucket.client.head_object(Bucket=bucket.name, Key=f"ds/{k}")["ETag"]
              for k in keys()}  # fmt: skip
    with pytest.raises(DataError, match=rf"^--out {uri} holds a finished dataset .*--overwrite"):
        prepare(str(src), tok, uri, shard_tokens=3_000, **kw)
    assert {k: bucket.client.head_object(Bucket=bucket.name, Key=f"ds/{k}")["ETag"]
            for k in keys()} == before  # fmt: skip

    index = prepare(str(src), tok, uri, shard_tokens=3_000, overwrite=True, **kw)
    assert len(index["shards"]) < len(byte["shards"])  # fewer shards: the old tail must go
    shards = {s["path"] for s in index["shards"]} | {s["docs_path"] for s in index["shards"]}
    assert {k for k in keys() if k.startswith("shard-")} == shards
    records = {k for k in keys() if k.startswith("_parts/shard-")}
    assert records == {f"_parts/shard-{k:05d}.json" for k in range(len(index["shards"]))}
    got, _ = read_index(uri, endpoint_url=bucket.endpoint_url, storage_options=CREDS)
    assert got == index
