"""The controller state machine, stepped one iteration at a time against a fake group.

No Ray and no DeepSpeed: the fake group's ranks "train" on their own like real ones
(a deterministic loss per step, a few steps per poll), save at every checkpoint
interval and at the steps the controller asks for, write their files and receipts
into a real file:// store under their attempt, and report finished uploads one poll
later, so commits, fallbacks and restarts run the real commit coordinator.
"""

from __future__ import annotations

import json
import tempfile
import time

import pytest

from spotline import constants
from spotline.checkpoint import CheckpointStore, CorruptCheckpointError, FileEntry, StorageError
from spotline.checkpoint import coordinator as coordinator_module
from spotline.checkpoint.manifest import Receipt
from spotline.checkpoint.transfer import UploadResult, attempt_dir, job_identity
from spotline.config import load_spec
from spotline.controller import Controller
from spotline.controller.clock import Clock
from spotline.controller.state import (
    Failed,
    Finished,
    Finishing,
    Leaving,
    Pending,
    Running,
    Scheduling,
    Starting,
    Stopped,
    Waiting,
)
from spotline.report import status_rows
from spotline.runtime.cluster import CordonList
from spotline.runtime.progress import PROCESS_DIED, Progress, RankBeat, WorkerFailure
from spotline.train.health import DATA_PHASE

pytestmark = pytest.mark.unit


def fake_loss(step: int) -> float:
    return 10.0 / (1 + step)


class FakeGroup:
    """Ranks that train on their own: `poll` is where their time passes."""

    instances: list[FakeGroup] = []

    def __init__(self, spec, replicas, store, script, cluster, clock):
        self.spec, self.replicas, self.store, self.script = spec, replicas, store, script
        self.cluster, self.clock = cluster, clock
        self.world_size = spec.parallel.pipeline_stages * replicas
        self.attempt = f"att{len(FakeGroup.instances)}"
        self.device = "cpu"
        self.restored_bytes = 0
        self.kept = 0
        self.ahead = 0
        self.handed = None  # the nodes `hand_over` was told go, once it was asked
        self.step = 0
        self.target = None
        self.running = False
        self.finished = None
        self.save_at = self.stop_at = 0
        self.reason = ""
        self.saved_through = 0
        self.saves: list[int] = []
        self.unsaved: list[tuple[int, float]] = []  # rank 0's losses since its last save
        self.uploads: list[tuple[int, UploadResult]] = []  # (poll it is reported at, result)
        self.polls = 0
        self.wall = time.time()  # the ranks' wall clock: it moves with the steps
        self.restored: list[int] = []
        self.requests: list[tuple[int, int, str]] = []
        self.shut = False
        self.frozen_since = None  # the script's freeze: no step since then
        self.stalled_since = None  # the script's data stall: no step since then
        # Replica r runs on the r-th node that is not drained (nodes are replica-sized).
        free = sorted(cluster.nodes - set(cluster.drained) - cluster.cordoned)
        self.nodes = [free[r % len(free)] for r in range(replicas)] if free else ["none"]
        FakeGroup.instances.append(self)

    def start(self, partition=None, init=True, survivors=None):
        self.adopted = survivors
        self.starting_polls = self.script.pop("start_polls", 0)  # polls before it is ready
        if self.script.pop("fail_start", False):
            raise WorkerFailure("start", {"boom": [0]})
        self.init = init
        self.started_partition = partition
        layers = self.spec.model.n_layers + 2
        pp = self.spec.parallel.pipeline_stages
        self.bounds = list(partition) if partition else [layers * s // pp for s in range(pp + 1)]

    def advance(self, timeout_s=0.0):
        """Ready at once, or after the script's `start_polls` calls (its time passes);
        the script's `fail_starting` fails the start on its way."""
        if self.script.pop("fail_starting", False):
            raise WorkerFailure("start", {"replica 1 on node node-1: binding failed": [1, 3]})
        if self.starting_polls > 0:
            self.starting_polls -= 1
            self.clock.sleep(timeout_s)
            return False
        return True

    def partition(self):
        # What the start-up measurement saw: every layer costs the same on every stage.
        layers = self.spec.model.n_layers + 2
        sizes = [b - a for a, b in zip(self.bounds, self.bounds[1:], strict=False)]
        return {
            "method": "balanced",
            "bounds": self.bounds,
            "sizes": sizes,
            "layer_s": [1.0] * layers,
        }

    def _stage_reports(self, steps):
        """Each stage's compute time per step: its layers at the stage's true speed (the
        script's `stage_speed`, which the start-up measurement did not see)."""
        speeds = self.script.get("stage_speed")
        if not speeds or not steps:
            return []
        out = []
        for s, (a, b) in enumerate(zip(self.bounds, self.bounds[1:], strict=False)):
            busy = steps * (b - a) * 0.01 / speeds[s]
            out.append(
                {"stage": s, "replica": 0, "rank": s, "steps": steps, "compute_s": busy}
                | {"step_s": busy, "wait_s": 0.0}
            )
        return out

    def restore(self, manifest, source=None):
        if source == "peer" and self.script.get("peer_unreadable"):
            raise CorruptCheckpointError(manifest.step, "rank_0/state.safetensors", "unreadable")
        if manifest.step in self.script.get("corrupt_steps", ()):
            raise CorruptCheckpointError(manifest.step, "x.safetensors", "sha256 mismatch")
        self.restored.append(manifest.step)
        self.resharded = manifest.topology["replicas"] != self.replicas
        self.step = self.saved_through = manifest.step
        return self.step

    def run(self, target, peer_every=0):
        self.target, self.running = target, True

    def request(self, save_at=0, stop_at=0, reason="", peer_every=0):
        # As the actor: the latest save asked for, the earliest stop.
        self.requests.append((save_at, stop_at, reason))
        self.save_at = max(self.save_at, save_at)
        if stop_at > 0:
            self.stop_at = min(self.stop_at, stop_at) if self.stop_at else stop_at
        self.reason = reason

    def poll(self, timeout_s):
        self.polls += 1
        out = Progress()
        due = [u for p, u in self.uploads if p <= self.polls]
        self.uploads = [(p, u) for p, u in self.uploads if p > self.polls]
        out.uploads = due
        freeze = self.script.get("freeze")  # {"at": step, "rank": r, "times": n}
        due = freeze and self.running and self.step == freeze["at"] and freeze["times"] > 0
        if due and self.frozen_since is None:
            freeze["times"] -= 1
            self.frozen_since = self.clock.now
        if self.frozen_since is not None:
            self.clock.now += 1.0  # the poll waited for answers that did not come
            out.ranks = self._beats(frozen=freeze["rank"])
            return out
        stall = self.script.get("stall")  # {"at": step, "rank": r, "for_s": s, "times": n}
        due = stall and self.running and self.step == stall["at"] and stall["times"] > 0
        if due and self.stalled_since is None:
            stall["times"] -= 1
            self.stalled_since = self.clock.now
        if self.stalled_since is not None:
            if self.clock.now - self.stalled_since < stall["for_s"]:
                self.clock.now += 1.0  # every rank answers; one waits for its batches
                out.ranks = self._beats(data=stall["rank"])
                return out
            self.stalled_since = None  # its batches came
        for _ in range(self.script.get("steps_per_poll", 5)):
            if not self.running:
                break
            kill_at = self.script.get("kill_at")
            if kill_at is not None and self.step == kill_at:
                self.script.pop("kill_at")
                lost = self.script.pop("lose_node", None)
                if lost is not None:
                    self.cluster.nodes.discard(lost)
                cause = self.script.pop("cause", None)
                if cause is not None:  # one rank raised; its peers saw the collective break
                    failure = WorkerFailure(
                        "training",
                        {f"{type(cause).__name__}: {cause}": [0], "gloo: peer closed": [1, 2, 3]},
                        causes=[cause, RuntimeError("gloo: peer closed")],
                    )
                else:
                    failure = WorkerFailure("training", {PROCESS_DIED: [3]}, {3: "node-1"})
                # As the real group: what the living ranks published in this poll
                # (nothing, when rank 0's report died with it).
                failure.progress = None if self.script.get("reports_die") else out
                raise failure
            self.step += 1
            slow_from, slow_s = self.script.get("slow_from", (None, 0.0))
            took = slow_s if slow_from is not None and self.step >= slow_from else 0.05
            self.clock.now += took  # a step takes 50 ms, unless the script slows it
            self.wall += took
            out.steps.append((self.step, fake_loss(self.step), took, self.wall))
            self.unsaved.append((self.step, fake_loss(self.step)))
            notice = self.script.get("notices", {}).pop(self.step, None)
            if notice is not None:
                self.controller.door.notify(notice)
            if self.script.get("stop_at_step") == self.step:
                self.controller.door.request_stop("maintenance")
            s = self.step
            ask = self.save_at if self.save_at > self.saved_through else 0
            stop = 0 < self.stop_at <= s
            interval = self.spec.checkpoint.interval_steps
            if stop or s % interval == 0 or s == self.target or 0 < ask <= s:
                self._save(s, out)
                self.saved_through = s
            if stop or s >= self.target:
                self.running = False
                self.finished = {"stopped_at": s, "reason": self.reason if stop else "target"}
        out.bubbles = self._stage_reports(len(out.steps))
        out.ranks = self._beats()
        if not self.running and self.finished is not None:
            out.finished = self.finished
        return out

    def _beats(self, frozen=None, data=None):
        """Every rank's heartbeat: a frozen rank stopped answering when it froze, its
        peers wait for it in a collective; a rank waiting for data (`data`) answers."""
        now = self.clock.now
        out = []
        for rank in range(self.world_size):
            silent = now - self.frozen_since if rank == frozen else 0.0
            slow = self.script.get("slow_nodes", {}).get(self.node_of(rank), 1.0)
            phase = "forward micro-batch 1" if rank == frozen else "step agreement (collective)"
            phase_s = silent
            if data is not None:
                phase = DATA_PHASE if rank == data else "step agreement (collective)"
                phase_s = now - self.stalled_since
            out.append(
                RankBeat(
                    rank,
                    rank // self.replicas,
                    rank % self.replicas,
                    self.node_of(rank),
                    self.step + 1,
                    phase if frozen is not None or data is not None else "forward micro-batch 1",
                    phase_s,
                    silent,
                    self.running,
                    5,
                    0.01 * 5 * slow,
                )
            )
        return out

    def _save(self, step, out):
        self.saves.append(step)
        out.saves[step] = 0.001
        delay = self.script.get("upload_delay", 1)
        losses, self.unsaved = self.unsaved, []
        for rank in range(self.world_size):
            rel = f"{attempt_dir(self.attempt)}/rank_{rank:05d}/state.safetensors"
            with tempfile.NamedTemporaryFile() as f:
                f.write(f"{step}:{rank}".encode())
                f.flush()
                entry = self.store.upload_file(f.name, step, rel)
            index = [{"file": rel, "param": "0.w", "kind": "fp32", "start": rank}]
            if self.script.get("upload_error_step") == step and rank == 1:
                result = UploadResult(
                    step, rank, self.attempt, self.world_size, error="OSError: disk full"
                )
            else:
                self.store.write_receipt(
                    Receipt(
                        **job_identity(self.spec),
                        step=step,
                        attempt=self.attempt,
                        rank=rank,
                        world_size=self.world_size,
                        files=[entry],
                        index=index,
                        losses=[list(p) for p in losses] if rank == 0 else [],
                    )
                )
                result = UploadResult(
                    step,
                    rank,
                    self.attempt,
                    self.world_size,
                    [entry],
                    index,
                    self.script.get("upload_s", 0.01),
                )
            self.uploads.append((self.polls + delay, result))

    def wait_uploads(self, timeout_s):
        return True

    def heldout_loss(self):
        return fake_loss(self.step) + 0.5

    def worker_info(self):
        return [
            {"rank": r, "pid": 1000 + r, "node_id": self.node_of(r)} for r in range(self.world_size)
        ]

    def node_of(self, rank):
        return self.nodes[rank % self.replicas]

    def node_ids(self):
        return set(self.nodes)

    def executors(self):
        return []

    def peak_flops(self):
        return 1e9

    def hand_over(self, leaving, grace_s):
        """The replicas off `leaving` go on (recovery.in_place); a fake has no process."""
        self.left_behind = {}
        self.handed = set(leaving)
        self.survivors_out = FakeSurvivors([n for n in self.nodes if n not in leaving])
        return self.survivors_out

    def shutdown(self):
        self.shut = True
        self.running = False


class FakeSurvivors:
    """What a fake group hands on: the nodes of its replicas that go on. The fake
    cluster counts their devices as free already, so they hold none here."""

    def __init__(self, nodes):
        self.nodes = nodes
        self.replicas = []  # what else joins them: replicas started ahead
        self.released = False

    def devices(self):
        return 0

    def release(self):
        self.released = True


class FakeStandby:
    """Replicas started ahead: each is ready at the `ready_after`-th keep after it
    started. The fake cluster counts their devices as free, so they hold none here."""

    def __init__(self, ready_after):
        self.ready_after = ready_after
        self.started: list[dict] = []  # {"keeps": seen since its start}
        self.wants: list[int] = []
        self.taken: list[dict] = []
        self.released = False
        self.failures: list[str] = []

    def devices(self):
        return 0

    def ready(self):
        return sum(1 for r in self.started if r["keeps"] >= self.ready_after)

    def starting(self):
        return len(self.started) - self.ready()

    def keep(self, room, limit, device, avoid):
        self.wants.append(min(room, limit))
        for r in self.started:
            r["keeps"] += 1
        del self.started[max(limit, 0) :]
        if room >= 1 and len(self.started) < limit:
            self.started.append({"keeps": 0})

    def take(self, avoid):
        out = [r for r in self.started if r["keeps"] >= self.ready_after]
        self.taken += out
        self.started = []
        return out

    def release(self):
        self.released = True
        self.started = []


class FakeCluster:
    """Four replica-sized nodes; capacity is what is free and not draining."""

    def __init__(self, capacity):
        self._capacity = capacity
        self.nodes = {"node-0", "node-1", "node-2", "node-3"}
        self.drained: list[str] = []
        self.cordoned = CordonList()
        self.closed = False

    def capacity(self, held_workers=0, exclude=frozenset(), lifted=frozenset()):
        cap = self._capacity
        return cap(held_workers, self) if callable(cap) else cap

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
    """The controller's clock in these tests: time passes only when it sleeps. Its wall
    time starts at the real one (notices in the scripts carry real deadlines) and moves
    with it."""

    def __init__(self):
        self.now = 0.0
        self.base = time.time()

    def __call__(self):
        return self.now

    def wall(self):
        return self.base + self.now

    def sleep(self, s):
        self.now += s


class FakeDemand:
    """Records what the controller asks the autoscaler for."""

    def __init__(self):
        self.calls: list[str] = []

    def bind(self, event):
        pass

    def keep(self, force=False):
        self.calls.append("force" if force else "keep")

    def withdraw(self):
        self.calls.append("withdraw")


def make(tmp_path, script=None, capacity=2, standby=None, stacks=None, **over):
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
        g = FakeGroup(spec, replicas, store, script, cluster, clock)
        g.controller = ctl
        return g

    demand = FakeDemand()
    ctl = Controller(
        spec, store, group, cluster, clock=Clock(clock, clock.wall, clock.sleep), demand=demand,
        standby=standby, stacks=stacks,
    )  # fmt: skip
    ctl.fake_demand = demand
    ctl.fake_cluster = cluster
    ctl.fake_clock = clock
    return ctl, store


def run_until(ctl, pred, limit=500):
    for _ in range(limit):
        if pred():
            return
        ctl.step()
    raise AssertionError(f"not reached in {limit} iterations; state {ctl.state}")


# --- the run ------------------------------------------------------------------------


def test_states_advance_and_training_never_waits_for_a_commit(tmp_path):
    ctl, store = make(tmp_path)
    assert isinstance(ctl.state, Pending)
    assert isinstance(ctl.step(), Scheduling)
    assert isinstance(ctl.step(), Running)
    group = FakeGroup.instances[0]
    assert group.replicas == 2 and group.running
    ctl.step()  # steps 1..5
    ctl.step()  # steps 6..10: step 10 saved by the ranks themselves
    assert ctl.step_count == 10 and group.saves == [10]
    assert ctl.coordinator.committed == []  # its uploads are not finished yet
    ctl.step()  # steps 11..15, and step 10's uploads come in: it commits at once
    assert ctl.coordinator.committed == [10] and ctl.step_count == 15
    assert group.requests == []  # the controller never had to ask for a checkpoint
    run_until(ctl, lambda: ctl.state.terminal)
    assert isinstance(ctl.state, Finished)
    assert ctl.coordinator.committed == [20, 25]


def test_the_status_says_which_device_each_group_runs_on(tmp_path):
    ctl, _ = make(tmp_path)
    assert ctl.door.status()["device"] is None  # no group started yet
    ctl.step()
    ctl.step()
    FakeGroup.instances[0].device = "gpu"  # what the group decided when it started
    ctl.step()  # the status is what the loop published after its latest step
    assert ctl.door.status()["device"] == "gpu" and ctl.door.summary()["device"] == "gpu"
    res = ctl.run()
    assert res["attempts"][0]["device"] == "cpu"  # recorded as the group started
    assert ctl.door.status()["device"] == "cpu"  # no live group: the last one's
    # A device: gpu job waiting for its first GPU node says it is a GPU job.
    waiting, _ = make(tmp_path / "gpu", capacity=0, resources={"device": "gpu"})
    waiting.step()
    waiting.step()
    assert waiting.door.status()["waiting"] and waiting.door.status()["device"] == "gpu"


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
    assert m.extra["attempt"] == "att0"
    assert len(m.files) == 4 and len(m.extra["index"]) == 4
    assert res["heldout_loss"] == pytest.approx(fake_loss(25) + 0.5)
    assert FakeGroup.instances[-1].shut
    # Wall-clock throughput, from the first step's start to the last step's end.
    assert res["steps_per_s"] > 0


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


def test_steps_reported_in_the_poll_that_failed_are_kept(tmp_path):
    # Step 12 is saved and its receipts land in storage, then a rank dies in the same
    # poll: the restart commits 12 from the receipts and resumes after it, so steps 11
    # and 12 are never trained again. Their losses come from the failing poll's report.
    ctl, _ = make(tmp_path, script={"kill_at": 12}, **{"checkpoint.interval_steps": 4})
    res = ctl.run()
    assert res["state"] == "finished" and res["failures"] == 1
    assert res["attempts"][1]["restored_from"] == 12
    assert sorted(res["losses"]) == list(range(1, 26))


def test_max_failures_exhausted_fails_with_clear_message(tmp_path):
    ctl, _ = make(tmp_path, script={"kill_at": 3}, **{"failure.max_failures": 0})
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


def test_waits_below_min_then_fails(tmp_path):
    ctl, _ = make(tmp_path, capacity=0, **{"elastic.wait_for_capacity_s": 30})
    assert isinstance(ctl.step(), Scheduling)
    assert isinstance(ctl.step(), Waiting)
    assert "elastic.min_replicas is 1" in ctl.door.status()["waiting"]
    res = ctl.run()
    assert res["state"] == "failed"
    assert "elastic.min_replicas" in res["error"]
    assert "elastic.wait_for_capacity_s" in res["error"]
    assert 30 <= res["waited_s"] <= 32 + 10  # + the settle after the first reading
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

    def flaky(manifest):
        if manifest.step == 10:
            raise StorageError("bucket unreachable")
        real_commit(manifest)

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


def test_an_unexpected_controller_error_tears_everything_down(tmp_path, monkeypatch):
    ctl, _ = make(tmp_path)
    run_until(ctl, lambda: ctl.step_count >= 5)

    def boom(*a, **k):
        raise KeyError("surprise")

    monkeypatch.setattr(ctl.growth, "decide", boom)
    ctl.step()
    assert isinstance(ctl.state, Failed)
    assert "internal error in the controller while running: KeyError" in ctl.state.error
    assert FakeGroup.instances[0].shut and ctl.fake_cluster.closed


def test_an_error_in_user_code_run_by_the_controller_is_called_theirs(tmp_path, monkeypatch):
    """The controller runs user code too (a notice source named by module:attr): what it
    raises is the user's, not 'a Spotline bug'."""
    from spotline.registry import import_object

    (tmp_path / "user_notice_source.py").write_text(
        "def poll(*args, **kwargs):\n    raise RuntimeError('metadata server answered 500')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    poll = import_object("user_notice_source:poll", "preemption.sources[0].kind")
    ctl, _ = make(tmp_path)
    run_until(ctl, lambda: ctl.step_count >= 5)
    monkeypatch.setattr(ctl.growth, "decide", poll)
    ctl.step()
    assert isinstance(ctl.state, Failed)
    error = ctl.state.error
    assert "error in your code" in error and "Spotline bug" not in error
    assert "user_notice_source.poll, user_notice_source.py line 2" in error
    assert "preemption.sources[0].kind 'user_notice_source:poll'" in error
    assert FakeGroup.instances[0].shut and ctl.fake_cluster.closed


# --- the commit protocol ------------------------------------------------------------


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


# --- spot capacity ------------------------------------------------------------------


def _notice(node, deadline=None, source="ray-drain"):
    deadline = time.time() + 20 if deadline is None else deadline
    return {"source": source, "node_id": node, "deadline": deadline, "reason": "node draining"}


def _devices(total):
    """Capacity over `total` replica-sized nodes, of which the live fake group holds some."""

    def capacity(held, cluster):
        live = sum(g.replicas for g in FakeGroup.instances if not g.shut)
        return max(0, total["nodes"] - len(set(cluster.drained)) - live + held // 2)

    return capacity


def test_notice_commits_a_jit_checkpoint_and_restarts_off_the_doomed_node(tmp_path):
    # A short notice: staying would not gain steps, so the group saves at once.
    total = {"nodes": 2}
    script = {"notices": {13: _notice("node-1", deadline=time.time() + 5)}}
    ctl, store = make(tmp_path, script=script, capacity=_devices(total))
    res = ctl.run()
    assert res["state"] == "finished"
    assert res["failures"] == 0 and res["node_losses"] == 0
    first, second = FakeGroup.instances
    assert first.replicas == 2 and second.replicas == 1
    assert "node-1" not in second.node_ids()  # the drained node got no part of it
    jit = first.saves[-1]
    # The controller saw the notice at the poll after step 13: the next step saves.
    assert first.requests[0][:2] == (jit, jit) and jit == res["notices"][0]["step"] + 1
    assert second.restored == [jit] and second.resharded
    (n,) = res["notices"]
    assert n["committed_step"] == jit and n["notice_to_commit_s"] is not None
    assert n["outcome"] == "just-in-time checkpoint committed"
    assert ctl.fake_cluster.drained == ["node-1"]
    assert res["resizes"][0]["why"] == "preemption" and res["resizes"][0]["to_replicas"] == 1
    assert [r["why"] for r in res["recoveries"]] == ["preemption"]
    steps = [s for a in res["attempts"] for s, _ in a["losses"]]
    assert steps == list(range(1, 26))  # no step trained twice


def test_a_long_notice_keeps_training_on_the_doomed_capacity_until_it_must_save(tmp_path):
    total = {"nodes": 2}
    over = {"train.steps": 400, "checkpoint.interval_steps": 100}
    script = {"notices": {13: _notice("node-1", deadline=time.time() + 30)}}
    ctl, _ = make(tmp_path, script=script, capacity=_devices(total), **over)
    res = ctl.run()
    assert res["state"] == "finished"
    first = FakeGroup.instances[0]
    jit = first.requests[0][0]
    # 30 s left, 10 s margin, 50 ms steps: it stays for hundreds of steps, not one.
    assert jit > 100 and first.saves[-1] == jit and first.replicas == 2
    assert FakeGroup.instances[1].restored == [jit]
    assert any("just-in-time checkpoint after" in e for e in ctl.door.status()["events"])


def test_a_late_jit_checkpoint_moves_up_when_steps_slow_down(tmp_path):
    total = {"nodes": 2}
    over = {"train.steps": 2000, "checkpoint.interval_steps": 1000}
    script = {
        "notices": {13: _notice("node-1", deadline=time.time() + 30)},
        "slow_from": (20, 1.0),  # from step 20 on, a step takes 1 s instead of 50 ms
    }
    ctl, _ = make(tmp_path, script=script, capacity=_devices(total), **over)
    run_until(ctl, lambda: len(FakeGroup.instances) == 2)
    first = FakeGroup.instances[0]
    planned = first.requests[0][1]
    assert planned > 300  # picked at 50 ms a step: stay
    moved = first.requests[-1][1]
    # At 1 s a step the planned step is out of reach: the next one saves instead.
    assert 20 < moved < 40 and first.saves[-1] == moved
    assert FakeGroup.instances[1].restored == [moved]
    assert any("moves up to step" in e for e in ctl.door.status()["events"])


def test_the_first_status_says_when_a_jit_checkpoint_cannot_meet_the_notice(tmp_path):
    def warnings(ctl):
        return [e for e in ctl.door.status()["events"] if "warning: a just-in-time" in e]

    gcp = {"preemption.sources": [{"kind": "gcp", "endpoint": "http://127.0.0.1:9"}]}
    # Predicted from the state size before anything ran: 1 KB/s cannot move it in 30 s.
    ctl, _ = make(tmp_path / "a", **gcp, **{"checkpoint.upload_max_mb_per_s": 0.001})
    ctl.step()
    (w,) = warnings(ctl)
    assert "predicted" in w and "gcp notice gives 30s" in w
    # Fits by prediction, but the first measured save says otherwise: said once.
    ctl, _ = make(tmp_path / "b", script={"upload_s": 25.0}, **gcp)
    ctl.step()
    assert warnings(ctl) == []
    run_until(ctl, lambda: len(ctl.coordinator.committed) >= 2)
    (w,) = warnings(ctl)
    assert "(measured" in w
    # Measured and fitting: nothing to say.
    ctl, _ = make(tmp_path / "c", **gcp)
    assert ctl.run()["state"] == "finished" and warnings(ctl) == []


def test_a_notice_while_scheduling_drains_the_node_before_the_group_starts(tmp_path):
    ctl, _ = make(tmp_path, capacity=1)
    ctl.step()  # pending -> scheduling
    ctl.door.notify(_notice("node-0"))  # lands before any group exists
    ctl.step()  # scheduling: the inbox is read first, in any state
    assert ctl.fake_cluster.drained == ["node-0"]
    assert "node-0" not in FakeGroup.instances[0].node_ids()
    assert "the next group avoids it" in ctl.jit.notices[0]["outcome"]


def test_notice_for_a_node_without_ranks_only_drains_it(tmp_path):
    script = {"notices": {4: _notice("node-3")}}
    ctl, _ = make(tmp_path, script=script)
    res = ctl.run()
    assert res["state"] == "finished"
    assert len(FakeGroup.instances) == 1
    assert ctl.fake_cluster.drained == ["node-3"]
    assert res["notices"][0]["outcome"].startswith("no ranks of this job on that node")


def test_repeated_notice_is_answered_once(tmp_path):
    ctl, _ = make(tmp_path, capacity=1)
    for _ in range(3):
        assert ctl.door.notify(_notice("node-9", deadline=123.0)) is True  # acknowledged
    notices, _ = ctl.inbox.take()
    assert len(notices) == 1


def _two_nodes(held, cluster):
    """Capacity of two one-replica nodes, node-0 and node-1, while they live."""
    live = sum(g.replicas for g in FakeGroup.instances if not g.shut)
    return len(cluster.nodes & {"node-0", "node-1"}) - live + held // 2


def test_node_loss_resumes_from_latest_commit_without_using_a_failure(tmp_path):
    script = {"kill_at": 17, "lose_node": "node-1"}

    ctl, _ = make(tmp_path, script=script, capacity=_two_nodes)
    res = ctl.run()
    assert res["state"] == "finished"
    assert res["failures"] == 0 and res["node_losses"] == 1
    first, second = FakeGroup.instances
    assert second.replicas == 1 and second.restored == [10]
    assert res["attempts"][0]["ended_by"] == "node lost"
    assert res["recoveries"][0]["why"] == "node loss"


def test_a_restart_hands_the_ranks_that_stay_to_the_next_group_but_never_after_a_hang(
    tmp_path,
):
    """recovery.in_place: after a node loss the replicas off the lost node, and after a
    notice those off the doomed node, are handed to the next group (never ended); after
    a hang nothing is, and with in_place off nothing is either."""
    ctl, _ = make(tmp_path / "loss", {"kill_at": 17, "lose_node": "node-1"}, _two_nodes)
    assert ctl.run()["state"] == "finished"
    first, second = FakeGroup.instances
    assert first.handed == {"node-1"} and first.survivors_out.nodes == ["node-0"]
    assert second.adopted is first.survivors_out and not second.adopted.released

    script = {"notices": {13: _notice("node-1", deadline=time.time() + 5)}}
    ctl, _ = make(tmp_path / "notice", script=script, capacity=_devices({"nodes": 2}))
    assert ctl.run()["state"] == "finished"
    first, second = FakeGroup.instances
    assert first.handed == {"node-1"} and second.adopted is first.survivors_out

    ctl, _ = make(tmp_path / "hang", {"freeze": {"at": 15, "rank": 1, "times": 1}})
    run_until(ctl, lambda: ctl.state.terminal)
    first, second = FakeGroup.instances[:2]
    assert first.handed is None and second.adopted is None

    off = {"recovery.in_place": False}
    ctl, _ = make(tmp_path / "off", {"kill_at": 17, "lose_node": "node-1"}, _two_nodes, **off)
    assert ctl.run()["state"] == "finished"
    assert FakeGroup.instances[0].handed is None and FakeGroup.instances[1].adopted is None


def test_a_lost_nodes_state_keeper_is_forgotten_before_the_next_group_asks(tmp_path):
    """A restore asks every keeper it knows what it holds; one on a lost node would keep
    the next group waiting for Ray to call it unavailable."""
    from spotline.runtime.keeper import PeerMemory

    ctl, _ = make(tmp_path, {"kill_at": 17, "lose_node": "node-1"}, _two_nodes)
    peers = PeerMemory(ctl.spec)
    peers._keepers = {"node-0": "keeper-0", "node-1": "keeper-1"}
    ctl.recovery.peers = peers
    offered = []
    peers.offer = lambda *a, **k: offered.append(set(peers._keepers))  # what it would ask
    peers.retain = lambda attempts: None
    assert ctl.run()["state"] == "finished"
    assert offered[-1] == {"node-0"} and set(peers._keepers) == {"node-0"}


def test_ranks_held_for_a_next_group_that_never_starts_are_ended(tmp_path):
    """Handed on at a node loss, then the job stops while it waits for capacity: the
    held ranks end with it."""

    def capacity(held, cluster):  # both nodes at first; none once the loss is seen
        return 0 if any(g.shut for g in FakeGroup.instances) else 2

    script = {"kill_at": 17, "lose_node": "node-1"}
    ctl, _ = make(tmp_path, script, capacity, **{"elastic.wait_for_capacity_s": 3})
    run_until(ctl, lambda: ctl.state.terminal)
    assert ctl.state.name == "failed"
    (first,) = FakeGroup.instances
    assert first.survivors_out.released and ctl.fleet.survivors is None


def test_after_a_teardown_the_group_is_sized_from_settled_capacity(tmp_path):
    """Right after the old group goes, Ray still shows its devices as held: sizing from
    that first reading would start 1 replica; the controller waits until they show."""
    readings = iter([1, 1, 1])

    def capacity(held, cluster):
        if held or len(FakeGroup.instances) < 2 and not any(g.shut for g in FakeGroup.instances):
            return 2  # the first start, and the estimate made while the group still lives
        return next(readings, 2)

    ctl, _ = make(tmp_path, script={"kill_at": 12}, capacity=capacity)
    res = ctl.run()
    assert res["state"] == "finished"
    assert [g.replicas for g in FakeGroup.instances] == [2, 2]


def test_grows_when_capacity_returns_and_it_pays(tmp_path):
    total = {"nodes": 1}
    ctl, store = make(
        tmp_path, capacity=_devices(total), **{"train.steps": 400, "checkpoint.interval_steps": 50}
    )
    run_until(ctl, lambda: ctl.step_count >= 5)
    assert FakeGroup.instances[0].replicas == 1
    total["nodes"] = 2  # a second replica's worth joins
    # No restart happened yet: the measured start of the first group is the cost.
    res = ctl.run()
    assert res["state"] == "finished"
    assert [g.replicas for g in FakeGroup.instances] == [1, 2]
    grow = res["resizes"][0]
    assert grow["why"] == "grow" and grow["to_replicas"] == 2
    # No fixed interval: it grew at the first check after the capacity came.
    assert FakeGroup.instances[1].restored[0] <= 50
    assert store.load_manifest(400).topology["replicas"] == 2


def test_a_grow_trains_on_until_the_replica_started_ahead_is_ready_then_takes_it_in(tmp_path):
    """Capacity joins: a replica is started ahead at the first check, the group trains on
    while its processes start, and the grow hands it to the bigger group as a survivor;
    with no spare capacity none is kept, and the job's end releases what is left."""
    total = {"nodes": 1}
    standby = FakeStandby(ready_after=3)
    steps = {"train.steps": 400, "checkpoint.interval_steps": 50}
    ctl, store = make(tmp_path, capacity=_devices(total), standby=standby, **steps)
    run_until(ctl, lambda: ctl.step_count >= 5 and standby.wants)
    assert set(standby.wants) == {0} and not standby.started
    total["nodes"] = 2  # a second replica's worth joins
    run_until(ctl, lambda: standby.wants[-1] == 1)
    run_until(ctl, lambda: standby.started[0]["keeps"] == 2)
    # Not ready yet: still the first group, training.
    assert len(FakeGroup.instances) == 1 and isinstance(ctl.state, Running)
    res = ctl.run()
    assert res["state"] == "finished"
    first, grown = FakeGroup.instances
    assert grown.replicas == 2 and res["resizes"][0]["why"] == "grow"
    assert standby.taken and grown.adopted.replicas == standby.taken
    assert first.survivors_out is grown.adopted
    assert standby.released  # the job's end
    assert store.load_manifest(400).topology["replicas"] == 2


def test_does_not_grow_when_the_restart_would_not_pay(tmp_path):
    total = {"nodes": 1}
    ctl, _ = make(tmp_path, capacity=_devices(total))
    run_until(ctl, lambda: ctl.step_count >= 5)
    total["nodes"] = 2
    ctl.pace.restart_s = 1e6  # a restart that costs more than the rest of the job
    res = ctl.run()
    assert res["state"] == "finished"
    assert [g.replicas for g in FakeGroup.instances] == [1]


def test_free_capacity_a_grow_would_not_use_is_explained_once(tmp_path):
    total = {"nodes": 1}
    steps = {"train.steps": 400, "checkpoint.interval_steps": 50}
    ctl, _ = make(tmp_path, capacity=_devices(total), **steps)
    run_until(ctl, lambda: ctl.step_count >= 5)
    total["nodes"] = 2
    ctl.pace.sps[2] = 1e-3  # two replicas were measured slower than one
    res = ctl.run()
    assert res["state"] == "finished"
    assert [g.replicas for g in FakeGroup.instances] == [1]
    said = [e for e in ctl.door.status()["events"] if "growing does not pay" in e]
    assert len(said) == 1, said
    assert "capacity for 2 replica(s) is free, staying at 1" in said[0]
    assert "0.00 at 2" in said[0]


def test_a_grow_waits_for_a_replica_started_ahead_only_so_long(tmp_path, monkeypatch):
    """A replica started ahead that never gets ready (stuck, or failing and started
    again) holds a grow back for SPOTLINE_STANDBY_WAIT_S at most; then the grow goes on
    with processes of its own, and says so."""
    from spotline import constants

    monkeypatch.setattr(constants, "SPOTLINE_STANDBY_WAIT_S", 5.0)
    total = {"nodes": 1}
    standby = FakeStandby(ready_after=10**9)
    steps = {"train.steps": 400, "checkpoint.interval_steps": 50}
    ctl, _ = make(tmp_path, capacity=_devices(total), standby=standby, **steps)
    run_until(ctl, lambda: ctl.step_count >= 5)
    total["nodes"] = 2
    run_until(ctl, lambda: standby.started)
    due = ctl.clock()
    standby.failures.append("replica standby-1 started ahead on node node-1 ended: boom")
    run_until(ctl, lambda: len(FakeGroup.instances) == 2)
    assert ctl.clock() - due >= 5.0
    assert [g.replicas for g in FakeGroup.instances] == [1, 2]
    assert not standby.taken  # never ready: the bigger group started its own
    said = [e for e in ctl.door.status()["events"] if "started ahead not ready" in e]
    assert len(said) == 1 and "growing with processes of its own" in said[0]
    # What ended one on the way is said, once.
    boom = [e for e in ctl.door.status()["events"] if e.endswith("ended: boom")]
    assert boom == ["replica standby-1 started ahead on node node-1 ended: boom"]


def test_a_replica_started_ahead_that_fails_is_named_with_its_node():
    from spotline.runtime.standby import Standby
    from spotline.runtime.starter import ReplicaStart, StartFailed

    class Failing(ReplicaStart):  # its rehearsal's calls raised
        def advance(self):
            raise StartFailed("rehearsing failed: RuntimeError: boom")

        def end(self):
            pass

    sb = Standby(spec=None, store=None)
    r = Failing(None, None, "cpu", [], "", "standby-1", None, phase="rehearsing")
    r.infos = [{"node_id": "a" * 40}]
    sb._replicas = [r]
    sb._advance()
    assert sb.starting() == 0
    assert sb.failures == [
        f"replica standby-1 started ahead on node {'a' * 12} ended: "
        "rehearsing failed: RuntimeError: boom"
    ]


def test_stop_commits_at_the_next_boundary_and_ends_stopped(tmp_path):
    ctl, store = make(tmp_path, script={"stop_at_step": 13})
    res = ctl.run()
    assert res["state"] == "stopped"
    last = store.committed_steps()[-1]
    assert last == res["steps"] and 13 < last < 25
    assert FakeGroup.instances[-1].shut
    assert "submitting the job again resumes there" in ctl.door.status()["events"][-1]


def test_stop_while_waiting_for_capacity_ends_stopped(tmp_path):
    ctl, _ = make(tmp_path, capacity=0)
    ctl.step()
    ctl.step()
    assert isinstance(ctl.state, Waiting)
    ctl.door.request_stop()
    assert isinstance(ctl.step(), Stopped)


def test_a_notice_right_at_a_checkpoint_boundary_saves_that_step_once(tmp_path):
    total = {"nodes": 2}
    ctl, _ = make(tmp_path, script={"notices": {10: _notice("node-1", deadline=time.time())}},
                  capacity=_devices(total))  # fmt: skip
    res = ctl.run()
    assert res["state"] == "finished"
    first = FakeGroup.instances[0]
    assert first.saves.count(10) == 1
    assert [g.replicas for g in FakeGroup.instances] == [2, 1]


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


@pytest.mark.parametrize(
    ("cause", "kind", "fix"),
    [
        (MemoryError("CUDA out of memory. Tried to allocate 51.0 GiB"), "out of memory", "micro-batch"),
        (FileNotFoundError(2, "No such file or directory", "/data/tok.json"), "missing path", "path"),
        (PermissionError(13, "Permission denied", "/stage"), "permission denied", "write access"),
    ],
)  # fmt: skip
def test_a_failure_a_restart_cannot_fix_fails_at_once(tmp_path, cause, kind, fix):
    ctl, _ = make(tmp_path, script={"kill_at": 12, "cause": cause}, **{"failure.max_failures": 5})
    res = ctl.run()
    assert res["state"] == "failed"
    assert res["failures"] == 0  # not counted against failure.max_failures
    assert len(FakeGroup.instances) == 1  # and never restarted
    assert res["error"].startswith(f"{kind}: training failed:")
    assert "Not retried" in res["error"] and fix in res["error"]
    assert "max_failures" not in res["error"] and "\n" not in res["error"]


def test_states_are_what_they_carry():
    s = Leaving(why="grow", step=12, since=3.0, grow_to=2)
    assert s.name == "checkpointing" and not s.terminal and s.grow_to == 2
    assert Finished().terminal and Failed(error="x").error == "x" and Stopped().terminal
    assert Finishing().name == "finishing"


# --- stage partitions -------------------------------------------------------------


def _unequal(tmp_path, speeds, **over):
    return make(
        tmp_path,
        script={"stage_speed": speeds},
        capacity=1,
        **{
            "model.n_layers": 6,
            "elastic.max_replicas": 1,
            "parallel.partition": "balanced",
            "parallel.rebalance_window_steps": 10,
            "train.steps": 400,
            "checkpoint.interval_steps": 50,
            **over,
        },
    )


def test_sustained_imbalance_repartitions_at_the_next_checkpoint_boundary(tmp_path):
    ctl, store = _unequal(tmp_path, [1.0, 0.5])  # stage 1 runs at half the speed measured
    res = ctl.run()
    assert res["state"] == "finished"
    first, second = FakeGroup.instances
    assert first.bounds == [0, 4, 8] and second.started_partition == second.bounds
    assert second.bounds[1] > 4  # layers moved off the slow stage
    rp = res["partition"]["repartitions"]
    assert len(rp) == 1 and rp[0]["outcome"] == "done"
    # At a checkpoint boundary, through that checkpoint: the new group restored it.
    assert rp[0]["step"] % 50 == 0 and second.restored == [rp[0]["step"]]
    assert rp[0]["measured_imbalance"] == pytest.approx(1 / 3)
    assert rp[0]["measured_imbalance_after"] < rp[0]["measured_imbalance"]
    assert res["partition"]["bounds"] == second.bounds
    assert res["partition"]["measured_imbalance"] == rp[0]["measured_imbalance_after"]
    assert res["attempts"][0]["ended_by"] == "re-partition"
    assert store.load_manifest(400).extra["partition"] == second.bounds
    assert any("re-partition" in e for e in ctl.door.status()["events"])
    assert (
        ctl.door.trace() is None
        or ctl.door.trace()["otherData"]["partition"]["bounds"] == second.bounds
    )


def test_balanced_stages_are_left_alone(tmp_path):
    ctl, _ = _unequal(tmp_path, [1.0, 1.0])
    res = ctl.run()
    assert res["state"] == "finished"
    assert len(FakeGroup.instances) == 1
    assert res["partition"]["measured_imbalance"] == pytest.approx(0.0)
    assert res["partition"]["repartitions"] == []


def test_no_repartition_when_the_restart_would_not_pay(tmp_path):
    ctl, _ = _unequal(tmp_path, [1.0, 0.5])
    run_until(ctl, lambda: ctl.step_count >= 5)
    ctl.pace.restart_s = 1e6  # a restart that costs more than the rest of the job
    res = ctl.run()
    assert len(FakeGroup.instances) == 1 and res["partition"]["repartitions"] == []


def test_below_the_threshold_no_repartition(tmp_path):
    # 1/3 imbalance, but the threshold is higher.
    ctl, _ = _unequal(tmp_path, [1.0, 0.5], **{"parallel.rebalance_threshold": 0.5})
    res = ctl.run()
    assert len(FakeGroup.instances) == 1 and res["partition"]["repartitions"] == []


def test_asked_repartition_happens_at_the_next_boundary(tmp_path):
    ctl, _ = _unequal(tmp_path, [1.0, 1.0], **{"parallel.partition": "uniform"})
    run_until(ctl, lambda: ctl.step_count >= 5)
    ctl.door.request_repartition([3, 9])  # not 8 layers: ignored with a warning
    ctl.step()
    assert any("ignored" in e for e in ctl.door.status()["events"])
    ctl.door.request_repartition([3, 5])
    ctl.run()
    assert [g.bounds for g in FakeGroup.instances] == [[0, 4, 8], [0, 3, 8]]
    assert FakeGroup.instances[1].restored == [50]


@pytest.mark.parametrize(("seen_gone_after_s", "node_lost"), [(0.4, True), (1.5, False)])
def test_a_node_seen_gone_a_moment_after_its_worker_died_is_a_node_loss(
    tmp_path, seen_gone_after_s, node_lost
):
    """Rank 3's process dies on node-1; the node shows as gone `seen_gone_after_s` later.
    Within SPOTLINE_NODE_LOSS_WAIT_S (1 s) that is a spot loss, which uses up no
    failure; after it, a failure of the worker on a live node."""
    ctl, _ = make(tmp_path, script={"kill_at": 15})
    cluster, clock = ctl.cluster, ctl.fake_clock
    checks: list[float] = []  # the clock at each check after the death

    def gone(node_ids):
        checks.append(clock.now)
        if clock.now - checks[0] >= seen_gone_after_s:
            cluster.nodes.discard("node-1")
        return set(node_ids) - cluster.nodes

    cluster.gone = gone
    res = ctl.run()
    assert res["state"] == "finished"
    assert (res["node_losses"], res["failures"]) == ((1, 0) if node_lost else (0, 1))
    # The checks stop at the first sight of the loss, or once the wait is over.
    assert checks[-1] - checks[0] == pytest.approx(0.5 if node_lost else 1.0)


# --- demand to the autoscaler -------------------------------------------------------


def test_the_demand_is_stated_while_waiting_and_withdrawn_when_the_job_gives_up(tmp_path):
    ctl, _ = make(tmp_path, capacity=0, **{"elastic.wait_for_capacity_s": 5})
    ctl.step()
    ctl.step()
    assert isinstance(ctl.state, Waiting)
    assert ctl.fake_demand.calls and set(ctl.fake_demand.calls) == {"keep"}
    res = ctl.run()
    assert res["state"] == "failed"
    assert ctl.fake_demand.calls[-1] == "withdraw"
    assert ctl.fake_demand.calls.count("withdraw") == 1


def test_the_demand_is_kept_while_running_and_withdrawn_at_the_end(tmp_path):
    ctl, _ = make(tmp_path)
    res = ctl.run()
    assert res["state"] == "finished"
    calls = ctl.fake_demand.calls
    assert calls[0] == "keep" and calls[-1] == "withdraw"
    assert "withdraw" not in calls[:-1]


def test_the_demand_is_withdrawn_when_the_job_is_stopped(tmp_path):
    ctl, _ = make(tmp_path, capacity=0)
    ctl.step()
    ctl.step()
    ctl.door.request_stop()
    assert isinstance(ctl.step(), Stopped)
    assert ctl.fake_demand.calls[-1] == "withdraw"


def test_a_lost_node_states_the_demand_again_at_once(tmp_path):
    script = {"kill_at": 17, "lose_node": "node-1"}

    ctl, _ = make(tmp_path, script=script, capacity=_two_nodes)
    res = ctl.run()
    assert res["node_losses"] == 1
    assert ctl.fake_demand.calls.count("force") == 1


# --- hangs and cordons ---------------------------------------------------------------


def test_a_frozen_rank_is_declared_hung_named_and_its_node_cordoned_after_two(tmp_path):
    # Rank 1 (stage 0, replica 1, on node-1) freezes at step 15 in two groups running.
    ctl, store = make(tmp_path, {"freeze": {"at": 15, "rank": 1, "times": 2}})
    run_until(ctl, lambda: ctl.state.terminal)
    assert isinstance(ctl.state, Finished)
    first, second, third = ctl.rec.attempts
    assert first.ended_by == second.ended_by == "hang"
    assert "rank 1 (stage 0, replica 1, node node-1" in first.error
    assert "has not answered for" in first.error and "'forward micro-batch 1'" in first.error
    assert "rank 0 (" not in first.error  # waiting in a collective: held up, not the cause
    # Declared after the bound (20 s floor: 10 x a 50 ms step is less), not after the
    # 600 s collective timeout.
    assert "(bound 20.0s)" in first.error
    assert second.restored_from == third.restored_from == 10
    assert ctl.rec.failures == 2  # hangs count against failure.max_failures
    # Twice on node-1: cordoned, kept beside the checkpoints, and out of the capacity.
    assert ctl.fake_cluster.cordoned == {"node-1"}
    assert "hung 2 times within 1.0h" in ctl.fake_cluster.cordoned.get("node-1").why
    saved = json.loads(store.read_artifact("cordon.json"))
    assert list(saved["cordoned"]) == ["node-1"] and len(saved["hangs"]["node-1"]) == 2
    rows = dict(status_rows(ctl.door.status()))
    assert rows["cordoned"].startswith("node node-1") and rows["hangs"] == "2"
    assert "expires in 6.0h" in rows["cordoned"]

    # A new controller of the same job keeps node-1 out before it places anything.
    again, _ = make(tmp_path, **{"train.steps": 30})
    again.step()  # pending
    assert again.fake_cluster.cordoned == {"node-1"}
    assert again.cordons.view()["cordoned"] == ctl.cordons.view()["cordoned"]


def test_a_third_hang_fails_the_job_when_max_failures_is_two(tmp_path):
    ctl, _ = make(
        tmp_path, {"freeze": {"at": 15, "rank": 1, "times": 3}}, **{"failure.cordon": False}
    )
    run_until(ctl, lambda: ctl.state.terminal)
    assert isinstance(ctl.state, Failed)
    assert "3 transient worker failures" in ctl.rec.error and "hang" in ctl.rec.error
    assert ctl.fake_cluster.cordoned == set()  # failure.cordon: false


def test_a_node_is_not_cordoned_when_the_job_could_not_run_without_it(tmp_path):
    # One replica fits on the cluster, and the live group holds it: without node-0
    # nothing is left for min_replicas 1.
    def capacity(held, cluster):
        live = FakeGroup.instances and FakeGroup.instances[-1].running
        return held // 2 + (0 if live else 1)

    ctl, _ = make(
        tmp_path,
        {"freeze": {"at": 15, "rank": 0, "times": 2}},
        capacity=capacity,
        **{"elastic.max_replicas": 1, "failure.cordon_after_hangs": 1},
    )
    run_until(ctl, lambda: ctl.state.terminal)
    assert isinstance(ctl.state, Finished)
    assert ctl.fake_cluster.cordoned == set()
    assert any(
        "not cordoned, as without it the cluster holds 0 replica(s)" in e
        for e in ctl.events.since(0)[0]
    )


def test_a_straggler_is_reported_and_its_node_left_at_the_next_boundary(tmp_path):
    # node-1's ranks compute 3x slower than their peers; node-2 is spare.
    ctl, _ = make(
        tmp_path,
        {"slow_nodes": {"node-1": 3.0}},
        **{"train.steps": 400, "failure.straggler_window_steps": 10},
    )
    run_until(ctl, lambda: len(ctl.rec.attempts) == 2 and isinstance(ctl.state, Running))
    first = ctl.rec.attempts[0]
    assert first.ended_by == "cordon"
    events = ctl.events.since(0)[0]
    straggled = [e for e in events if e.startswith("straggler: rank 1 (stage 0, replica 1)")]
    assert straggled and "node node-1 computes 200% slower than its peers" in straggled[0]
    assert ctl.fake_cluster.cordoned == {"node-1"}
    assert "computed 200% slower" in ctl.fake_cluster.cordoned.get("node-1").why
    # Left at a checkpoint boundary, and the next group runs on node-0 and node-2.
    second = FakeGroup.instances[-1]
    assert second.restored[-1] % 10 == 0 and second.restored[-1] == first.losses[-1][0]
    assert "node-1" not in second.node_ids() and second.replicas == 2
    ctl.door.request_stop()
    run_until(ctl, lambda: ctl.state.terminal)


def test_a_group_whose_only_restore_is_a_peer_copy_still_initialises_its_weights(tmp_path):
    """Nothing is committed yet and the failed group left a complete peer copy: the next
    group is built with its random init all the same, so a peer copy that no rank can
    read leaves it training from the start, not refusing to step on empty weights."""
    from spotline.checkpoint.peer import PEER_KEY, PeerOffer
    from spotline.checkpoint.transfer import build_manifest
    from spotline.runtime.keeper import PeerMemory

    ctl, store = make(tmp_path, {"kill_at": 7, "peer_unreadable": True})
    asked = []

    class Keepers(PeerMemory):  # the failed group's step 5, complete in live nodes' memory
        def offer(self, attempt, world, partition, at=None, leaving=frozenset()):
            asked.append(attempt)
            results = [UploadResult(5, r, attempt, world, [], []) for r in range(world)]
            manifest = build_manifest(ctl.spec, 5, attempt, world, results)
            manifest.extra[PEER_KEY] = {"holders": {}}
            return PeerOffer(5, attempt, manifest)

        def retain(self, attempts):
            pass

    ctl.recovery.peers = Keepers(ctl.spec)
    run_until(ctl, lambda: ctl.state.terminal)
    assert isinstance(ctl.state, Finished), ctl.state
    first, second = FakeGroup.instances[:2]
    assert asked == [first.attempt]
    assert first.init and second.init and second.restored == []
    assert any("peer copy of step 5 could not be restored" in e for e in ctl.events.since(0)[0])


def test_faults_listed_for_a_job_not_marked_as_a_test_are_said_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SPOTLINE_TEST_FAULTS", str(tmp_path / "faults"))
    (tmp_path / "faults").mkdir()
    (tmp_path / "faults" / "ctl.json").write_text('[{"kind": "slow", "rank": 1}]')
    ctl, _ = make(tmp_path)
    ctl.run()
    said = [e for e in ctl.door.status()["events"] if "SPOTLINE_TEST_FAULTS" in e]
    assert len(said) == 1 and "none is applied" in said[0]
    marked, _ = make(tmp_path / "marked", **{"failure.test_faults": True})
    assert not any("SPOTLINE_TEST_FAULTS" in e for e in marked.door.status()["events"])


# --- a group's start never blocks the loop --------------------------------------------------


def test_while_a_group_starts_the_loop_steps_and_status_answers(tmp_path):
    ctl, _ = make(tmp_path, script={"start_polls": 5})
    run_until(ctl, lambda: isinstance(ctl.state, Starting))
    started = ctl.fake_clock.now
    assert ctl.door.status()["state"] == "starting"
    run_until(ctl, lambda: isinstance(ctl.state, Running))
    # Each step moved the start on for at most a poll interval, then came back.
    assert ctl.fake_clock.now - started <= 6 * constants.SPOTLINE_POLL_INTERVAL_S
    assert ctl.run()["state"] == "finished"


def test_a_stop_during_a_start_is_taken_at_once(tmp_path):
    ctl, _ = make(tmp_path, script={"start_polls": 10**6})
    run_until(ctl, lambda: isinstance(ctl.state, Starting))
    ctl.door.request_stop("operator")
    ctl.step()
    assert isinstance(ctl.state, Stopped) and FakeGroup.instances[0].shut


def test_a_notice_for_a_starting_groups_node_starts_it_again_without_that_node(tmp_path):
    ctl, _ = make(tmp_path, script={"start_polls": 3}, capacity=_devices({"nodes": 3}))
    run_until(ctl, lambda: isinstance(ctl.state, Starting))
    first = FakeGroup.instances[0]
    doomed = first.nodes[-1]
    assert ctl.door.notify(_notice(doomed))
    ctl.step()  # taken at once: the start ends, and the next one begins off that node
    assert first.shut and len(FakeGroup.instances) == 2
    said = [e for e in ctl.door.status()["events"] if "starting the group again" in e]
    assert len(said) == 1 and "a node of the group being started is doomed" in said[0]
    assert ctl.run()["state"] == "finished"
    second = FakeGroup.instances[1]
    assert doomed not in second.nodes and ctl.rec.attempts[0].ended_by == "preemption notice"


def test_a_rank_that_fails_its_start_is_a_failure_and_the_job_starts_again(tmp_path):
    ctl, _ = make(tmp_path, script={"start_polls": 2, "fail_starting": True})
    res = ctl.run()
    assert res["state"] == "finished" and ctl.rec.failures == 1
    assert "binding failed" in ctl.rec.attempts[0].error
