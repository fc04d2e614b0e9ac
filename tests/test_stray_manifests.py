"""Only this job's real commits count: a well-formed manifest in the wrong folder, one of
another job or spec, or one whose files are not where it says never counts as a commit,
never makes a real commit go, and never locks the job out of its own commits. Through
the real CheckpointStore and CommitCoordinator on file:// and moto's S3 server. No Ray.

- A copy of the job's own newest manifest renumbered into a high step's folder (what a
  mistaken `cp`, a sync tool or a half-done repair leaves), with and without a signing
  key: not committed, quarantined once with a line naming the folder and what is wrong,
  and keep_last keeps its real steps.
- The same copy under another spec hash or job name: set aside the same way, and a
  restarted job resumes from its own newest commit. A folder with only another job's
  commits is refused before anything is written, saying what is there.
- A manifest whose files were never listed (its controller died before the check) is
  listed by the next reader before it counts; once listed, a `checked.json` spares the
  next reader the listing. A finished job's rerun lists its final step's files.
- A step is handed to a reader outside the job (`hold_latest`) only once its files were
  listed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from spotline.checkpoint import CheckpointMismatchError, CheckpointStore, Manifest
from spotline.checkpoint.transfer import UploadResult
from test_commit_integrity import KEY, KEY_ENV, Group, _commit, _coordinator, _spec, _upload

if TYPE_CHECKING:
    from conftest import S3Bucket

pytestmark = pytest.mark.unit

STRAY = 99_999_999


def _renumbered(store: CheckpointStore, step: int, to: int, key: bytes | None, **extra) -> bytes:
    """The manifest of `step`, renumbered to `to` (and re-signed with `key`: a repair by
    someone who holds it), with `extra` changed: its files stay where they were."""
    m = store.load_manifest(step)
    raw = json.loads(m.to_json())
    raw["step"] = to
    raw["data_position"]["next_step"] = to
    for k, v in extra.items():
        if k == "job":
            raw["extra"]["job"] = v
        else:
            raw[k] = v
    return Manifest.from_json(json.dumps(raw)).to_json(key).encode()


def _plant(store: CheckpointStore, step: int, name: str, data: bytes) -> None:
    store.fs.pipe_file(f"{store.step_path(step)}/{name}", data)


@pytest.fixture(params=["file", "file+key", "s3"])
def job(request, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """(spec, store, key) of a job with keep_last: 2, on file:// (with and without a
    signing key) or moto's S3."""
    if request.param == "s3":
        bucket: S3Bucket = request.getfixturevalue("s3_bucket")
        spec = _spec(tmp_path, uri=bucket.uri())
        return spec, CheckpointStore(bucket.uri(), endpoint_url=bucket.endpoint_url), None
    if request.param == "file+key":
        monkeypatch.setenv(KEY_ENV, KEY.decode())
        spec = _spec(tmp_path, key_env=KEY_ENV)
        return spec, CheckpointStore(spec.checkpoint.uri, signing_key_env=KEY_ENV), KEY
    spec = _spec(tmp_path)
    return spec, CheckpointStore(spec.checkpoint.uri), None


def test_a_renumbered_copy_without_its_files_never_counts(job, tmp_path: Path) -> None:
    spec, store, key = job
    coord, log = _coordinator(spec, store)
    for step in (10, 20):
        _commit(coord, store, tmp_path, step, "att0")
    _plant(store, STRAY, "manifest.json", _renumbered(store, 20, STRAY, key))

    # Not a commit for any reader, a new one included.
    assert store.committed_steps() == [10, 20]
    assert CheckpointStore(store.uri, store.endpoint_url, signing_key_env=store.signing_key_env)\
        .committed_steps() == [10, 20]  # fmt: skip

    _commit(coord, store, tmp_path, 30, "att0")
    assert store.committed_steps() == [20, 30]  # keep_last: 2 real steps, not one
    assert store.quarantined_steps() == [STRAY] and coord.quarantined == [STRAY]
    (msg,) = [m for m in log if "quarantined" in m]
    assert f"step {STRAY}" in msg and store.step_uri(STRAY) in msg, msg
    assert "is not in storage" in msg and "without its files" in msg, msg
    _commit(coord, store, tmp_path, 40, "att0")
    assert len([m for m in log if "quarantined" in m]) == 1  # said once
    assert store.committed_steps() == [30, 40]

    # A restarted controller restores the job's own newest commit.
    again, _ = _coordinator(spec, store)
    group = Group(store)
    assert again.restore(group, sleep=lambda s: None)[0] == 40 and group.loaded == [40]


@pytest.mark.parametrize("whose", ["spec", "job"])
def test_another_jobs_manifest_among_this_jobs_commits_is_set_aside(
    tmp_path: Path, whose: str
) -> None:
    """Two jobs given one checkpoint.uri, or a copy with another spec hash: it neither
    counts nor locks this job out of its own commits."""
    spec = _spec(tmp_path)
    store = CheckpointStore(spec.checkpoint.uri)
    coord, log = _coordinator(spec, store)
    for step in (10, 20):
        _commit(coord, store, tmp_path, step, "att0")
    other = {"spec_hash": "0123456789abcdef"} if whose == "spec" else {"job": "someone-else"}
    # Its files are there too: only whose it is tells it apart.
    for entry in store.load_manifest(20).files:
        store.fs.copy(
            f"{store.step_path(20)}/{entry.path}", f"{store.step_path(STRAY)}/{entry.path}"
        )
    _plant(store, STRAY, "manifest.json", _renumbered(store, 20, STRAY, None, **other))

    _commit(coord, store, tmp_path, 30, "att0")
    assert store.committed_steps() == [20, 30]
    assert store.quarantined_steps() == [STRAY]
    (msg,) = [m for m in log if "quarantined" in m]
    said = "spec hash 0123456789abcdef" if whose == "spec" else "job 'someone-else'"
    assert said in msg and store.step_uri(STRAY) in msg, msg

    # Before it was set aside: the rerun starts (the owner check passes on the job's own
    # commit) and resumes from it, saying what it passed over.
    _plant(store, STRAY + 1, "manifest.json", _renumbered(store, 30, STRAY + 1, None, **other))
    for entry in store.load_manifest(30).files:
        store.fs.copy(
            f"{store.step_path(30)}/{entry.path}", f"{store.step_path(STRAY + 1)}/{entry.path}"
        )
    store.check_owner(spec)
    again, log = _coordinator(spec, store)
    again.check_owner()
    group = Group(store)
    assert again.restore(group, sleep=lambda s: None)[0] == 30 and group.loaded == [30]
    assert any(f"step {STRAY + 1}" in m and said in m for m in log), log


def test_a_folder_with_only_another_jobs_commits_is_refused_saying_what_is_there(
    tmp_path: Path,
) -> None:
    theirs = _spec(tmp_path)
    store = CheckpointStore(theirs.checkpoint.uri)
    coord, _ = _coordinator(theirs, store)
    for step in (10, 20):
        _commit(coord, store, tmp_path, step, "att0")
    before = sorted(str(p) for p in Path(store.backend.root).rglob("*"))

    ours = _spec(tmp_path, seed=7)  # the same name, another spec (its data's seed)
    with pytest.raises(CheckpointMismatchError) as e:
        CheckpointStore(ours.checkpoint.uri).check_owner(ours)
    msg = str(e.value)
    assert "checkpoint step 20 there was written with spec hash" in msg, msg
    assert "2 such steps: 10, 20" in msg and "none there is this job's" in msg, msg
    assert "Nothing was written there" in msg and "new location" in msg, msg
    assert "data.seed" in msg, msg  # what differs
    assert sorted(str(p) for p in Path(store.backend.root).rglob("*")) == before


def test_a_manifest_whose_files_were_never_listed_is_listed_before_it_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live commit counts on its ranks' word until its files are listed. A controller
    that died before listing them leaves no `checked.json`: the next reader lists them
    before it counts the step; once listed, it records so, and the reader after that
    does not list again."""
    spec = _spec(tmp_path)
    store = CheckpointStore(spec.checkpoint.uri)
    coord, _ = _coordinator(spec, store)
    _commit(coord, store, tmp_path, 10, "att0")
    entry = _upload(store, tmp_path, 20, "att0", 0)
    coord.expect(20, "att0", 1)
    (done,) = coord.receive([UploadResult(20, 0, "att0", 1, [entry], [])])
    assert done.step == 20 and coord.committed == [10, 20]
    assert not store.fs.exists(store.checked_path(20))  # the controller dies here
    (Path(store.backend.root) / store.step_name(20) / entry.path).unlink()

    store = CheckpointStore(spec.checkpoint.uri)  # the restarted controller's
    again, log = _coordinator(spec, store)
    group = Group(store)
    assert again.restore(group, sleep=lambda s: None)[0] == 10 and group.loaded == [10]
    assert any("step 20" in m and "is not in storage" in m for m in log), log

    # A step listed once is recorded: a new reader trusts the record, not a listing.
    assert store.fs.exists(store.checked_path(10))
    fresh = CheckpointStore(spec.checkpoint.uri)
    listed: list[str] = []
    real = fresh.fs.find
    monkeypatch.setattr(fresh.fs, "find", lambda p, **kw: listed.append(p) or real(p, **kw))
    assert 10 in fresh.committed_steps() and listed == []
    # A record that names another manifest (the step saved again since) vouches nothing:
    # the files are listed, and a step without them does not count.
    stale = {"step": 10, "manifest_sha256": "0" * 64}
    _plant(fresh, 10, "checked.json", json.dumps(stale).encode())
    for entry in fresh.load_manifest(10).files:
        (Path(fresh.backend.root) / fresh.step_name(10) / entry.path).unlink()
    assert CheckpointStore(spec.checkpoint.uri).committed_steps() == []


def test_a_finished_jobs_rerun_lists_its_final_steps_files(tmp_path: Path) -> None:
    from controller_fakes import FakeGroup, make

    ctl, store = make(tmp_path)  # commits 10, 20, 25; keep_last 2
    assert ctl.run()["state"] == "finished"
    final = store.load_manifest(25)
    assert store.fs.exists(store.checked_path(25))  # listed once, recorded
    gone = Path(store.backend.root) / store.step_name(25) / final.files[0].path
    gone.unlink()  # removed by hand, or by a lifecycle rule on the bucket

    again, _ = make(tmp_path)
    res = again.run()
    assert res["state"] == "finished" and res["steps"] == 25
    (group,) = FakeGroup.instances  # trained again, from the step before
    assert group.restored == [20]
    events = again.door.status()["events"]
    (said,) = [e for e in events if "already finished at step 25" in e]
    assert final.files[0].path in said and "is not in storage" in said, said
    assert "from step 20" in said, said


def test_a_reader_outside_the_job_is_handed_only_a_listed_step(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    store = CheckpointStore(spec.checkpoint.uri)
    coord, _ = _coordinator(spec, store)
    assert coord.hold_latest(60) is None
    _commit(coord, store, tmp_path, 10, "att0")  # committed, then listed by retention
    entry = _upload(store, tmp_path, 20, "att0", 0)
    coord.expect(20, "att0", 1)
    coord.receive([UploadResult(20, 0, "att0", 1, [entry], [])])
    assert coord.committed == [10, 20]
    assert coord.hold_latest(60) == 10  # step 20 is on its ranks' word alone
    coord.retain()
    assert coord.hold_latest(60) == 20
