"""The controller state machine, stepped one iteration at a time against a fake group.

No Ray and no DeepSpeed: the fake group trains a deterministic "loss" (a pure
function of the step), stores checkpoint files in a real file:// store through
the same upload path shape, and can be told to fail.
"""

from __future__ import annotations

import json

import pytest

from spotline.checkpoint import CheckpointStore, CorruptCheckpointError, FileEntry
from spotline.config import load_spec
from spotline.controller import Controller, State
from spotline.workers.group import PROCESS_DIED, ChunkResult, WorkerFailure
from spotline.workers.uploads import UploadResult

pytestmark = pytest.mark.unit


def fake_loss(step: int) -> float:
    return 10.0 / (1 + step)


class FakeGroup:
    """Queued events instead of workers. Uploads surface on the next train/flush call."""

    instances: list[FakeGroup] = []

    def __init__(self, spec, replicas, store, script):
        self.spec, self.replicas, self.store, self.script = spec, replicas, store, script
        self.world_size = spec.parallel.pipeline_stages * replicas
        self.step = 0
        self.pending: list[UploadResult] = []
        self.restored: list[int] = []
        self.stop_requests: list[str] = []
        self.shut = False
        FakeGroup.instances.append(self)

    def start(self):
        if self.script.pop("fail_start", False):
            raise WorkerFailure("start", {"boom": [0]})

    def restore(self, manifest):
        if manifest.step in self.script.get("corrupt_steps", ()):
            raise CorruptCheckpointError(manifest.step, "x.pt", "sha256 mismatch")
        self.restored.append(manifest.step)
        self.resharded = manifest.topology["replicas"] != self.replicas
        self.step = manifest.step
        return self.step

    def train(self, n):
        kill_at = self.script.get("kill_at")
        losses = []
        interrupted = False
        for _ in range(n):
            if kill_at is not None and self.step == kill_at:
                self.script.pop("kill_at")
                lost = self.script.pop("lose_node", None)
                if lost is not None:
                    self.cluster.nodes.discard(lost)
                cause = self.script.pop("cause", None)
                if cause is not None:  # one rank raised; its peers saw the collective break
                    raise WorkerFailure(
                        "training",
                        {f"{type(cause).__name__}: {cause}": [0], "gloo: peer closed": [1, 2, 3]},
                        causes=[cause, RuntimeError("gloo: peer closed")],
                    )
                raise WorkerFailure(
                    "training",
                    {PROCESS_DIED: [3]},
                    {3: "node-1"},
                )
            self.step += 1
            losses.append((self.step, fake_loss(self.step)))
            notice = self.script.get("notices", {}).pop(self.step, None)
            if notice is not None:
                self.controller.notify(notice)
            if self.stop_requests:
                self.stop_requests.clear()
                interrupted = True
                break
        up, self.pending = self.pending, []
        return ChunkResult(losses=losses, seconds=0.01 * n, uploads=up, interrupted=interrupted)

    def save(self):
        for rank in range(self.world_size):
            rel = f"global_step{self.step}/rank{rank}.pt"
            data = f"{self.step}:{rank}".encode()
            import hashlib
            import tempfile

            with tempfile.NamedTemporaryFile() as f:
                f.write(data)
                f.flush()
                entry = self.store.upload_file(f.name, self.step, rel)
            assert entry.sha256 == hashlib.sha256(data).hexdigest()
            if self.script.get("upload_error_step") == self.step and rank == 1:
                self.pending.append(UploadResult(self.step, rank, error="OSError: disk full"))
            else:
                self.store.write_receipt(self.step, rank, self.world_size, [entry])
                self.pending.append(UploadResult(self.step, rank, [entry], 0.01))
        return 0.001

    def flush_uploads(self):
        up, self.pending = self.pending, []
        return up

    def heldout_loss(self):
        return fake_loss(self.step) + 0.5

    def worker_info(self):
        return [
            {"rank": r, "pid": 1000 + r, "node_id": self.node_of(r)} for r in range(self.world_size)
        ]

    def node_of(self, rank):
        # One node per replica: node-0 holds replica 0's stages, and so on.
        return f"node-{rank % self.replicas}"

    def node_ids(self):
        return {self.node_of(r) for r in range(self.world_size)}

    def request_checkpoint(self, reason):
        self.stop_requests.append(reason)

    def executors(self):
        return []

    def peak_flops(self):
        return 1e9

    def shutdown(self):
        self.shut = True


class FakeCluster:
    """Scripted capacity and nodes; records drains."""

    def __init__(self, capacity):
        self._capacity = capacity
        self.nodes = {"node-0", "node-1", "node-2", "node-3"}
        self.drained: list[str] = []
        self.closed = False

    def capacity(self, held_workers=0):
        cap = self._capacity
        return cap(held_workers) if callable(cap) else cap

    def gone(self, node_ids):
        return set(node_ids) - self.nodes

    def drain(self, node_id, deadline, reason):
        self.drained.append(node_id)
        return True

    def watch(self):
        pass

    def close(self):
        self.closed = True


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.now += s


def make(tmp_path, script=None, capacity=2, **over):
    raw = {
        "name": "ctl",
        "model": {"n_layers": 2},
        "parallel": {"pipeline_stages": 2, "micro_batches": 2},
        "elastic": {"min_replicas": 1, "max_replicas": 2},
        "train": {"steps": 25, "global_batch_size": 8, "log_every": 5},
        "checkpoint": {"uri": f"file://{tmp_path}/ckpt", "interval_steps": 10, "keep_last": 2},
        "failure": {"max_failures": 2},
    }
    spec = load_spec(raw, over)
    store = CheckpointStore(spec.resolved_checkpoint_uri())
    FakeGroup.instances = []
    script = script if script is not None else {}
    cluster = FakeCluster(capacity)
    clock = FakeClock()

    def group(replicas):
        g = FakeGroup(spec, replicas, store, script)
        g.cluster, g.controller = cluster, ctl
        return g

    ctl = Controller(spec, store, group, cluster, sleep=clock.sleep, clock=clock)
    ctl.fake_cluster = cluster
    return ctl, store


def test_states_advance_one_iteration_at_a_time(tmp_path):
    ctl, store = make(tmp_path)
    assert ctl.state is State.PENDING
    assert ctl.step() is State.SCHEDULING
    assert ctl.step() is State.RUNNING
    assert FakeGroup.instances[0].replicas == 2
    # Steps 1..10 run as one chunk, which ends on the checkpoint boundary.
    assert ctl.step() is State.CHECKPOINTING
    assert ctl.step_count == 10
    assert ctl.step() is State.RUNNING  # saved locally; upload pending, not committed yet
    assert ctl.committed == []
    assert ctl.step() is State.CHECKPOINTING  # steps 11..20; step-10 uploads arrive, commit
    assert ctl.committed == [10]
    assert ctl.step() is State.RUNNING
    assert ctl.step() is State.CHECKPOINTING  # steps 21..25: the end is a boundary too
    assert ctl.step() is State.FINISHING
    assert ctl.step() is State.FINISHED
    assert ctl.committed == [20, 25]


def test_full_run_commits_every_interval_and_the_end(tmp_path):
    ctl, store = make(tmp_path)
    res = ctl.run()
    assert res["state"] == "finished"
    assert res["steps"] == 25
    assert res["losses"] == {s: fake_loss(s) for s in range(1, 26)}
    # keep_last=2: step 10 was committed, then deleted by retention.
    assert store.committed_steps() == [20, 25]
    m = store.load_manifest(25)
    assert m.topology["replicas"] == 2 and m.topology["world_size"] == 4
    assert m.data_position["next_step"] == 25
    assert m.spec_hash == ctl.spec.spec_hash()
    assert len(m.files) == 4
    assert res["heldout_loss"] == pytest.approx(fake_loss(25) + 0.5)
    assert FakeGroup.instances[-1].shut


def test_worker_failure_restarts_from_latest_commit(tmp_path):
    ctl, store = make(tmp_path, script={"kill_at": 15})
    res = ctl.run()
    assert res["state"] == "finished"
    assert res["failures"] == 1
    first, second = FakeGroup.instances
    assert first.shut and second.restored == [10]
    assert res["attempts"][1]["restored_from"] == 10
    assert [s for s, _ in res["attempts"][1]["losses"]][0] == 11
    assert "worker process died" in res["attempts"][0]["error"]
    assert "[ranks 3@node-1]" in res["attempts"][0]["error"]


def test_max_failures_exhausted_fails_with_clear_message(tmp_path):
    script = {"kill_at": 3}
    ctl, _ = make(tmp_path, script=script, **{"failure.max_failures": 0})
    res = ctl.run()
    assert res["state"] == "failed"
    assert "failure.max_failures=0" in res["error"]
    assert "worker process died" in res["error"]


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
    events = ctl2.status()["events"]
    assert any(
        "step 20" in e and "failed verification" in e and "falling back to step 10" in e
        for e in events
    )
    # Steps 11..30 were retrained from the step-10 weights.
    assert res["attempts"][0]["losses"][0][0] == 11


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
    assert any("step 10 abandoned: rank 1" in e for e in ctl.status()["events"])


def test_resume_of_finished_job_does_not_retrain(tmp_path):
    ctl, _ = make(tmp_path)
    ctl.run()
    ctl2, _ = make(tmp_path)
    res = ctl2.run()
    assert res["state"] == "finished"
    assert res["losses"] == {}
    assert FakeGroup.instances[0].restored == [25]


def test_spec_change_refuses_foreign_checkpoint(tmp_path):
    ctl, _ = make(tmp_path, **{"train.steps": 10})
    ctl.run()
    ctl2, _ = make(tmp_path, **{"train.steps": 20, "model.d_model": 64})
    res = ctl2.run()
    assert res["state"] == "failed"
    assert "was written with spec hash" in res["error"]
    assert "model.d_model: 128 there, 64 here" in res["error"]


def test_waits_below_min_then_fails(tmp_path):
    ctl, _ = make(tmp_path, capacity=0, **{"elastic.wait_for_capacity_s": 30})
    assert ctl.step() is State.SCHEDULING
    assert ctl.step() is State.WAITING  # first Wait: starts the clock
    assert "elastic.min_replicas is 1" in ctl.status()["waiting"]
    res = ctl.run()
    assert res["state"] == "failed"
    assert "elastic.min_replicas" in res["error"]
    assert "elastic.wait_for_capacity_s" in res["error"]
    assert 30 <= res["waited_s"] <= 32
    assert not FakeGroup.instances  # no worker was ever started


def test_capacity_sizes_the_group_within_bounds(tmp_path):
    ctl, _ = make(tmp_path, capacity=1)
    ctl.step()
    ctl.step()
    assert FakeGroup.instances[0].replicas == 1
    ctl, _ = make(tmp_path / "b", capacity=9)
    ctl.step()
    ctl.step()
    assert FakeGroup.instances[0].replicas == 2


def test_start_failure_counts_as_failure_and_retries(tmp_path):
    ctl, _ = make(tmp_path, script={"fail_start": True})
    res = ctl.run()
    assert res["state"] == "finished"
    assert res["failures"] == 1


def test_file_entries_are_recorded_in_manifest(tmp_path):
    ctl, store = make(tmp_path, **{"train.steps": 10})
    ctl.run()
    m = store.load_manifest(10)
    assert all(isinstance(f, FileEntry) for f in m.files)
    assert sorted(f.path for f in m.files) == [f"global_step10/rank{r}.pt" for r in range(4)]


def test_replica_change_reshards_instead_of_failing(tmp_path):
    ctl, _ = make(tmp_path, capacity=2, **{"train.steps": 10})
    assert ctl.run()["committed_steps"] == [10]
    ctl2, _ = make(tmp_path, capacity=1, **{"train.steps": 20})
    res = ctl2.run()
    assert res["state"] == "finished"
    group = FakeGroup.instances[0]
    assert group.replicas == 1 and group.restored == [10] and group.resharded is True
    assert any("resharded from 2 to 1 replica(s)" in e for e in ctl2.status()["events"])


def test_zero3_checkpoint_does_not_reshard(tmp_path):
    over = {"parallel.pipeline_stages": 1, "parallel.zero_stage": 3, "train.steps": 10}
    ctl, _ = make(tmp_path, capacity=2, **over)
    ctl.run()
    ctl2, _ = make(tmp_path, capacity=1, **{**over, "train.steps": 20})
    res = ctl2.run()
    assert res["state"] == "failed"
    assert "ZeRO-3" in res["error"] and "elastic.min_replicas" in res["error"]


def test_pipeline_stage_change_is_refused(tmp_path):
    ctl, _ = make(tmp_path, **{"train.steps": 10})
    ctl.run()
    ctl2, _ = make(tmp_path, **{"train.steps": 20, "parallel.pipeline_stages": 1})
    res = ctl2.run()
    assert res["state"] == "failed"
    assert "parallel.pipeline_stages" in res["error"]


def test_failed_commit_is_skipped_and_training_goes_on(tmp_path, monkeypatch):
    from spotline.checkpoint import StorageError

    ctl, store = make(tmp_path, **{"checkpoint.keep_last": 5})
    real_commit = store.commit

    def flaky(manifest):
        if manifest.step == 10:
            raise StorageError("bucket unreachable")
        real_commit(manifest)

    monkeypatch.setattr(store, "commit", flaky)
    res = ctl.run()
    assert res["state"] == "finished"
    assert store.committed_steps() == [20, 25]
    assert any("step 10 not committed: bucket unreachable" in e for e in ctl.status()["events"])


# --- spot capacity ------------------------------------------------------------------


def _notice(node, deadline=4e9, source="ray-drain"):
    return {"source": source, "node_id": node, "deadline": deadline, "reason": "node draining"}


def test_notice_commits_a_jit_checkpoint_and_restarts_off_the_doomed_node(tmp_path):
    # The notice arrives during step 13; capacity then drops to one replica.
    left = {"replicas": 2}
    script = {"notices": {13: _notice("node-1")}}
    ctl, store = make(tmp_path, script=script, capacity=lambda held: left["replicas"])
    orig_notify = ctl.notify

    def notify(n):
        orig_notify(n)
        left["replicas"] = 1

    ctl.notify = notify
    res = ctl.run()
    assert res["state"] == "finished"
    assert res["failures"] == 0 and res["node_losses"] == 0
    first, second = FakeGroup.instances
    assert first.replicas == 2 and second.replicas == 1
    # Every rank stopped at the boundary after step 13, which committed before the restart.
    assert second.restored == [13] and second.resharded
    assert res["attempts"][1]["start_step"] == 13
    (n,) = res["notices"]
    assert n["committed_step"] == 13 and n["notice_to_commit_s"] is not None
    assert n["outcome"] == "just-in-time checkpoint committed"
    assert ctl.fake_cluster.drained == ["node-1"]
    assert res["resizes"] == [
        {
            "step": 13,
            "from_replicas": 2,
            "why": "preemption",
            "detail": res["resizes"][0]["detail"],
            "to_replicas": 1,
        }
    ]
    assert [r["why"] for r in res["recoveries"]] == ["preemption"]
    # No step was trained twice: the losses of both attempts tile 1..25.
    steps = [s for a in res["attempts"] for s, _ in a["losses"]]
    assert steps == list(range(1, 26))


def test_notice_for_a_node_without_ranks_only_drains_it(tmp_path):
    script = {"notices": {4: _notice("node-3")}}
    ctl, _ = make(tmp_path, script=script)
    res = ctl.run()
    assert res["state"] == "finished"
    assert len(FakeGroup.instances) == 1
    assert ctl.fake_cluster.drained == ["node-3"]
    assert res["notices"][0]["outcome"] == "no ranks of this job on that node"


def test_repeated_notice_is_answered_once(tmp_path):
    ctl, _ = make(tmp_path, capacity=1)
    for _ in range(3):
        ctl.notify(_notice("node-9", deadline=123.0))
    assert len(ctl._pending_notices) == 1


def test_node_loss_resumes_from_latest_commit_without_using_a_failure(tmp_path):
    script = {"kill_at": 17, "lose_node": "node-1"}
    left = {"replicas": 2}

    def capacity(held):
        return 1 if "node-1" not in ctl.fake_cluster.nodes else left["replicas"]

    ctl, _ = make(tmp_path, script=script, capacity=capacity)
    res = ctl.run()
    assert res["state"] == "finished"
    assert res["failures"] == 0 and res["node_losses"] == 1
    first, second = FakeGroup.instances
    assert second.replicas == 1 and second.restored == [10]
    assert res["attempts"][0]["ended_by"] == "node lost"
    assert res["recoveries"][0]["why"] == "node loss"


def _devices(total):
    """Capacity over `total` devices, of which the live fake group holds some."""

    def capacity(held):
        live = sum(g.world_size for g in FakeGroup.instances if not g.shut)
        return (total["devices"] - live + held) // 2  # pipeline_stages = 2

    return capacity


def test_grows_at_a_checkpoint_boundary_when_capacity_returns(tmp_path):
    total = {"devices": 2}
    ctl, store = make(tmp_path, capacity=_devices(total), **{"elastic.scale_up_interval_s": 0})
    while ctl.step_count < 5:
        ctl.step()
    total["devices"] = 4  # a second replica's worth of devices joins
    res = ctl.run()
    assert res["state"] == "finished"
    assert [g.replicas for g in FakeGroup.instances] == [1, 2]
    assert FakeGroup.instances[1].restored == [10]
    assert res["resizes"][0]["why"] == "grow" and res["resizes"][0]["to_replicas"] == 2
    assert store.load_manifest(20).topology["replicas"] == 2
    batch = store.load_manifest(20).extra["batch"]
    assert batch["policy"] == "constant" and batch["global_batch_size"] == 8


def test_does_not_grow_inside_the_cadence(tmp_path):
    total = {"devices": 2}
    ctl, _ = make(tmp_path, capacity=_devices(total), **{"elastic.scale_up_interval_s": 1e9})
    while ctl.step_count < 5:
        ctl.step()
    total["devices"] = 4
    res = ctl.run()
    assert res["state"] == "finished"
    assert [g.replicas for g in FakeGroup.instances] == [1]


def test_stop_commits_at_the_next_boundary_and_ends_stopped(tmp_path):
    ctl, store = make(tmp_path)
    while ctl.step_count < 10:
        ctl.step()
    ctl.step()  # commit step 10, then back to RUNNING
    ctl.step()  # train 11..20
    ctl.request_stop("maintenance")  # the fake's ranks see it after their next step
    res = ctl.run()
    assert res["state"] == "stopped"
    assert store.committed_steps()[-1] == res["steps"]
    assert FakeGroup.instances[-1].shut
    assert "submitting the job again resumes there" in ctl.status()["events"][-1]


def test_stop_while_waiting_for_capacity_ends_stopped(tmp_path):
    ctl, _ = make(tmp_path, capacity=0)
    ctl.step()
    ctl.step()
    assert ctl.state is State.WAITING
    ctl.request_stop()
    assert ctl.step() is State.STOPPED


def test_notice_at_a_checkpoint_boundary_does_not_save_that_step_twice(tmp_path):
    # The notice lands while step 10, an interval boundary, is being saved: the JIT
    # path then waits for that save's upload instead of overwriting its staged files.
    ctl, store = make(
        tmp_path, capacity=lambda held: 1 if any(g.shut for g in FakeGroup.instances) else 2
    )
    saves = []
    orig = FakeGroup.save

    def save_then_notice(self):
        saves.append(self.step)
        blocked = orig(self)
        if self.step == 10:
            ctl.notify(_notice("node-1"))
        return blocked

    FakeGroup.save = save_then_notice
    try:
        res = ctl.run()
    finally:
        FakeGroup.save = orig
    assert res["state"] == "finished"
    assert saves.count(10) == 1
    assert res["notices"][0]["committed_step"] == 10
    assert [g.replicas for g in FakeGroup.instances] == [2, 1]


def test_ledger_adds_up_and_counts_lost_steps_as_recomputed(tmp_path):
    # Step 20's checkpoint never commits (an upload fails), then a worker dies at 22:
    # the job resumes from 10, so steps 11..20 (reported) and 21..22 are trained again.
    ctl, store = make(tmp_path, {"upload_error_step": 20, "kill_at": 22})
    res = ctl.run()
    assert res["state"] == "finished" and res["attempts"][1]["restored_from"] == 10
    led = res["ledger"]
    parts = led["device_s"]
    assert sum(parts.values()) == pytest.approx(led["total_s"], rel=1e-9)
    assert parts["useful"] > 0 and parts["recomputed"] > 0
    assert parts["recovery"] > 0  # the restart itself
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
    assert [h["step"] for h in again.telemetry.history][0] == 10


@pytest.mark.parametrize(
    ("cause", "kind", "fix"),
    [
        (
            MemoryError("CUDA out of memory. Tried to allocate 51.0 GiB"),
            "out of memory",
            "micro-batch",
        ),
        (
            FileNotFoundError(2, "No such file or directory", "/data/tok.json"),
            "missing path",
            "path",
        ),
        (PermissionError(13, "Permission denied", "/stage"), "permission denied", "write access"),
    ],
)
def test_a_failure_a_restart_cannot_fix_fails_at_once(tmp_path, cause, kind, fix):
    ctl, _ = make(tmp_path, script={"kill_at": 12, "cause": cause}, **{"failure.max_failures": 5})
    res = ctl.run()
    assert res["state"] == "failed"
    assert res["failures"] == 0  # not counted against failure.max_failures
    assert len(FakeGroup.instances) == 1  # and never restarted
    assert res["error"].startswith(f"{kind}: training failed:")
    assert "Not retried" in res["error"] and fix in res["error"]
    assert "max_failures" not in res["error"] and "\n" not in res["error"]
