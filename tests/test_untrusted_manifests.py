"""A manifest counts only once it verifies. Through the real CheckpointStore and
CommitCoordinator on file:// (and moto's S3 server for the forged one). No Ray.

- A forged (unsigned) or corrupt manifest at a high step is never the newest commit:
  keep_last deletes no good step for it, no upload in progress below it is abandoned,
  commit-from-storage looks past it, and the next commit quarantines it.
- Each manifest is read once per change, not at every commit.
- A rerun of a finished job whose final manifest is damaged says so, quarantines it
  and trains the missing steps again from the newest good commit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from spotline.checkpoint import CheckpointStore, Manifest
from spotline.checkpoint.coordinator import CommitCoordinator
from test_commit_integrity import KEY, KEY_ENV, _commit, _identity, _plant_local, _spec, _upload

if TYPE_CHECKING:
    from conftest import S3Bucket

pytestmark = pytest.mark.unit

FORGED = 99_999_999


def _coordinator(spec, store) -> tuple[CommitCoordinator, list[str]]:
    log: list[str] = []
    return CommitCoordinator(spec, store, lambda msg, *a: log.append(msg)), log


def _keep_3(spec):
    return spec.model_copy(
        update={"checkpoint": spec.checkpoint.model_copy(update={"keep_last": 3})}
    )


def _plant(store: CheckpointStore, step: int, name: str, data: bytes) -> None:
    """Write a file into a step's folder as anyone who can write the bucket would."""
    store.fs.pipe_file(f"{store.step_path(step)}/{name}", data)


def _folders(store: CheckpointStore) -> list[str]:
    return sorted(
        Path(str(p).rstrip("/")).name
        for p in store.fs.ls(store.backend.root, detail=False)
        if "step_" in str(p)
    )


def _forged_manifest(spec) -> bytes:
    """A well-formed manifest with this job's name and spec hash (both can be read from
    any manifest), written without the key."""
    m = Manifest(
        step=FORGED,
        files=[],
        topology={"replicas": 1, "pipeline_stages": 1, "world_size": 1},
        data_position={"next_step": FORGED, "seed": 1},
        spec_hash=spec.spec_hash(),
        created_at=0.0,
        extra={"job": spec.name, "index": []},
    )
    return m.to_json().encode()


@pytest.fixture(params=["file", "s3"])
def signed_store(request, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A job that signs with a key (keep_last: 3), on file:// or moto's S3."""
    monkeypatch.setenv(KEY_ENV, KEY.decode())
    if request.param == "file":
        spec = _spec(tmp_path, key_env=KEY_ENV)
        store = CheckpointStore(spec.checkpoint.uri, signing_key_env=KEY_ENV)
    else:
        bucket: S3Bucket = request.getfixturevalue("s3_bucket")
        spec = _spec(tmp_path, uri=bucket.uri(), key_env=KEY_ENV)
        store = CheckpointStore(
            bucket.uri(), endpoint_url=bucket.endpoint_url, signing_key_env=KEY_ENV
        )
    return _keep_3(spec), store


def test_a_forged_manifest_deletes_nothing_and_is_quarantined(signed_store, tmp_path: Path) -> None:
    spec, store = signed_store
    coord, log = _coordinator(spec, store)
    for step in (10, 20, 30):
        _commit(coord, store, tmp_path, step, "att0")
    _plant(store, FORGED, "manifest.json", _forged_manifest(spec))
    in_flight = _upload(store, tmp_path, 50, "att1", 0)  # an upload of step 50, not done

    # It is not a commit: nothing newer than step 30 is offered to readers.
    assert store.committed_steps() == [10, 20, 30]

    _commit(coord, store, tmp_path, 40, "att0")
    assert store.committed_steps() == [20, 30, 40]  # keep_last: 3 good steps
    assert store.fs.exists(f"{store.step_path(50)}/{in_flight.path}")
    assert _folders(store) == [
        "step_00000020",
        "step_00000030",
        "step_00000040",
        "step_00000050",
        f"step_{FORGED:08d}",
    ]
    assert store.quarantined_steps() == [FORGED] and coord.quarantined == [FORGED]
    record = json.loads(store.fs.cat_file(store.quarantine_path(FORGED)))
    assert record["file"] == "manifest.json" and "not signed" in record["reason"]
    (msg,) = [m for m in log if "quarantined" in m]
    assert f"step {FORGED}" in msg and "manifest is not signed" in msg, msg
    assert "delete that folder" in msg
    # Said once: the next commit neither quarantines nor reports it again.
    _commit(coord, store, tmp_path, 60, "att0")
    assert len([m for m in log if "quarantined" in m]) == 1
    assert store.committed_steps() == [30, 40, 60] and store.quarantined_steps() == [FORGED]


@pytest.mark.parametrize("damage", ["truncated", "not JSON"])
def test_a_corrupt_manifest_deletes_nothing_and_commit_from_storage_looks_past_it(
    tmp_path: Path, damage: str
) -> None:
    spec = _keep_3(_spec(tmp_path))  # no key: a manifest only has to parse
    store = CheckpointStore(spec.checkpoint.uri)
    coord, log = _coordinator(spec, store)
    for step in (10, 20):
        _commit(coord, store, tmp_path, step, "att0")
    real = store.fs.cat_file(store.manifest_path(20))
    bad = real[: len(real) // 2] if damage == "truncated" else b"\x00\x01 not a manifest"
    _plant(store, FORGED, "manifest.json", bad)

    # A restarted controller: the receipts of step 40, left by a group that died before
    # reporting them, commit; the damaged step is not taken for a newer commit.
    _plant_local(store, tmp_path, 40, "att1", 2, _identity(spec))
    coord, log = _coordinator(spec, store)
    assert [d.step for d in coord.commit_from_storage()] == [40]
    assert store.committed_steps() == [10, 20, 40]

    in_flight = _upload(store, tmp_path, 60, "att2", 0)
    _commit(coord, store, tmp_path, 50, "att0")
    assert store.committed_steps() == [20, 40, 50]  # step 10 expired, nothing else
    assert store.fs.exists(f"{store.step_path(60)}/{in_flight.path}")
    assert store.quarantined_steps() == [FORGED]
    record = json.loads(store.fs.cat_file(store.quarantine_path(FORGED)))
    assert record["file"] == "manifest.json" and "not valid JSON" in record["reason"]
    assert any(f"quarantined checkpoint step {FORGED}" in m for m in log), log


def test_each_manifest_is_read_once_until_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _spec(tmp_path)  # keep_last: 2
    store = CheckpointStore(spec.checkpoint.uri)
    coord, _ = _coordinator(spec, store)
    reads: list[str] = []
    real = store.fs.cat_file
    monkeypatch.setattr(
        store.fs, "cat_file", lambda p, *a, **k: reads.append(p) or real(p, *a, **k)
    )
    for step in (10, 20, 30, 40):
        _commit(coord, store, tmp_path, step, "att0")
    manifests = [p for p in reads if p.endswith("manifest.json")]
    assert sorted(manifests) == sorted(set(manifests)), manifests  # no manifest read twice
    assert store.committed_steps() == [30, 40]
    # A manifest replaced in place is read (and judged) again.
    reads.clear()
    _plant(store, 40, "manifest.json", b"{}")
    assert store.committed_steps() == [30]
    assert [p for p in reads if p.endswith("manifest.json")] == [store.manifest_path(40)]


# --- a finished job's final step ---------------------------------------------------------


def test_a_finished_job_whose_final_manifest_is_damaged_trains_it_again(tmp_path: Path) -> None:
    from controller_fakes import FakeGroup, make

    ctl, store = make(tmp_path)  # commits 10, 20, 25; keep_last 2
    assert ctl.run()["state"] == "finished"
    final = Path(store.manifest_path(25))
    final.write_bytes(final.read_bytes()[:100])  # a copy that stopped short

    again, _ = make(tmp_path)
    res = again.run()
    assert res["state"] == "finished" and res["steps"] == 25
    (group,) = FakeGroup.instances  # a group was started: the job trained again
    assert group.restored == [20]
    assert sorted(res["losses"]) == list(range(21, 26))
    events = again.door.status()["events"]
    (said,) = [e for e in events if "already finished at step 25" in e]
    assert "manifest.json" in said and "not valid JSON" in said and "from step 20" in said, said
    assert not any("reporting it from its stored summary" in e for e in events)
    # Step 25 was set aside for inspection, then committed again beside it.
    assert store.committed_steps() == [20, 25]
    record = json.loads(Path(store.quarantine_path(25)).read_text())
    assert record["file"] == "manifest.json"
    assert store.load_manifest(25).extra["attempt"] == group.attempt
