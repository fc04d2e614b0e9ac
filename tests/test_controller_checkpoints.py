"""The controller's commits, restores and retention through the commit coordinator:
fallbacks past corrupt steps, reruns of finished jobs, receipts of two groups, the
ledger and summary kept beside the checkpoints. Against a fake group."""

from __future__ import annotations

import json
import tempfile
import time

import pytest

from controller_fakes import FakeGroup, fake_loss, make, run_until
from spotline.checkpoint import FileEntry, StorageError
from spotline.checkpoint import coordinator as coordinator_module
from spotline.checkpoint.manifest import Receipt
from spotline.checkpoint.transfer import attempt_dir, job_identity
from spotline.report import status_rows

pytestmark = pytest.mark.unit


def test_corrupt_latest_falls_back_to_previous(tmp_path):
    ctl, store = make(tmp_path, **{"train.steps": 20, "checkpoint.keep_last": 3})
    assert ctl.run()["state"] == "finished"
    assert store.committed_steps() == [10, 20]
    ctl2, _ = make(
        tmp_path, script={"corrupt_steps": {20}}, **{"train.steps": 30, "checkpoint.keep_last": 3}
    )
    res = ctl2.run()
    assert res["state"] == "finished"
    assert FakeGroup.instances[0].restored == [10]
    events = ctl2.door.status()["events"]
    assert any(
        "step 20" in e and "failed verification" in e and "falling back to step 10" in e
        for e in events
    )
    assert res["attempts"][0]["losses"][0][0] == 11


def test_a_corrupt_step_is_quarantined_shown_and_never_counted_by_keep_last(tmp_path):
    ctl, store = make(tmp_path)  # commits 10, 20, 25; keep_last 2
    assert ctl.run()["state"] == "finished"
    assert store.committed_steps() == [20, 25]
    ctl2, _ = make(tmp_path, script={"corrupt_steps": {25}}, **{"train.steps": 30})
    assert ctl2.run()["state"] == "finished"
    assert FakeGroup.instances[0].restored == [20]
    status = ctl2.door.status()
    assert any("quarantined checkpoint step 25" in e for e in status["events"])
    assert status["quarantined_steps"] == [25]
    assert "steps [25]" in dict(status_rows(status))["quarantined"]
    # Step 25 is set aside, not counted: the good step 20 outlives the commit of 30.
    assert store.committed_steps() == [20, 30] and store.quarantined_steps() == [25]


def test_an_unparsable_newest_manifest_falls_back(tmp_path):
    ctl, store = make(tmp_path, **{"train.steps": 20, "checkpoint.keep_last": 3})
    ctl.run()
    path = tmp_path / "ckpt" / "step_00000020" / "manifest.json"
    path.write_text("{ this is not json")
    ctl2, _ = make(tmp_path, **{"train.steps": 30, "checkpoint.keep_last": 3})
    res = ctl2.run()
    assert res["state"] == "finished"
    assert FakeGroup.instances[0].restored == [10]
    assert any("step 20" in e and "not valid JSON" in e for e in ctl2.door.status()["events"])


def test_all_checkpoints_corrupt_refuses_to_start_over(tmp_path):
    ctl, store = make(tmp_path, **{"train.steps": 10})
    ctl.run()
    ctl2, _ = make(tmp_path, script={"corrupt_steps": {10}}, **{"train.steps": 20})
    res = ctl2.run()
    assert res["state"] == "failed"
    assert "every committed checkpoint" in res["error"]


def test_failed_upload_abandons_that_checkpoint_only(tmp_path):
    ctl, store = make(tmp_path, script={"upload_error_step": 10}, **{"checkpoint.keep_last": 5})
    res = ctl.run()
    assert res["state"] == "finished"
    assert store.committed_steps() == [20, 25]
    assert any("step 10 abandoned: rank 1" in e for e in ctl.door.status()["events"])


def test_rerun_of_a_finished_job_reports_it_without_starting_workers(tmp_path):
    ctl, store = make(tmp_path)
    first = ctl.run()
    stored = store.read_artifact("summary.json")
    ctl2, _ = make(tmp_path)
    res = ctl2.run()
    assert FakeGroup.instances == []  # no group, so no worker, was started
    assert res["state"] == "finished" and res["steps"] == 25
    for key in ("losses", "final_train_loss", "heldout_loss", "steps_per_s", "committed_steps"):
        assert res[key] == first[key], key
    assert res["checkpoint_blocked_s"] == first["checkpoint_blocked_s"]
    assert res["steps_per_s"] > 0 and res["final_train_loss"] is not None
    assert store.read_artifact("summary.json") == stored  # the first run's, untouched
    assert any("already finished at step 25" in e for e in ctl2.door.status()["events"])
    assert ctl2.door.status()["step"] == 25


def test_a_finished_job_with_more_steps_asked_trains_on(tmp_path):
    ctl, _ = make(tmp_path)
    ctl.run()
    again, _ = make(tmp_path, **{"train.steps": 30})
    res = again.run()
    assert FakeGroup.instances[0].restored == [25]
    assert res["state"] == "finished" and sorted(res["losses"]) == list(range(26, 31))


def test_spec_change_refuses_foreign_checkpoint(tmp_path):
    ctl, _ = make(tmp_path, **{"train.steps": 10})
    ctl.run()
    ctl2, _ = make(tmp_path, **{"train.steps": 20, "model.d_model": 64})
    res = ctl2.run()
    assert res["state"] == "failed"
    assert "was written with spec hash" in res["error"]
    assert "model.d_model: 128 there, 64 here" in res["error"]
    assert not FakeGroup.instances  # refused before any group was started


def test_file_entries_are_recorded_in_manifest(tmp_path):
    ctl, store = make(tmp_path, **{"train.steps": 10})
    ctl.run()
    m = store.load_manifest(10)
    assert all(isinstance(f, FileEntry) for f in m.files)
    assert sorted(f.path for f in m.files) == [
        f"a-att0/rank_{r:05d}/state.safetensors" for r in range(4)
    ]


def test_replica_and_stage_changes_reshard_instead_of_failing(tmp_path):
    ctl, _ = make(tmp_path, capacity=2, **{"train.steps": 10})
    assert ctl.run()["committed_steps"] == [10]
    ctl2, _ = make(tmp_path, capacity=1, **{"train.steps": 20})
    res = ctl2.run()
    assert res["state"] == "finished"
    group = FakeGroup.instances[0]
    assert group.replicas == 1 and group.restored == [10] and group.resharded is True
    assert any(
        "resharded from 2 stage(s) x 2 replica(s)" in e for e in ctl2.door.status()["events"]
    )
    # The number of pipeline stages may change too (p -> p'): the state is by parameter.
    ctl3, _ = make(tmp_path, capacity=1, **{"train.steps": 30, "parallel.pipeline_stages": 1})
    res = ctl3.run()
    assert res["state"] == "finished" and FakeGroup.instances[0].restored == [20]


def test_failed_commit_is_skipped_and_training_goes_on(tmp_path, monkeypatch):
    ctl, store = make(tmp_path, **{"checkpoint.keep_last": 5})
    real_commit = store.commit

    def flaky(manifest, *args):
        if manifest.step == 10:
            raise StorageError("bucket unreachable")
        real_commit(manifest, *args)

    monkeypatch.setattr(store, "commit", flaky)
    res = ctl.run()
    assert res["state"] == "finished"
    assert store.committed_steps() == [20, 25]
    assert any(
        "step 10 not committed: bucket unreachable" in e for e in ctl.door.status()["events"]
    )
    assert len(FakeGroup.instances) == 1  # the group was never torn down for it


def test_a_retention_error_does_not_restart_the_group(tmp_path, monkeypatch):
    ctl, store = make(tmp_path)
    calls = {"n": 0}
    real = coordinator_module.apply_retention

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise StorageError("throttled")
        return real(*args)

    monkeypatch.setattr(coordinator_module, "apply_retention", flaky)
    res = ctl.run()
    assert res["state"] == "finished" and res["failures"] == 0
    assert len(FakeGroup.instances) == 1
    assert any("retention deferred" in e for e in ctl.door.status()["events"])
    assert store.committed_steps() == [20, 25]  # retried at the next commit


def test_retention_keeps_a_step_a_reader_pins_and_deletes_it_once_released(tmp_path):
    ctl, store = make(tmp_path, **{"checkpoint.keep_last": 1, "checkpoint.interval_steps": 5})
    pins = {5}
    ctl.coordinator.pinned = lambda: set(pins)
    run_until(ctl, lambda: ctl.step_count >= 16 and 15 in store.committed_steps())
    assert store.committed_steps() == [5, 15]  # 10 went; 5 is still read
    assert store.load_manifest(5).step == 5
    pins.clear()
    res = ctl.run()
    assert res["state"] == "finished"
    assert store.committed_steps() == [25]  # released, then retained away


def test_a_held_step_outlives_keep_last_and_a_controller_restart(tmp_path):
    from spotline.checkpoint.coordinator import CommitCoordinator

    ctl, store = make(tmp_path, **{"checkpoint.keep_last": 1, "checkpoint.interval_steps": 5})
    assert ctl.door.hold_latest() is None  # nothing committed yet
    run_until(ctl, lambda: 5 in store.committed_steps())
    assert ctl.door.hold_latest() == {"step": 5, "uri": store.uri}
    res = ctl.run()
    assert res["state"] == "finished"
    assert store.committed_steps() == [5, 25]  # 10, 15 and 20 went; 5 is held
    # A restarted controller of the job reads the hold back; an ended hold goes.
    again = CommitCoordinator(ctl.spec, store, lambda *a, **k: None)
    again._load_holds()
    assert set(again._holds) == {5}
    again.committed = [5, 25]
    again._holds = {5: time.time() - 1}
    again._retention_due = True
    again.retain()
    assert store.committed_steps() == [25]


def test_an_artifact_write_error_does_not_restart_the_group(tmp_path, monkeypatch):
    ctl, store = make(tmp_path)

    def broken(relpath, data):
        raise StorageError("disk full")

    monkeypatch.setattr(store, "write_artifact", broken)
    res = ctl.run()
    assert res["state"] == "finished" and len(FakeGroup.instances) == 1


def test_receipts_of_two_groups_never_mix_into_one_manifest(tmp_path):
    """Stale receipts of ranks 0, 2 and 3 of a world-4 group, and rank 1 of a world-2
    group that died mid-save, all for step 10: together they cover ranks 0..3, but no
    single group is complete, so nothing commits."""
    ctl, store = make(tmp_path)

    def receipt(attempt, rank, world):
        rel = f"{attempt_dir(attempt)}/rank_{rank:05d}/state.safetensors"
        with tempfile.NamedTemporaryFile() as f:
            f.write(b"x")
            f.flush()
            entry = store.upload_file(f.name, 10, rel)
        store.write_receipt(
            Receipt(
                **job_identity(ctl.spec),
                step=10,
                attempt=attempt,
                rank=rank,
                world_size=world,
                files=[entry],
            )
        )

    for rank in (0, 2, 3):
        receipt("old4", rank, 4)
    receipt("new2", 1, 2)
    assert ctl.coordinator.commit_from_storage() == []
    assert store.committed_steps() == []
    # The world-2 group's other rank finishes: that group is complete, and only its two
    # files are in the manifest.
    receipt("new2", 0, 2)
    (done,) = ctl.coordinator.commit_from_storage()
    assert done.step == 10
    m = store.load_manifest(10)
    assert sorted(f.path for f in m.files) == [
        "a-new2/rank_00000/state.safetensors",
        "a-new2/rank_00001/state.safetensors",
    ]
    # The other group's files are swept from the committed step.
    assert not (tmp_path / "ckpt" / "step_00000010" / "a-old4").exists()


def test_a_step_committed_from_receipts_keeps_the_losses_its_group_never_reported(tmp_path):
    """The group dies after every rank uploaded step 10 but before its reports of steps
    7..10 came back: rank 0's receipt carries them, and the loss curve has no gap."""
    script = {"upload_delay": 100, "kill_at": 10, "steps_per_poll": 6, "reports_die": True}
    ctl, _ = make(tmp_path, script=script)
    res = ctl.run()
    assert res["state"] == "finished" and FakeGroup.instances[1].restored == [10]
    assert sorted(res["losses"]) == list(range(1, 26))
    assert res["losses"][8] == fake_loss(8)
    first = res["attempts"][0]
    assert [s for s, _ in first["losses"]] == list(range(1, 11))


def test_a_restarted_controller_commits_what_every_rank_of_a_group_uploaded(tmp_path):
    ctl, store = make(tmp_path, script={"upload_delay": 100, "kill_at": 12})
    run_until(ctl, lambda: len(FakeGroup.instances) == 2)  # step 10's reports died with it
    # The new group restored from step 10, committed from the receipts in storage.
    assert FakeGroup.instances[1].restored == [10]
    assert any("every rank of group att0 had uploaded" in e for e in ctl.door.status()["events"])


def test_ledger_adds_up_and_counts_lost_steps_as_recomputed(tmp_path):
    # Step 20's checkpoint never commits (an upload fails), then a worker dies at 22:
    # the job resumes from 10, so steps 11..22 are trained again.
    ctl, store = make(tmp_path, {"upload_error_step": 20, "kill_at": 22})
    res = ctl.run()
    assert res["state"] == "finished" and res["attempts"][1]["restored_from"] == 10
    led = res["ledger"]
    parts = led["device_s"]
    assert sum(parts.values()) == pytest.approx(led["total_s"], rel=1e-9)
    assert parts["useful"] > 0 and parts["recomputed"] > 0
    assert parts["recovery"] >= 0
    assert led["steps"] == 25  # steps whose compute counts, each once
    assert 0 < led["goodput"] < 1


def test_summary_and_ledger_are_stored_and_continued_by_a_new_controller(tmp_path):
    ctl, store = make(tmp_path)
    ctl.run()
    summary = json.loads(store.read_artifact("summary.json"))
    assert summary["state"] == "finished" and summary["step"] == 25
    assert summary["last_checkpoint"]["step"] == 25
    assert summary["mfu"] is not None  # FakeGroup's peak is 1 GFLOP/s
    first = summary["ledger"]["total_s"]
    assert first > 0
    again, _ = make(tmp_path, **{"train.steps": 30})  # extend the same job
    again.run()
    assert again.telemetry.ledger.total_s > first  # continued, not started over
    assert [h["step"] for h in again.telemetry.history][0] <= 10
