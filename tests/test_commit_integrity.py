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

from spotline.checkpoint import CheckpointStore, Manifest
from spotline.checkpoint.coordinator import CommitCoordinator
from spotline.checkpoint.manifest import sign
from spotline.checkpoint.transfer import UploadResult
from spotline.config import load_spec

if TYPE_CHECKING:
    pass

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
