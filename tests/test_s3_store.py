"""Checkpoint store on s3:// against moto's S3 server on 127.0.0.1 (see conftest.py).

These run the real request paths, s3fs/aiobotocore for reads and listings and boto3's
managed transfer for uploads; nothing inside either client is replaced. No Ray. Tampering goes through a plain boto3 client, as another program
(or a failing disk) would.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from spotline.checkpoint import (
    CheckpointStore,
    CorruptCheckpointError,
    Manifest,
    StorageError,
)
from spotline.checkpoint.retention import apply_retention
from test_checkpoint_store import first_shard, make_staging, save_step, tree

if TYPE_CHECKING:
    from conftest import S3Bucket

pytestmark = pytest.mark.unit


def _store(bucket: S3Bucket, prefix: str = "ckpt", **kw) -> CheckpointStore:
    return CheckpointStore(bucket.uri(prefix), endpoint_url=bucket.endpoint_url, **kw)


def _key(store: CheckpointStore, step: int, relpath: str) -> str:
    prefix = store.uri.split("/", 3)[3]
    return f"{prefix}/{store.step_name(step)}/{relpath}"


def _flip_remote_byte(bucket: S3Bucket, key: str, offset: int = 100) -> None:
    data = bytearray(bucket.client.get_object(Bucket=bucket.name, Key=key)["Body"].read())
    data[offset] ^= 0xFF
    bucket.client.put_object(Bucket=bucket.name, Key=key, Body=bytes(data))


def _keys(bucket: S3Bucket) -> list[str]:
    pages = bucket.client.get_paginator("list_objects_v2").paginate(Bucket=bucket.name)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def test_round_trip_and_uncommitted_steps_are_ignored(s3_bucket: S3Bucket, tmp_path: Path) -> None:
    store = _store(s3_bucket)
    assert store.committed_steps() == []
    manifest = save_step(store, 100, tmp_path)
    store.upload_dir(make_staging(tmp_path / "partial", 200), 200)  # never committed
    assert store.committed_steps() == [100]
    assert store.load_manifest(100) == manifest
    assert store.latest_manifest() == manifest
    store.verify_remote(manifest)
    for path, data in tree(tmp_path / "staging_100").items():
        assert store.read_range(100, path, 0, len(data)) == data


def test_store_at_bucket_root(s3_bucket: S3Bucket, tmp_path: Path) -> None:
    store = _store(s3_bucket, prefix="")
    save_step(store, 1, tmp_path)
    assert store.committed_steps() == [1]
    assert any(k == "step_00000001/manifest.json" for k in _keys(s3_bucket))


def test_verify_remote_detects_a_flipped_and_a_missing_object(
    s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    store = _store(s3_bucket)
    manifest = save_step(store, 100, tmp_path)
    _flip_remote_byte(s3_bucket, _key(store, 100, first_shard(100)))
    with pytest.raises(CorruptCheckpointError) as ei:
        store.verify_remote(manifest)
    assert (ei.value.step, ei.value.path) == (100, first_shard(100))
    s3_bucket.client.delete_object(Bucket=s3_bucket.name, Key=_key(store, 100, first_shard(100)))
    with pytest.raises(CorruptCheckpointError, match="missing from storage"):
        store.verify_remote(manifest)


def test_retention_on_s3(s3_bucket: S3Bucket, tmp_path: Path) -> None:
    store = _store(s3_bucket)
    for step in (100, 200, 300):
        save_step(store, step, tmp_path)
    store.upload_dir(make_staging(tmp_path / "p150", 150), 150)
    store.upload_dir(make_staging(tmp_path / "p400", 400), 400)
    assert apply_retention(store, keep_last=1) == [100, 150, 200]
    assert store.committed_steps() == [300]
    steps_left = {k.split("/")[1] for k in _keys(s3_bucket)}
    assert steps_left == {"step_00000300", "step_00000400"}


def test_large_file_goes_multipart_and_round_trips(s3_bucket: S3Bucket, tmp_path: Path) -> None:
    store = _store(s3_bucket, multipart_chunksize=5 * 2**20)
    big = tmp_path / "staging" / "rank_0" / "model_states.pt"
    big.parent.mkdir(parents=True)
    big.write_bytes(random.Random(1).randbytes(12 * 2**20 + 3))
    files = store.upload_dir(tmp_path / "staging", 7)
    head = s3_bucket.client.head_object(Bucket=s3_bucket.name, Key=_key(store, 7, files[0].path))
    assert head["ContentLength"] == 12 * 2**20 + 3
    assert head["ETag"].strip('"').endswith("-3")  # 5 + 5 + 2 MiB parts: a multipart upload
    manifest = Manifest(7, files, {}, {"next_step": 7}, "h", 0.0)
    store.commit(manifest)
    store.verify_remote(store.load_manifest(7))
    data = big.read_bytes()
    assert store.read_range(7, "rank_0/model_states.pt", 0, len(data)) == data
    # A ranged read across a part boundary, as a restoring rank reads its fragments.
    assert (
        store.read_range(7, "rank_0/model_states.pt", 5 * 2**20 - 7, 20)
        == data[5 * 2**20 - 7 : 5 * 2**20 + 13]
    )


def test_uploads_use_the_storage_options_credentials_and_extra_args(
    s3_bucket: S3Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No credentials in the environment: only storage_options can sign the upload.
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    options = {
        "key": "testing",
        "secret": "testing",
        "s3_additional_kwargs": {"ServerSideEncryption": "AES256"},
    }
    store = _store(s3_bucket, storage_options=options)
    files = store.upload_dir(make_staging(tmp_path / "s", 3), 3)
    head = s3_bucket.client.head_object(Bucket=s3_bucket.name, Key=_key(store, 3, files[0].path))
    assert head["ServerSideEncryption"] == "AES256"


def test_an_option_boto3_cannot_take_keeps_the_s3fs_upload(
    s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    # `use_ssl` has no boto3 transfer equivalent here: the upload must not drop it
    # silently, so it goes through s3fs, which honours it.
    store = _store(s3_bucket, storage_options={"use_ssl": False})
    manifest = save_step(store, 5, tmp_path)
    store.verify_remote(manifest)
    assert store._backend._upload_client() is None


def test_upload_to_a_missing_bucket_names_the_bucket(tmp_path: Path, s3_bucket: S3Bucket) -> None:
    store = CheckpointStore("s3://no-such-bucket-here/x", endpoint_url=s3_bucket.endpoint_url)
    with pytest.raises(StorageError) as ei:
        store.upload_dir(make_staging(tmp_path / "s", 1), 1)
    msg = str(ei.value)
    assert "'no-such-bucket-here' does not exist" in msg and "aws s3 mb" in msg


def test_check_writable_passes_and_leaves_nothing(s3_bucket: S3Bucket) -> None:
    store = _store(s3_bucket)
    store.check_writable(timeout_s=10)
    assert _keys(s3_bucket) == []


def test_missing_bucket_is_a_storage_error(s3_bucket: S3Bucket) -> None:
    store = CheckpointStore("s3://no-such-bucket-here/x", endpoint_url=s3_bucket.endpoint_url)
    with pytest.raises(StorageError) as ei:
        store.check_writable(timeout_s=10)
    msg = str(ei.value)
    assert "checkpoint.uri" in msg and "'no-such-bucket-here' does not exist" in msg


def test_unreachable_endpoint_is_a_storage_error(s3_bucket: S3Bucket) -> None:
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    store = CheckpointStore(s3_bucket.uri(), endpoint_url=endpoint)
    with pytest.raises(StorageError) as ei:
        store.check_writable(timeout_s=10)
    msg = str(ei.value)
    assert f"cannot reach the S3 endpoint {endpoint}" in msg
    assert "checkpoint.endpoint_url" in msg


def test_missing_credentials_are_a_storage_error(s3_server: str, aws_isolated_env: None) -> None:
    store = CheckpointStore("s3://some-bucket/ckpt", endpoint_url=s3_server)
    with pytest.raises(StorageError) as ei:
        store.check_credentials()
    msg = str(ei.value)
    assert msg.startswith("no AWS credentials found for s3://some-bucket/ckpt: ")
    assert "AWS_ACCESS_KEY_ID" in msg and "AWS_PROFILE" in msg
    with pytest.raises(StorageError, match="no AWS credentials"):
        store.check_writable(timeout_s=10)


def test_credentials_from_storage_options(s3_server: str, aws_isolated_env: None) -> None:
    import boto3

    boto3.client(
        "s3", endpoint_url=s3_server, aws_access_key_id="k", aws_secret_access_key="s"
    ).create_bucket(Bucket="spotline-opts-creds")
    store = CheckpointStore(
        "s3://spotline-opts-creds/ckpt",
        endpoint_url=s3_server,
        storage_options={"key": "k", "secret": "s"},
    )
    store.check_writable(timeout_s=10)


def test_unknown_profile_is_a_storage_error(s3_server: str, aws_isolated_env: None) -> None:
    store = CheckpointStore(
        "s3://some-bucket/ckpt", endpoint_url=s3_server, storage_options={"profile": "nope"}
    )
    with pytest.raises(StorageError, match="AWS profile 'nope'"):
        store.check_credentials()
