"""Checkpoint store on the local filesystem (file://): commit protocol, verification,
fallback, URI parsing, paced uploads. No Ray, no network (retention: test_checkpoint_retention.py).

The helpers at the top are shared with test_s3_store.py, which runs the same
protocol against a real S3-protocol server.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import random
import sys
import time
from pathlib import Path

import pytest

from spotline.checkpoint import (
    CheckpointStore,
    CorruptCheckpointError,
    FileEntry,
    Manifest,
    ManifestError,
    StorageError,
    hash_file,
)

pytestmark = pytest.mark.unit

TOPOLOGY = {"pipeline_stages": 2, "replicas": 2, "world_size": 4, "zero_stage": 1}

# A DeepSpeed-like step layout: per-rank model and optimizer shards plus 'latest'.
STEP_FILES = {
    "rank_0/global_step{step}/mp_rank_00_model_states.pt": 3000,
    "rank_0/global_step{step}/zero_pp_rank_0_mp_rank_00_optim_states.pt": 5000,
    "rank_1/global_step{step}/zero_pp_rank_1_mp_rank_00_optim_states.pt": 4000,
    "rank_0/latest": 0,
}


# --- helpers shared with test_s3_store.py ----------------------------------------------


def make_staging(root: Path, step: int) -> Path:
    """Write a fake DeepSpeed save of ``step`` under ``root``; content depends on the step."""
    rng = random.Random(step)
    for pattern, size in STEP_FILES.items():
        path = root / pattern.format(step=step)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(size) if size else f"global_step{step}".encode())
    return root


def save_step(store: CheckpointStore, step: int, tmp_path: Path) -> Manifest:
    """Upload a fake save of ``step`` and commit it; return the manifest."""
    staging = make_staging(tmp_path / f"staging_{step}", step)
    files = store.upload_dir(staging, step)
    manifest = Manifest(
        step=step,
        files=files,
        topology=dict(TOPOLOGY),
        data_position={"next_step": step, "seed": 1234},
        spec_hash="0123456789abcdef",
        created_at=time.time(),
        extra={"global_batch_size": 8},
    )
    store.commit(manifest)
    return manifest


def tree(root: Path) -> dict[str, bytes]:
    """Relative posix path -> content of every file under ``root``."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def first_shard(step: int) -> str:
    return next(iter(STEP_FILES)).format(step=step)


# --- local helpers ---------------------------------------------------------------------


def _root(store: CheckpointStore) -> Path:
    assert store.uri.startswith("file://")
    return Path(store.uri[len("file://") :])


def _flip_byte(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(f"file://{tmp_path}/ckpt")


# --- URIs ------------------------------------------------------------------------------


def test_uri_forms_are_normalized(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert CheckpointStore(f"file://{tmp_path}/a/").uri == f"file://{tmp_path}/a"
    assert CheckpointStore("file://./runs/x").uri == f"file://{tmp_path}/runs/x"
    assert CheckpointStore("runs/y").uri == f"file://{tmp_path}/runs/y"
    assert CheckpointStore(str(tmp_path / "z")).uri == f"file://{tmp_path}/z"
    assert CheckpointStore("s3://my-bucket/some//prefix/").uri == "s3://my-bucket/some/prefix"
    assert CheckpointStore("s3://my-bucket").uri == "s3://my-bucket"


@pytest.mark.parametrize(
    "uri",
    [
        "",
        "   ",
        "s3://",
        "s3:///prefix",
        "ftp://x",
        "file://",
        "gs://bucket/x",
        "s3:/bucket/x",
        "s3://Not_A_Bucket/x",
        "file://data/ckpt",
    ],
)
def test_malformed_uri_names_the_setting_and_the_valid_forms(uri: str) -> None:
    with pytest.raises(StorageError) as ei:
        CheckpointStore(uri)
    msg = str(ei.value)
    assert "checkpoint.uri" in msg
    assert "s3://bucket/prefix" in msg and "file:///absolute/path" in msg


def test_endpoint_url_with_a_local_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="endpoint_url"):
        CheckpointStore(str(tmp_path), endpoint_url="http://127.0.0.1:9000")


def test_store_pickles_with_its_absolute_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    store = CheckpointStore("file://./ckpt")
    save_step(store, 5, tmp_path)
    monkeypatch.chdir("/")
    clone = pickle.loads(pickle.dumps(store))
    assert clone.uri == store.uri
    assert clone.committed_steps() == [5]


# --- manifest --------------------------------------------------------------------------


def test_manifest_json_round_trip() -> None:
    entry = FileEntry("rank_0/a.pt", 3, hashlib.sha256(b"abc").hexdigest())
    m = Manifest(7, [entry], dict(TOPOLOGY), {"next_step": 7, "seed": 1}, "h", 12.5, {"k": [1]})
    again = Manifest.from_json(m.to_json())
    assert again == m
    assert again.total_bytes == 3
    assert json.loads(m.to_json())["format_version"] == 1


@pytest.mark.parametrize("path", ["../x", "/abs", "a/../../b", "a//b", "a\\b", "manifest.json", ""])
def test_file_entry_refuses_paths_outside_the_step_dir(path: str) -> None:
    with pytest.raises(ManifestError):
        FileEntry(path, 1, "0" * 64)


def test_manifest_from_a_newer_format_is_refused() -> None:
    m = Manifest(1, [], {}, {}, "h", 0.0)
    raw = json.loads(m.to_json())
    raw["format_version"] = 99
    with pytest.raises(ManifestError, match="upgrade spotline"):
        Manifest.from_json(json.dumps(raw))


def test_hash_file_matches_hashlib_across_chunks(tmp_path: Path) -> None:
    data = random.Random(0).randbytes(9 * 2**20 + 17)  # more than one 8 MiB chunk
    p = tmp_path / "blob"
    p.write_bytes(data)
    assert hash_file(p) == hashlib.sha256(data).hexdigest()


# --- commit protocol -------------------------------------------------------------------


def test_upload_commit_load_round_trip(store: CheckpointStore, tmp_path: Path) -> None:
    manifest = save_step(store, 100, tmp_path)
    assert store.committed_steps() == [100]
    assert store.load_manifest(100) == manifest
    assert store.latest_manifest() == manifest
    assert manifest.total_bytes == sum(len(b) for b in tree(tmp_path / "staging_100").values())
    store.verify_remote(manifest)
    for path, data in tree(tmp_path / "staging_100").items():
        assert store.read_range(100, path, 0, len(data)) == data


def test_upload_file_entry_describes_the_local_file(store: CheckpointStore, tmp_path: Path) -> None:
    src = tmp_path / "one.bin"
    src.write_bytes(b"hello")
    entry = store.upload_file(src, 3, "sub/one.bin")
    assert entry == FileEntry("sub/one.bin", 5, hashlib.sha256(b"hello").hexdigest())
    assert (_root(store) / "step_00000003" / "sub" / "one.bin").read_bytes() == b"hello"


def test_upload_dir_prefix(store: CheckpointStore, tmp_path: Path) -> None:
    staging = make_staging(tmp_path / "s", 1)
    entries = store.upload_dir(staging, 1, prefix="stage_1")
    assert [e.path for e in entries] == sorted("stage_1/" + p for p in tree(staging))


def test_committed_steps_ignores_dirs_without_manifest(
    store: CheckpointStore, tmp_path: Path
) -> None:
    assert store.committed_steps() == []  # root does not even exist yet
    assert store.latest_manifest() is None
    save_step(store, 100, tmp_path)
    staging = make_staging(tmp_path / "partial", 200)
    store.upload_dir(staging, 200)  # uploaded, never committed
    (_root(store) / "not_a_step").mkdir()
    (_root(store) / "step_junk").mkdir()
    assert store.committed_steps() == [100]
    assert store.latest_manifest().step == 100
    with pytest.raises(FileNotFoundError, match="not committed"):
        store.load_manifest(200)


def test_commit_is_an_atomic_rename(store: CheckpointStore, tmp_path: Path) -> None:
    save_step(store, 1, tmp_path)
    names = sorted(p.name for p in (_root(store) / "step_00000001").iterdir())
    assert names == ["checked.json", "manifest.json", "rank_0", "rank_1"]  # no temp file left


def test_commit_refuses_a_manifest_whose_files_are_not_uploaded(
    store: CheckpointStore, tmp_path: Path
) -> None:
    staging = make_staging(tmp_path / "s", 4)
    files = store.upload_dir(staging, 4)
    (_root(store) / "step_00000004" / files[0].path).unlink()
    manifest = Manifest(4, files, dict(TOPOLOGY), {"next_step": 4}, "h", time.time())
    with pytest.raises(CorruptCheckpointError, match="refusing to commit") as ei:
        store.commit(manifest)
    assert ei.value.path == files[0].path
    assert store.committed_steps() == []


def test_commit_lists_only_the_folders_its_files_are_in(
    store: CheckpointStore, tmp_path: Path, monkeypatch
) -> None:
    """The check before a commit lists the group's folder, not the step's receipts (one
    a rank: a third of a large step's keys); a file missing there is still refused, and a
    manifest with a file at the step's top lists the whole step."""
    files = store.upload_dir(make_staging(tmp_path / "s", 4), 4, prefix="a-g0")
    store.upload_dir(make_staging(tmp_path / "r", 4), 4, prefix="_receipts")
    listed: list[str] = []
    real = store.fs.find
    monkeypatch.setattr(
        store.fs, "find", lambda path, **kw: listed.append(path) or real(path, **kw)
    )
    step_path = store.step_path(4)
    store.commit(Manifest(4, files, dict(TOPOLOGY), {"next_step": 4}, "h", time.time()))
    assert listed == [f"{step_path}/a-g0"]

    more = store.upload_dir(make_staging(tmp_path / "t", 5), 5, prefix="a-g1")
    (tmp_path / "latest").write_text("5")
    top = store.upload_file(tmp_path / "latest", 5, "latest")
    (_root(store) / "step_00000005" / more[-1].path).unlink()
    listed.clear()
    with pytest.raises(CorruptCheckpointError, match="refusing to commit") as ei:
        store.commit(Manifest(5, [*more, top], dict(TOPOLOGY), {"next_step": 5}, "h", time.time()))
    assert ei.value.path == more[-1].path
    assert listed == [store.step_path(5)]


def test_the_newest_verified_manifest_is_not_read_again_until_it_changes(
    store: CheckpointStore, tmp_path: Path, monkeypatch
) -> None:
    """A restore by another controller than the one that committed lists the steps
    (reading and verifying each new manifest), then loads the newest: that one is not
    read again while it is the same object in storage; a rewrite is read and verified
    afresh."""
    save_step(store, 100, tmp_path)
    manifest = save_step(store, 200, tmp_path)
    store = CheckpointStore(store.uri)  # the committer's own knows what it wrote
    reads: list[str] = []
    real = store.fs.cat_file
    monkeypatch.setattr(
        store.fs,
        "cat_file",
        lambda p, *a, **k: (p.endswith("manifest.json") and reads.append(p)) or real(p, *a, **k),
    )
    assert store.list_steps().committed == [100, 200]
    assert len(reads) == 2
    assert store.load_manifest(200).to_json() == manifest.to_json()
    assert store.load_manifest(100).step == 100
    assert len(reads) == 3  # step 100 is read; step 200 is the one kept

    path = _root(store) / "step_00000200" / "manifest.json"
    text = path.read_text().replace('"seed": 1234', '"seed": 43210')
    path.unlink()
    path.write_text(text)  # another object, of another size
    assert store.load_manifest(200).data_position["seed"] == 43210
    assert len(reads) == 4


# --- verification and fallback ---------------------------------------------------------


def test_verify_remote_detects_a_flipped_byte(store: CheckpointStore, tmp_path: Path) -> None:
    manifest = save_step(store, 100, tmp_path)
    bad = first_shard(100)
    _flip_byte(_root(store) / "step_00000100" / bad)
    with pytest.raises(CorruptCheckpointError) as ei:
        store.verify_remote(manifest)
    assert (ei.value.step, ei.value.path) == (100, bad)
    assert "sha256" in ei.value.reason


def test_verify_remote_detects_truncated_and_missing_files(
    store: CheckpointStore, tmp_path: Path
) -> None:
    manifest = save_step(store, 100, tmp_path)
    step_dir = _root(store) / "step_00000100"
    victim = step_dir / manifest.files[-1].path
    victim.write_bytes(victim.read_bytes()[:-1])
    with pytest.raises(CorruptCheckpointError, match="size is"):
        store.verify_remote(manifest)
    victim.unlink()
    with pytest.raises(CorruptCheckpointError, match="missing from storage") as ei:
        store.verify_remote(manifest)
    assert ei.value.path == manifest.files[-1].path


def test_corrupt_checkpoint_error_survives_pickling() -> None:
    e = CorruptCheckpointError(3, "a.pt", "sha256 differs", uri="file:///x")
    again = pickle.loads(pickle.dumps(e))
    assert (again.step, again.path, again.reason, str(again)) == (
        3,
        "a.pt",
        "sha256 differs",
        str(e),
    )


# --- preflight -------------------------------------------------------------------------


def test_check_writable_on_a_local_dir_leaves_nothing_behind(store: CheckpointStore) -> None:
    store.check_writable(timeout_s=10)
    assert list(_root(store).iterdir()) == []


def test_check_writable_fails_under_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    store = CheckpointStore(str(tmp_path / "afile" / "ckpt"))
    with pytest.raises(StorageError, match="checkpoint.uri") as ei:
        store.check_writable(timeout_s=10)
    assert "not a directory" in str(ei.value)


def test_missing_s3_packages_give_the_install_command(monkeypatch) -> None:
    # 's3fs' cannot be imported, as on a plain install.
    from spotline.checkpoint import CheckpointStore, StorageError

    monkeypatch.setitem(sys.modules, "s3fs", None)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StorageError) as e:
        CheckpointStore("s3://bucket/x").committed_steps()
    assert "pip install 'spotline[s3]'" in str(e.value)


# --- paced uploads ---------------------------------------------------------------------


def test_the_rate_pacer_holds_the_average_rate() -> None:
    from spotline.checkpoint.uploads import RatePacer

    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    pacer = RatePacer(100.0, clock=lambda: now[0], sleep=sleep)
    pacer.sent(50)  # 0.5 s worth, sent at once
    now[0] += 2.0  # a slow transfer: already behind the rate
    pacer.sent(100)  # 1.5 s worth by 2.5 s: no wait
    pacer.sent(300)  # 4.5 s worth by 2.5 s: wait 2 s
    assert slept == [0.5, 0.0, 2.0]


def test_a_paced_upload_dir_uploads_every_file(store: CheckpointStore, tmp_path: Path) -> None:
    staging = make_staging(tmp_path / "s", 3)
    files = store.upload_dir(staging, 3, max_bytes_per_s=1e9)
    assert [f.path for f in files] == sorted(tree(staging))
    assert all(f.sha256 == hash_file(staging / f.path) for f in files)


def test_an_upload_takes_the_writers_digest_instead_of_hashing_again(
    store: CheckpointStore, tmp_path: Path
) -> None:
    import hashlib

    from spotline.checkpoint.layout import FileDigest

    local = tmp_path / "staging"
    local.mkdir()
    (local / "a.bin").write_bytes(b"a" * 100)
    (local / "b.bin").write_bytes(b"b" * 100)
    told = "f" * 64  # not the bytes' hash: only a writer's word would put it there
    known = {
        "a.bin": FileDigest(100, told),
        "b.bin": FileDigest(99, told),  # the file changed since: its size says so
    }
    entries = {e.path: e for e in store.upload_dir(local, 1, prefix="r0", known=known)}
    assert entries["r0/a.bin"].sha256 == told
    assert entries["r0/b.bin"].sha256 == hashlib.sha256(b"b" * 100).hexdigest()


def test_a_storage_call_retries_a_dropped_connection_and_never_a_denied_one(tmp_path: Path):
    """Checkpoints retry through the same rule as data's shard downloads
    (`storage.retry.is_transient`): a reset connection passes on the next try; a denied
    access or a missing file goes up at once."""
    from spotline.storage.checkpoint_root import StepStorage

    storage = StepStorage(str(tmp_path))
    calls: list[str] = []

    def reset_once() -> str:
        calls.append("reset")
        if len(calls) == 1:
            raise ConnectionResetError("connection reset by peer")
        return "ok"

    assert storage.retrying(reset_once) == "ok" and calls == ["reset", "reset"]
    for final in (PermissionError("access denied"), FileNotFoundError("no such key")):
        tries: list[int] = []

        def fail(e: BaseException = final, tries: list[int] = tries) -> None:
            tries.append(1)
            raise e

        with pytest.raises(type(final)):
            storage.retrying(fail)
        assert tries == [1]
