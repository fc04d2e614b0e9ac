"""The controller's test fakes: a worker group whose ranks "train" on their own, a
cluster, a clock, a demand and replicas started ahead, and `make` to build a controller
over them (`tests/test_controller*.py` and others drive the real state machine with
these).

No Ray and no DeepSpeed: the fake group's ranks train like real ones (a deterministic
loss per step, a few steps per poll), save at every checkpoint interval and at the
steps the controller asks for, write their files and receipts into a real file://
store under their attempt, and report finished uploads one poll later, so commits,
fallbacks and restarts run the real commit coordinator.
"""

from __future__ import annotations

import tempfile
import time

from spotline.checkpoint import CheckpointStore, CorruptCheckpointError
from spotline.checkpoint.manifest import Receipt
from spotline.checkpoint.transfer import UploadResult, attempt_dir, job_identity
from spotline.config import load_spec
from spotline.controller import Controller
from spotline.controller.clock import Clock
from spotline.runtime.cluster import CordonList
from spotline.runtime.progress import PROCESS_DIED, Progress, RankBeat, WorkerFailure
from spotline.train.health import DATA_PHASE


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
            sigterm = self.script.get("sigterms", {}).pop(self.step, None)
            if sigterm is not None:  # as a rank's SIGTERM: its notice, and save and stop now
                self.controller.door.notify(sigterm)
                self.stop_at, self.reason = self.step, "SIGTERM to rank 1"
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
        """The replicas off `leaving` go on (recovery.in_place); a fake has no process.
        The script's `abort_hung` (a node): a rank's abort hung there, so its replica
        does not go on either."""
        hung = self.script.pop("abort_hung", None)
        why = "aborting its NCCL communicators did not return within 30s"
        self.comms_hung = {hung: f"rank 0 there: {why}"} if hung else {}
        self.left_behind = {0: f"hung: {why}"} if hung else {}
        self.handed = set(leaving)
        gone = set(leaving) | set(self.comms_hung)
        self.survivors_out = FakeSurvivors([n for n in self.nodes if n not in gone])
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


def _notice(node, deadline=None, source="ray-drain"):
    deadline = time.time() + 20 if deadline is None else deadline
    return {"source": source, "node_id": node, "deadline": deadline, "reason": "node draining"}


def _devices(total):
    """Capacity over `total` replica-sized nodes, of which the live fake group holds some."""

    def capacity(held, cluster):
        live = sum(g.replicas for g in FakeGroup.instances if not g.shut)
        return max(0, total["nodes"] - len(set(cluster.drained)) - live + held // 2)

    return capacity


def _two_nodes(held, cluster):
    """Capacity of two one-replica nodes, node-0 and node-1, while they live."""
    live = sum(g.replicas for g in FakeGroup.instances if not g.shut)
    return len(cluster.nodes & {"node-0", "node-1"}) - live + held // 2


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
