"""Integrity of the commit protocol, through the real CheckpointStore and CommitCoordinator
(file://, and moto's S3 server for a planted receipt). No Ray.

- A step rebuilt from receipts read back from storage commits only when the receipts
  are signed with the job's key (when one is set) and name this job and its spec.
- A step that fails verification is quarantined once an older one loaded: kept, never
  read again, never counted by keep_last.
- file:// data files and the directories that lead to them are on disk before the
  manifest that names them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from spotline.checkpoint import (
    CheckpointStore,
    CorruptCheckpointError,
    FileEntry,
    Manifest,
    StorageError,
)
from spotline.checkpoint.coordinator import CommitCoordinator
from spotline.checkpoint.manifest import sign
from spotline.checkpoint.transfer import UploadResult
from spotline.config import load_spec

if TYPE_CHECKING:
    from conftest import S3Bucket

pytestmark = pytest.mark.unit

KEY_ENV = "SPOTLINE_TEST_RECEIPT_KEY"
KEY = b"k" * 32


def _spec(tmp_path: Path, uri: str | None = None, key_env: str | None = None, seed: int = 1):
    raw = {
        "name": "integ",
        "model": {"n_layers": 2},
        "train": {"steps": 100, "global_batch_size": 4},
        "data": {"seed": seed},
        "checkpoint": {
            "uri": uri or f"file://{tmp_path}/ckpt",
            "interval_steps": 10,
            "keep_last": 2,
            "staging_dir": str(tmp_path / "stage"),
            "signing_key_env": key_env,
        },
    }
    return load_spec(raw)


def _identity(spec) -> dict[str, Any]:
    return {"job": spec.name, "spec_hash": spec.spec_hash(), "spec": spec.hashed_fields()}


def _upload(store: CheckpointStore, tmp_path: Path, step: int, attempt: str, rank: int):
    local = tmp_path / f"src-{step}-{attempt}-{rank}.bin"
    local.write_bytes(os.urandom(256))
    rel = f"a-{attempt}/rank_{rank:05d}/state.safetensors"
    return store.upload_file(local, step, rel)


def _receipt(step, attempt, rank, world, files, identity, key=None) -> bytes:
    """A receipt as a rank writes one (signed with `key`), or as someone planting one
    without the key would."""
    raw = {
        **identity,
        "step": step,
        "attempt": attempt,
        "rank": rank,
        "world_size": world,
        "files": [dataclasses.asdict(f) for f in files],
        "index": [],
        "batch": None,
    }
    if key is not None:
        raw["signature"] = sign(raw, key)
    return json.dumps(raw).encode()


def _receipt_rel(store: CheckpointStore, step: int, attempt: str, rank: int) -> str:
    return f"{store.step_name(step)}/_receipts/{attempt}/rank_{rank:05d}.json"


def _plant_local(store, tmp_path, step, attempt, world, identity, key=None) -> None:
    root = Path(store.uri.removeprefix("file://"))
    for rank in range(world):
        entry = _upload(store, tmp_path, step, attempt, rank)
        path = root / _receipt_rel(store, step, attempt, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_receipt(step, attempt, rank, world, [entry], identity, key))


def _coordinator(spec, store) -> tuple[CommitCoordinator, list[str]]:
    log: list[str] = []
    return CommitCoordinator(spec, store, lambda msg, *a: log.append(msg)), log


class Group:
    """Loads a step the way workers do: every file is read and checked against the manifest."""

    replicas, attempt = 1, "g"

    def __init__(self, store: CheckpointStore):
        self.store = store
        self.loaded: list[int] = []

    def restore(self, manifest: Manifest) -> int:
        self.loaded.append(manifest.step)
        self.store.verify_remote(manifest)
        return manifest.step


# --- receipts ---------------------------------------------------------------------------


@pytest.fixture
def signed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A job that signs with a key, and its file:// store."""
    monkeypatch.setenv(KEY_ENV, KEY.decode())
    spec = _spec(tmp_path, key_env=KEY_ENV)
    return spec, CheckpointStore(spec.checkpoint.uri, signing_key_env=KEY_ENV)


def test_planted_unsigned_or_badly_signed_receipts_never_commit(tmp_path: Path, signed) -> None:
    spec, store = signed
    coord, log = _coordinator(spec, store)
    # Whoever can write the bucket, but does not hold the key, plants newer steps with
    # this job's name and spec hash (both can be read from any manifest).
    _plant_local(store, tmp_path, 20, "evil", 1, _identity(spec))
    _plant_local(store, tmp_path, 30, "evil", 1, _identity(spec), key=b"x" * 32)
    assert coord.commit_from_storage() == []
    assert store.committed_steps() == []
    assert any("step 20" in m and "receipt is not signed" in m for m in log), log
    assert any("step 30" in m and "signature does not verify" in m for m in log), log
    # Refused once, not again at every restore.
    assert coord.commit_from_storage() == [] and len(log) == 2
    group = Group(store)
    assert coord.restore(group, sleep=lambda s: None) == (0, None) and group.loaded == []
    # The job's own receipts, signed with its key, do commit.
    _plant_local(store, tmp_path, 40, "att1", 2, _identity(spec), key=KEY)
    (done,) = coord.commit_from_storage()
    assert done.step == 40 and store.committed_steps() == [40]


def test_a_planted_receipt_on_s3_never_commits(
    s3_bucket: S3Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, KEY.decode())
    spec = _spec(tmp_path, uri=s3_bucket.uri(), key_env=KEY_ENV)
    store = CheckpointStore(
        s3_bucket.uri(), endpoint_url=s3_bucket.endpoint_url, signing_key_env=KEY_ENV
    )
    entry = _upload(store, tmp_path, 20, "evil", 0)
    s3_bucket.client.put_object(
        Bucket=s3_bucket.name,
        Key="ckpt/" + _receipt_rel(store, 20, "evil", 0),
        Body=_receipt(20, "evil", 0, 1, [entry], _identity(spec)),
    )
    coord, log = _coordinator(spec, store)
    assert coord.commit_from_storage() == []
    assert store.committed_steps() == []
    assert any("receipt is not signed" in m for m in log), log


def test_receipts_of_another_job_or_without_one_never_commit(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    store = CheckpointStore(spec.checkpoint.uri)
    coord, log = _coordinator(spec, store)
    _plant_local(store, tmp_path, 10, "a", 1, {**_identity(spec), "job": "other"})
    _plant_local(store, tmp_path, 20, "b", 1, {})  # no job, no spec hash
    assert coord.commit_from_storage() == []
    assert store.committed_steps() == []
    assert any("step 10" in m and "belongs to job 'other'" in m for m in log), log
    assert any("step 20" in m and "receipt is malformed" in m for m in log), log


def test_receipts_of_another_spec_are_refused_naming_what_changed(tmp_path: Path) -> None:
    """Killed after its receipts landed, before the commit; resubmitted with another seed."""
    old = _spec(tmp_path)
    store = CheckpointStore(old.checkpoint.uri)
    _plant_local(store, tmp_path, 10, "att0", 2, _identity(old))
    new = _spec(tmp_path, seed=2)
    coord, log = _coordinator(new, store)
    group = Group(store)
    assert coord.restore(group, sleep=lambda s: None) == (0, None)
    assert group.loaded == [] and store.committed_steps() == []
    (msg,) = [m for m in log if "step 10" in m]
    assert "not committed" in msg and "data.seed: 1 there, 2 here" in msg, msg
    # The same spec as the one that wrote them commits them.
    (done,) = _coordinator(old, store)[0].commit_from_storage()
    assert done.step == 10


def test_a_rank_signs_its_receipt_with_the_job_and_spec(tmp_path: Path, signed) -> None:
    from spotline.checkpoint.layout import RankFiles
    from spotline.checkpoint.transfer import Uploader

    spec, store = signed

    def write(d: Path) -> RankFiles:
        (d / "state.safetensors").write_bytes(b"s" * 64)
        return RankFiles(entries=[], files={})

    up = Uploader(store, spec, 0, 1, "att7")
    up.submit(10, tmp_path / "stage" / "r0", write, losses=[(9, 2.5), (10, 2.25)])
    assert up.wait(30)
    (result,) = up.take_done()
    assert result.error is None
    root = Path(store.uri.removeprefix("file://"))
    raw = json.loads((root / _receipt_rel(store, 10, "att7", 0)).read_bytes())
    assert (raw["job"], raw["spec_hash"], raw["attempt"]) == ("integ", spec.spec_hash(), "att7")
    assert raw["signature"] == sign({k: v for k, v in raw.items() if k != "signature"}, KEY)
    coord, log = _coordinator(spec, store)
    done = coord.commit_from_storage()
    assert [d.step for d in done] == [10], log
    # The losses of the steps since the rank's previous save travel with the commit.
    assert done[0].losses == [(9, 2.5), (10, 2.25)]


@pytest.mark.parametrize("losses", [{"9": 2.5}, [[9]], [["9", 2.5]], [[9, "2.5"]], [[True, 1.0]]])
def test_a_receipt_whose_losses_are_not_step_loss_pairs_is_refused(
    tmp_path: Path, losses: object
) -> None:
    from spotline.checkpoint.manifest import ManifestError, Receipt

    spec = _spec(tmp_path)
    raw = json.loads(_receipt(10, "g", 0, 1, [], _identity(spec)))
    assert Receipt.from_json(json.dumps(raw)).losses == []  # a receipt may carry none
    with pytest.raises(ManifestError, match="wrong type"):
        Receipt.from_json(json.dumps({**raw, "losses": losses}))


# --- quarantine ---------------------------------------------------------------------------


def _commit(coord: CommitCoordinator, store, tmp_path: Path, step: int, attempt: str) -> None:
    entry = _upload(store, tmp_path, step, attempt, 0)
    coord.expect(step, attempt, 1)
    (done,) = coord.receive([UploadResult(step, 0, attempt, 1, [entry], [])])
    assert done.step == step
    coord.retain()  # as the controller's loop does after each step


def _flip(store: CheckpointStore, step: int, entry: FileEntry) -> Path:
    path = Path(store.uri.removeprefix("file://")) / store.step_name(step) / entry.path
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def test_a_step_that_fails_verification_is_quarantined_and_not_counted(tmp_path: Path) -> None:
    spec = _spec(tmp_path)  # keep_last: 2
    store = CheckpointStore(spec.checkpoint.uri)
    coord, log = _coordinator(spec, store)
    _commit(coord, store, tmp_path, 10, "att0")
    _commit(coord, store, tmp_path, 20, "att0")
    (entry,) = store.load_manifest(20).files
    bad = _flip(store, 20, entry)

    group = Group(store)
    assert coord.restore(group, sleep=lambda s: None)[0] == 10
    assert group.loaded == [20, 10]
    (msg,) = [m for m in log if "quarantined" in m]
    assert "step 20" in msg and entry.path in msg and "delete that folder" in msg, msg
    record = json.loads((bad.parents[2] / "quarantine.json").read_text())
    assert record["file"] == entry.path and "sha256" in record["reason"]
    assert bad.exists()  # kept for inspection
    assert store.committed_steps() == [10] and store.quarantined_steps() == [20]

    # A restarted controller never reads step 20 again.
    coord2, log2 = _coordinator(spec, store)
    read: list[int] = []
    real = store.load_manifest
    store.load_manifest = lambda step: read.append(step) or real(step)  # type: ignore[method-assign]
    group2 = Group(store)
    assert coord2.restore(group2, sleep=lambda s: None)[0] == 10
    assert group2.loaded == [10] and read == [10] and log2 == []
    assert coord2.quarantined == [20]

    # keep_last counts good steps only: after step 30 commits, step 10 is still there.
    _commit(coord2, store, tmp_path, 30, "att1")
    assert store.committed_steps() == [10, 30]
    assert bad.exists() and store.quarantined_steps() == [20]

    # The job saves step 20 again: it commits beside the quarantined files, which stay.
    _commit(coord2, store, tmp_path, 20, "att2")
    assert store.committed_steps() == [20, 30] and store.quarantined_steps() == []
    assert bad.exists() and (bad.parents[2] / "quarantine.json").exists()


def test_a_live_commit_lists_its_files_after_its_manifest_and_before_retention(
    tmp_path: Path, monkeypatch
) -> None:
    """Every rank reported its upload done: the manifest is written without a listing, and
    the step's files are listed once, by the retention that follows, before it deletes."""
    spec = _spec(tmp_path)
    store = CheckpointStore(spec.checkpoint.uri)
    coord, _ = _coordinator(spec, store)
    listed: list[str] = []
    real = store.fs.find
    monkeypatch.setattr(
        store.fs, "find", lambda path, **kw: listed.append(path) or real(path, **kw)
    )
    entry = _upload(store, tmp_path, 10, "att0", 0)
    coord.expect(10, "att0", 1)
    (done,) = coord.receive([UploadResult(10, 0, "att0", 1, [entry], [])])
    assert done.step == 10 and store.committed_steps() == [10]
    assert listed == []
    coord.retain()
    assert listed == [f"{store.step_path(10)}/a-att0"]
    coord.retain()  # listed once
    assert listed == [f"{store.step_path(10)}/a-att0"]


def test_a_step_whose_file_vanished_after_its_upload_is_quarantined_before_anything_goes(
    tmp_path: Path,
) -> None:
    """A file gone from storage after its rank reported the upload done: the retention
    after the commit finds it, quarantines the step and deletes nothing older for it."""
    spec = _spec(tmp_path)  # keep_last: 2
    store = CheckpointStore(spec.checkpoint.uri)
    coord, log = _coordinator(spec, store)
    _commit(coord, store, tmp_path, 10, "att0")
    _commit(coord, store, tmp_path, 20, "att0")
    entry = _upload(store, tmp_path, 30, "att0", 0)
    coord.expect(30, "att0", 1)
    (done,) = coord.receive([UploadResult(30, 0, "att0", 1, [entry], [])])
    assert done.step == 30 and store.committed_steps() == [10, 20, 30]
    (Path(store.uri.removeprefix("file://")) / store.step_name(30) / entry.path).unlink()

    coord.retain()
    assert store.committed_steps() == [10, 20] and store.quarantined_steps() == [30]
    assert coord.committed == [10, 20] and coord.quarantined == [30]
    (msg,) = [m for m in log if "quarantined" in m]
    assert "step 30" in msg and entry.path in msg and "is not in storage" in msg, msg
    assert "deleted nothing older" in msg and "delete that folder" in msg, msg
    group = Group(store)
    assert coord.restore(group, sleep=lambda s: None)[0] == 20
    assert group.loaded == [20]


def test_a_step_lacking_a_file_that_cannot_be_set_aside_holds_retention_back(
    tmp_path: Path, monkeypatch
) -> None:
    """The quarantine record of a step that lacks a file cannot be written: nothing is
    deleted until it is, which is tried again in a while."""
    spec = _spec(tmp_path)  # keep_last: 2
    store = CheckpointStore(spec.checkpoint.uri)
    now = [1000.0]
    log: list[str] = []
    coord = CommitCoordinator(spec, store, lambda msg, *a: log.append(msg), wall=lambda: now[0])
    _commit(coord, store, tmp_path, 10, "att0")
    _commit(coord, store, tmp_path, 20, "att0")
    entry = _upload(store, tmp_path, 30, "att0", 0)
    coord.expect(30, "att0", 1)
    coord.receive([UploadResult(30, 0, "att0", 1, [entry], [])])
    (Path(store.uri.removeprefix("file://")) / store.step_name(30) / entry.path).unlink()
    real = store.quarantine

    def throttled(*args: Any) -> str:
        raise StorageError("throttled")

    monkeypatch.setattr(store, "quarantine", throttled)
    coord.retain()
    assert store.committed_steps() == [10, 20, 30] and any("could not quarantine" in m for m in log)
    coord.retain()  # not again at once
    assert sum("could not quarantine" in m for m in log) == 1
    monkeypatch.setattr(store, "quarantine", real)
    now[0] += 31
    coord.retain()
    assert store.committed_steps() == [10, 20] and store.quarantined_steps() == [30]


def test_when_every_step_fails_nothing_is_quarantined(tmp_path: Path) -> None:
    """Every step failing may be the job's own doing (a wrong key): the steps stay."""
    spec = _spec(tmp_path)
    store = CheckpointStore(spec.checkpoint.uri)
    coord, _ = _coordinator(spec, store)
    _commit(coord, store, tmp_path, 10, "att0")
    (entry,) = store.load_manifest(10).files
    _flip(store, 10, entry)
    with pytest.raises(CorruptCheckpointError, match="every committed checkpoint"):
        coord.restore(Group(store), sleep=lambda s: None)
    assert store.committed_steps() == [10] and store.quarantined_steps() == []


# --- durability -------------------------------------------------------------------------


def test_data_files_and_their_directories_are_fsynced_before_the_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _spec(tmp_path)
    store = CheckpointStore(spec.checkpoint.uri)
    coord, _ = _coordinator(spec, store)
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    entries = [_upload(store, tmp_path, 10, "att0", rank) for rank in range(2)]
    coord.expect(10, "att0", 2)
    coord.receive([UploadResult(10, r, "att0", 2, [e], []) for r, e in enumerate(entries)])
    assert store.committed_steps() == [10]

    step_dir = Path(store.uri.removeprefix("file://")) / store.step_name(10)
    manifest_at = next(i for i, p in enumerate(synced) if ".manifest.json." in p)
    before = set(synced[:manifest_at])
    for e in entries:
        assert str(step_dir / e.path) in before, synced
        assert str((step_dir / e.path).parent) in before, synced
    assert {str(step_dir), str(step_dir / "a-att0"), str(step_dir.parent)} <= before, synced


# --- load retries -----------------------------------------------------------------------


class FlakyGroup:
    """Fails its first `failures` loads with `error`, then loads."""

    replicas, attempt = 1, "g"

    def __init__(self, failures: int, error: Exception):
        self.failures, self.error, self.calls = failures, error, 0

    def restore(self, manifest: Manifest) -> int:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return manifest.step


def test_a_load_error_is_retried_a_bounded_number_of_times_then_goes_up(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    store = CheckpointStore(spec.checkpoint.uri)
    coord, log = _coordinator(spec, store)  # load_retries: 2
    _commit(coord, store, tmp_path, 10, "att0")
    slept: list[float] = []

    group = FlakyGroup(2, RuntimeError("gloo hiccup"))
    assert coord.restore(group, sleep=slept.append)[0] == 10
    assert group.calls == 3 and slept == [1.0, 1.0]
    retried = [m for m in log if "retrying" in m]
    assert retried == [
        f"loading checkpoint step 10 failed (gloo hiccup); retrying ({n}/2)" for n in (1, 2)
    ]

    group = FlakyGroup(3, RuntimeError("still broken"))
    with pytest.raises(RuntimeError, match="still broken"):
        coord.restore(group, sleep=slept.append)
    assert group.calls == 3

    dead = RuntimeError("worker died")
    dead.process_died = True  # type: ignore[attr-defined]
    for error in (dead, StorageError("unreachable")):
        group = FlakyGroup(1, error)
        with pytest.raises(type(error)):
            coord.restore(group, sleep=slept.append)
        assert group.calls == 1  # a dead worker or an outage is not retried here
