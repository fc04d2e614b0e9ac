"""One running job writes under a checkpoint root at a time: a second job started on the
same checkpoint.uri fails before anything is written, naming the first; the root is
free again once the first ends, its lease lapses, or (on the same Ray cluster) its
controller is gone. Through the real CheckpointStore, CommitCoordinator, preflight and
controller (with the test fakes' group). No Ray.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spotline import constants
from spotline.checkpoint import CheckpointMismatchError, CheckpointStore
from spotline.checkpoint.coordinator import CommitCoordinator
from spotline.checkpoint.lease import LEASE_ARTIFACT, Lease, holder, read_lease
from spotline.config.loader import SpecError
from spotline.preflight import preflight
from test_hardening import _local

pytestmark = pytest.mark.unit


def _coordinator(spec, log: list[str] | None = None) -> CommitCoordinator:
    store = CheckpointStore(spec.resolved_checkpoint_uri())
    return CommitCoordinator(spec, store, lambda msg, *a: (log or []).append(msg))


def test_a_second_job_on_a_running_jobs_uri_fails_before_anything_is_written(
    tmp_path: Path,
) -> None:
    first = _coordinator(_local(tmp_path, name="pretrain"))
    first.check_owner()  # the running job's controller holds the root
    try:
        lease = read_lease(first.store)
        assert lease is not None and lease.job == "pretrain" and not lease.released

        second = _local(tmp_path, name="finetune", **{"model.d_model": 64})
        root = Path(first.store.backend.root)
        before = sorted(p.name for p in root.rglob("*"))
        with pytest.raises(SpecError) as e:
            preflight(second)  # in the driver, before any worker
        msg = str(e.value)
        assert "in use by job 'pretrain'" in msg and "Nothing was written there" in msg, msg
        assert "checkpoint.uri" in msg and "last seen" in msg, msg
        assert sorted(p.name for p in root.rglob("*")) == before

        # The same job name is left to its controller, which refuses it too while the
        # first runs (on another cluster, or where it cannot ask).
        again = _coordinator(_local(tmp_path, name="pretrain"))
        with pytest.raises(CheckpointMismatchError, match="in use by job 'pretrain'"):
            again.check_owner()
    finally:
        first.close()
    # Ended: released at once, and the next job takes the root.
    assert read_lease(first.store).released
    nxt = _coordinator(_local(tmp_path, name="pretrain"))
    nxt.check_owner()
    nxt.close()


def test_the_lease_is_renewed_beside_the_job_and_lapses_when_it_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(constants, "SPOTLINE_LEASE_RENEW_S", 0.05)
    coord = _coordinator(_local(tmp_path))
    coord.check_owner()
    try:
        first = read_lease(coord.store)
        for _ in range(200):
            now = read_lease(coord.store)
            if now.renewed_at > first.renewed_at:
                break
            coord.lease._stop.wait(0.05)
        assert now.renewed_at > first.renewed_at and now.run == first.run
    finally:
        coord.close()

    lease = Lease("a", "run-a", "10.0.0.1:6379", "h", 0.0, 1000.0)
    ttl = constants.SPOTLINE_LEASE_TTL_S
    assert holder(lease, 1000.0 + ttl - 1, "run-b") == lease
    assert holder(lease, 1000.0 + ttl + 1, "run-b") is None  # its controller died unseen
    assert holder(lease, 1000.0, "run-a") is None  # its own
    # On the same cluster, a lease whose controller is gone holds nothing at once.
    assert holder(lease, 1000.0, "run-b", "10.0.0.1:6379", alive=lambda job: False) is None
    assert holder(lease, 1000.0, "run-b", "10.0.0.1:6379", alive=lambda job: True) == lease
    assert holder(lease, 1000.0, "run-b", "10.0.0.2:6379", alive=lambda job: False) == lease


def test_a_rerun_on_the_same_cluster_takes_over_its_killed_runs_lease(tmp_path: Path) -> None:
    """A killed driver takes its controller with it, unreleased: the rerun's controller,
    the one of its name the cluster runs, takes the root at once."""
    spec = _local(tmp_path)
    dead = _coordinator(spec)
    dead.lease.cluster = "10.0.0.1:6379"
    dead.check_owner()
    dead.lease._stop.set()  # killed: never released
    rerun = _coordinator(spec)
    rerun.lease.cluster = "10.0.0.1:6379"
    rerun.lease.alive = lambda job: job == spec.name  # finds only itself by the name
    rerun.check_owner()
    rerun.close()
    # Another job's live controller on the cluster keeps its hold.
    other = _coordinator(_local(tmp_path, name="other", **{"model.d_model": 64}))
    other.lease.cluster, other.lease.alive = "10.0.0.1:6379", lambda job: True
    busy = _coordinator(spec)
    busy.lease.cluster = "10.0.0.1:6379"
    busy.check_owner()
    try:
        with pytest.raises(CheckpointMismatchError, match="in use by job 'hard'"):
            other.lease.claim()
    finally:
        busy.close()


def test_a_stored_lease_that_does_not_parse_holds_nothing(tmp_path: Path) -> None:
    spec = _local(tmp_path)
    store = CheckpointStore(spec.resolved_checkpoint_uri())
    store.write_artifact(LEASE_ARTIFACT, b"{not json")
    assert read_lease(store) is None
    store.write_artifact(LEASE_ARTIFACT, json.dumps({"job": "x"}).encode())
    assert read_lease(store) is None
    preflight(spec)


def test_a_controller_started_on_a_held_root_fails_and_starts_no_group(tmp_path: Path) -> None:
    from controller_fakes import FakeGroup, make

    ctl, store = make(tmp_path)
    other = CommitCoordinator(ctl.spec, CheckpointStore(store.uri), lambda *a: None)
    other.check_owner()  # another run of the job holds the root
    try:
        res = ctl.run()
        assert res["state"] == "failed" and FakeGroup.instances == []
        assert "in use by job 'ctl'" in res["error"], res["error"]
    finally:
        other.close()
    ctl, _ = make(tmp_path)
    assert ctl.run()["state"] == "finished"
    assert read_lease(store).released  # the job ended: the root is free
