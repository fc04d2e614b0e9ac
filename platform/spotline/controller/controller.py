"""The job controller: an explicit state machine over a worker group.

`Controller.step()` runs one iteration: it looks at the current state, does one
thing, and moves to the next state. Policies decide (restart or fail, how many
replicas); the controller carries the decision out. The worker group is
injected, so tests drive the machine with a fake group one step at a time.

The controller is the only writer of manifests: a checkpoint is committed when
every rank of the group that saved it has reported its upload.

Spot capacity: a preemption notice (from a node watcher, a Ray drain, or a SIGTERM a
worker saw) makes every rank stop at the next step boundary and commit a
just-in-time checkpoint. The doomed node is drained so Ray places nothing new on
it, and the job restarts at once on the capacity that is left, resharded. A node
lost without notice resumes from the latest commit. Below elastic.min_replicas the
controller waits (WAITING) up to elastic.wait_for_capacity_s. When capacity comes
back it grows toward max_replicas at a checkpoint boundary, by `GrowPolicy`'s rule.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spotline import constants
from spotline.backfill.pool import BackfillPool
from spotline.bubbles.book import BubbleBook
from spotline.checkpoint import (
    TRACE_ARTIFACT,
    CheckpointMismatchError,
    CheckpointStore,
    CorruptCheckpointError,
    FileEntry,
    Manifest,
    StorageError,
)
from spotline.config.redact import redact
from spotline.config.schema import JobSpec
from spotline.controller.cluster import ClusterView
from spotline.controller.policies import (
    Fail,
    FailurePolicy,
    GrowPolicy,
    Resize,
    ScalingPolicy,
    Wait,
    classify,
)
from spotline.controller.state import State
from spotline.controller.telemetry import Telemetry
from spotline.workers.group import WorkerFailure, WorkerGroup

log = logging.getLogger("spotline.controller")


@dataclass
class Attempt:
    """One life of a worker group: where it started and the losses it produced."""

    replicas: int
    start_step: int = 0
    restored_from: int | None = None
    losses: list[tuple[int, float]] = field(default_factory=list)
    error: str | None = None
    ended_by: str | None = None  # "failure", "node lost", "preemption notice", "grow"


class Controller:
    def __init__(
        self,
        spec: JobSpec,
        store: CheckpointStore,
        group_factory: Callable[[int], WorkerGroup],
        cluster: ClusterView,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.spec = spec
        self.store = store
        self.group_factory = group_factory
        self.cluster = cluster
        self.sleep = sleep
        self.clock = clock
        e = spec.elastic
        self.failure_policy = FailurePolicy(spec.failure.max_failures)
        self.scaling_policy = ScalingPolicy(e.min_replicas, e.max_replicas, spec.replica_counts())
        self.grow_policy = GrowPolicy(self.scaling_policy, e.scale_up_interval_s)

        self.state = State.PENDING
        self.group: WorkerGroup | None = None
        self.step_count = 0  # optimizer steps reached by the live group
        self.failures = 0
        self.attempts: list[Attempt] = []
        self.losses: dict[int, float] = {}
        self.committed: list[int] = []
        self.blocked_s: list[float] = []
        self.upload_s: list[float] = []
        self.upload_bytes: list[int] = []
        self.heldout_loss: float | None = None
        self.error: str | None = None
        self.train_seconds = 0.0
        self.steps_trained = 0
        self.started_at = time.time()
        self.finished_at: float | None = None
        self._grow_to = 0
        self._waiting_since: float | None = None
        self._waiting_reason: str | None = None
        self.waited_s = 0.0
        self._uploads: dict[int, list[Any]] = {}
        self._save_world: dict[int, int] = {}
        self._events: list[str] = []
        self._lock = threading.Lock()
        # Spot capacity.
        self._notice_keys: set[tuple] = set()
        self._pending_notices: list[dict[str, Any]] = []
        self._jit: list[dict[str, Any]] = []  # notices the next checkpoint answers
        self.notices: list[dict[str, Any]] = []  # every notice, with what came of it
        self.doomed: dict[str, float] = {}  # node id -> deadline
        self.node_losses = 0
        self.resizes: list[dict[str, Any]] = []
        self.recoveries: list[dict[str, Any]] = []
        self._interrupted_at: tuple[float, str] | None = None  # (clock, why) until resumed
        self._last_resize = self.clock()
        self._restart_s: float | None = None  # measured cost of the last (re)start
        self._sps_by_replicas: dict[int, float] = {}  # latest measured rate at each size
        self._stop_reason: str | None = None
        # Pipeline bubbles and the backfill that fills them.
        pp = spec.parallel.pipeline_stages
        self.bubbles = BubbleBook(pp) if pp > 1 else None
        self.telemetry = Telemetry(spec, self._event)
        self.backfill = (
            BackfillPool(spec, self._event, on_result=self._backfill_result)
            if spec.backfill.enabled
            else None
        )
        self._chunks_in_group = 0
        self._last_world = 0  # devices of the latest group (charged while waiting)
        self._owns_store = False  # the URI holds no other job's checkpoints (see _pending)
        self._chunk_charged_s = 0.0

    # --- reporting ----------------------------------------------------------------

    def _event(self, text: str, level: int = logging.INFO) -> None:
        text = redact(text)
        log.log(level, text)
        with self._lock:
            self._events.append(text)

    def status(self, since_event: int = 0) -> dict[str, Any]:
        # Called from another thread of the actor while run() may swap the group out.
        group = self.group
        with self._lock:
            events = self._events[since_event:]
            n_events = len(self._events)
        return {
            **self._headline(group),
            "failures": self.failures,
            "node_losses": self.node_losses,
            "preemption_notices": len(self.notices),
            "waiting": self._waiting_reason,
            "doomed_nodes": sorted(self.doomed),
            "committed_steps": list(self.committed),
            "workers": group.worker_info() if group else [],
            "events": events,
            "next_event": n_events,
            "error": self.error,
        }

    def _headline(self, group: WorkerGroup | None) -> dict[str, Any]:
        return {
            "name": self.spec.name,
            "state": self.state.value,
            "step": self.step_count,
            "total_steps": self.spec.train.steps,
            "replicas": group.replicas if group else 0,
            "max_replicas": self.spec.elastic.max_replicas,
        }

    def result(self) -> dict[str, Any]:
        t = self.spec.train
        tokens = self.steps_trained * t.global_batch_size * self.spec.model.seq_len
        last = max(self.losses) if self.losses else None
        return {
            "name": self.spec.name,
            "state": self.state.value,
            "steps": self.step_count,
            "losses": dict(sorted(self.losses.items())),
            "attempts": [a.__dict__ for a in self.attempts],
            "final_train_loss": self.losses[last] if last is not None else None,
            "heldout_loss": self.heldout_loss,
            "steps_per_s": self.steps_trained / self.train_seconds if self.train_seconds else 0.0,
            "tokens_per_s": tokens / self.train_seconds if self.train_seconds else 0.0,
            "checkpoint_uri": self.store.uri,
            "committed_steps": list(self.committed),
            "failures": self.failures,
            "checkpoint_blocked_s": list(self.blocked_s),
            "checkpoint_upload_s": list(self.upload_s),
            "checkpoint_bytes": list(self.upload_bytes),
            "wall_s": (self.finished_at or time.time()) - self.started_at,
            "error": self.error,
            "notices": [dict(n) for n in self.notices],
            "node_losses": self.node_losses,
            "resizes": list(self.resizes),
            "recoveries": list(self.recoveries),
            "waited_s": self.waited_s,
            "ledger": self.telemetry.ledger_summary(),
            "cost": self.telemetry.cost(),
            "alerts": [a.message() for a in self.telemetry.deviation.alerts],
            "bubbles": self.bubbles.summary() if self.bubbles else None,
            "backfill": (
                {"tasks": self.backfill.results(), **self.backfill.summary()}
                if self.backfill
                else None
            ),
        }

    # --- the machine --------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        while not self.state.terminal:
            self.step()
        return self.result()

    def step(self) -> State:
        handler = {
            State.PENDING: self._pending,
            State.SCHEDULING: self._scheduling,
            State.WAITING: self._scheduling,
            State.RUNNING: self._running,
            State.CHECKPOINTING: self._checkpointing,
            State.RESIZING: self._resizing,
            State.RECOVERING: self._recovering,
            State.FINISHING: self._finishing,
        }[self.state]
        state, t0 = self.state, time.monotonic()
        first_start = not self.attempts
        chunk_failed = False
        try:
            if self._stop_reason is not None and self.state not in (
                State.RUNNING,
                State.CHECKPOINTING,
            ):
                self.state = self._stopped()
                return self.state
            self.state = handler()
        except WorkerFailure as e:
            chunk_failed = state is State.RUNNING
            self.state = self._on_failure(str(e), e.process_died, e.causes)
        except (CheckpointMismatchError, CorruptCheckpointError) as e:
            self.state = self._fail(str(e))
        except StorageError as e:
            # Storage unreachable while scheduling or restoring: a restart retries it.
            self.state = self._on_failure(f"checkpoint storage: {e}")
        except Exception as e:  # noqa: BLE001 - nothing may leave workers behind
            log.exception("unexpected error in the controller")
            self.state = self._fail(
                f"internal error in the controller while {state.value}: "
                f"{type(e).__name__}: {e}. This is a Spotline bug; the job resumes from its "
                "latest committed checkpoint when resubmitted"
            )
        if self.group is not None:
            self._last_world = self.group.world_size
        elapsed = time.monotonic() - t0 - self._chunk_charged_s
        self._chunk_charged_s = 0.0
        self.telemetry.charge(state, elapsed, self._last_world, first_start, chunk_failed)
        if self.state.terminal:
            self.finished_at = time.time()
            self._write_artifacts(with_trace=False)  # the group is gone; the last trace stands
            self.cluster.close()
        return self.state

    def _fail(self, reason: str) -> State:
        reason = redact(" ".join(reason.split()))  # one line, and never a secret
        self.error = reason
        self._event(f"FAILED: {reason}", logging.ERROR)
        self._teardown()
        return State.FAILED

    def _pending(self) -> State:
        self._event(f"job {self.spec.name}: checkpoints at {self.store.uri}")
        # The preflight checked this already; checked again here, before anything is
        # written, because another job may have committed there since.
        self.store.check_owner(self.spec)
        self._owns_store = True
        self._store_tokenizer()
        self.telemetry.resume(self.store)
        return State.SCHEDULING

    def _store_tokenizer(self) -> None:
        """Keep the job's tokenizer files beside its checkpoints, so an export carries the
        tokenizer the model was trained with, wherever the original lives."""
        from spotline.data.tokenizer import tokenizer_files
        from spotline.export import TOKENIZER_ARTIFACTS

        try:
            for name, data in tokenizer_files(self.spec).items():
                self.store.write_artifact(f"{TOKENIZER_ARTIFACTS}/{name}", data)
        except (StorageError, ValueError) as e:  # ValueError: DataError reading the files
            self._event(
                f"could not store the tokenizer beside the checkpoints: {e}", logging.WARNING
            )

    def _scheduling(self) -> State:
        self.cluster.watch()
        decision = self.scaling_policy.decide(self.cluster.capacity())
        want = max(self._grow_to, self.spec.elastic.min_replicas)
        if self._waiting_since is None:
            # Right after a teardown Ray takes a moment to free the old group's devices:
            # read again before settling for fewer replicas than wanted.
            for _ in range(constants.SPOTLINE_CAPACITY_SETTLE_CHECKS):
                if isinstance(decision, Resize) and decision.replicas >= want:
                    break
                self.sleep(1.0)
                decision = self.scaling_policy.decide(self.cluster.capacity())
        self._grow_to = 0
        if isinstance(decision, Wait):
            return self._wait_for_capacity(decision.reason)
        assert isinstance(decision, Resize)
        if self._waiting_since is not None:
            self.waited_s += self.clock() - self._waiting_since
            self._event(f"capacity is back: {decision.replicas} replica(s) fit")
        self._waiting_since = self._waiting_reason = None
        t0 = self.clock()
        attempt = Attempt(replicas=decision.replicas)
        self.attempts.append(attempt)
        pp = self.spec.parallel.pipeline_stages
        self._event(
            f"starting {decision.replicas} replica(s) x {pp} stage(s) = {decision.replicas * pp} "
            f"workers (elastic {self.spec.elastic.min_replicas}..{self.spec.elastic.max_replicas})"
        )
        if self.resizes and "to_replicas" not in self.resizes[-1]:
            self.resizes[-1]["to_replicas"] = decision.replicas
        self.group = self.group_factory(decision.replicas)
        self.group.start()
        self.telemetry.peak_flops = self.group.peak_flops()
        self._chunks_in_group = 0
        if self.bubbles is not None:
            self.bubbles.reset_ranks()
        if self.backfill is not None:
            self.backfill.attach(self.group.executors())
        reached = self.step_count
        self.step_count = self._restore_latest(attempt)
        attempt.start_step = self.step_count
        self.telemetry.ledger.lost(reached - self.step_count)  # trained again from here
        self._restart_s = self.clock() - t0
        self._last_resize = self.clock()
        if self.step_count >= self.spec.train.steps:
            return State.FINISHING
        return State.RUNNING

    def _wait_for_capacity(self, reason: str) -> State:
        now = self.clock()
        limit = self.spec.elastic.wait_for_capacity_s
        if self._waiting_since is None:
            self._waiting_since = now
            self._waiting_reason = reason
            self._event(
                f"{reason} Waiting up to {limit:.0f}s (elastic.wait_for_capacity_s).",
                logging.WARNING,
            )
        if now - self._waiting_since > limit:
            self.waited_s += now - self._waiting_since
            last = max(self.store.committed_steps(), default=None)
            resume = (
                f"the job resumes from committed step {last} at {self.store.uri}"
                if last is not None
                else "no step was committed yet"
            )
            return self._fail(
                f"{reason} Gave up after waiting {limit:.0f}s (elastic.wait_for_capacity_s). "
                f"Add nodes or lower elastic.min_replicas, then resubmit: {resume}."
            )
        self.sleep(1.0)
        return State.WAITING

    def _restore_latest(self, attempt: Attempt) -> int:
        assert self.group is not None
        self._commit_from_receipts()
        steps = sorted(self.store.committed_steps(), reverse=True)
        self.committed = sorted(steps)
        for i, step in enumerate(steps):
            manifest = self.store.load_manifest(step)
            reshard = self._check_compatible(manifest)
            try:
                restored = self.group.restore(manifest)
            except CorruptCheckpointError as e:
                older = steps[i + 1] if i + 1 < len(steps) else None
                nxt = (
                    f"falling back to step {older}" if older is not None else "no older step to try"
                )
                self._event(
                    f"checkpoint step {step} at {self.store.uri} failed verification "
                    f"({getattr(e, 'path', '?')}: {getattr(e, 'reason', e)}); {nxt}",
                    logging.WARNING,
                )
                continue
            attempt.restored_from = step
            how = (
                f", resharded from {manifest.topology['replicas']} to {self.group.replicas} replica(s)"
                if reshard
                else ""
            )
            self._event(f"restored committed checkpoint step {step} (sha256 verified{how})")
            return restored
        if steps:
            raise CorruptCheckpointError(
                steps[-1],
                "*",
                "every committed step failed verification",
                uri=self.store.uri,
                message=f"every committed checkpoint at {self.store.uri} failed verification "
                f"(steps {sorted(steps)}); refusing to start from scratch over them. Inspect or "
                "move them, or point checkpoint.uri at an empty location.",
            )
        return 0

    def _check_compatible(self, m: Manifest) -> bool:
        """Raise if this job cannot resume `m`; return True if it must reshard to do so."""
        if m.spec_hash != self.spec.spec_hash() or m.extra.get("job") != self.spec.name:
            raise CheckpointMismatchError(
                self.store.describe_mismatch(
                    self.spec, m.extra.get("job"), m.spec_hash, m.extra.get("spec"), m.step
                )
            )
        assert self.group is not None
        saved_pp, saved_d = m.topology.get("pipeline_stages"), m.topology.get("replicas")
        pp = self.spec.parallel.pipeline_stages
        if saved_pp != pp:
            raise CheckpointMismatchError(
                f"checkpoint step {m.step} was saved with {saved_pp} pipeline stage(s), this job has "
                f"{pp}; changing parallel.pipeline_stages on resume is not supported: keep {saved_pp}."
            )
        if saved_d == self.group.replicas:
            return False
        if self.spec.parallel.zero_stage > 2:
            raise CheckpointMismatchError(
                f"checkpoint step {m.step} was saved with {saved_d} replica(s) and this group has "
                f"{self.group.replicas}; ZeRO-3 checkpoints reload only at the size that wrote them. "
                f"Give the job {saved_d} replica(s) (elastic.min_replicas), or use ZeRO 1-2."
            )
        return True

    def _next_boundary(self) -> int:
        interval = self.spec.checkpoint.interval_steps
        nxt = (self.step_count // interval + 1) * interval
        return min(nxt, self.spec.train.steps)

    def _running(self) -> State:
        assert self.group is not None
        if self._take_notices() or self._stop_reason is not None:
            return State.CHECKPOINTING
        n = min(self._next_boundary() - self.step_count, constants.SPOTLINE_MAX_STEPS_PER_CHUNK)
        if self._interrupted_at is not None:
            n = 1  # time the first step after a restart on its own
        t0 = time.perf_counter()
        chunk = self.group.train(n)
        seconds = time.perf_counter() - t0
        self.train_seconds += seconds
        done = len(chunk.losses)
        self.steps_trained += done
        if done and n > 1:  # single steps after a restart include warm-up
            self._sps_by_replicas[self.group.replicas] = done / seconds
        self.attempts[-1].losses.extend(chunk.losses)
        for step, loss in chunk.losses:
            self.losses[step] = loss
        if chunk.losses:
            self.step_count = chunk.losses[-1][0]
        if self._interrupted_at is not None and done:
            since, why = self._interrupted_at
            self._interrupted_at = None
            self.recoveries.append(
                {
                    "why": why,
                    "seconds": self.clock() - since,
                    "resumed_at_step": self.step_count,
                    "resumed_at": time.time(),
                }
            )
            self._event(f"training again {self.clock() - since:.1f}s after the {why}")
        self._chunks_in_group += 1
        if self.bubbles is not None:
            on = self.backfill is not None and not self.backfill.governor.decision().paused
            self.bubbles.add(chunk.bubbles, self.spec.grad_accum(self.group.replicas), on)
        # The first chunk of a group includes its warm-up: not a fair step time.
        warm = self._chunks_in_group > 1 and n > 1
        if self.backfill is not None:
            self.backfill.on_chunk(done, seconds, warm=warm)
            self.backfill.poll()
        self._chunk_charged_s = self.telemetry.chunk(
            steps=chunk.losses,
            seconds=seconds,
            replicas=self.group.replicas,
            world=self.group.world_size,
            bubbles=self.bubbles.last_chunk if self.bubbles else None,
            per_rank=chunk.bubbles,
            lr=chunk.lr,
            backfill_slowdown=self.backfill.governor.slowdown if self.backfill else None,
            data_stall_s=chunk.data_stall_s,
            warm=warm,
            uploading=bool(self._save_world),  # saved steps whose uploads are still running
        )
        self._export_counts()
        self._report_progress(chunk)
        self._collect_uploads(chunk.uploads)
        for notice in chunk.notices:
            self.notify(notice)
        if self._take_notices() or self._stop_reason is not None:
            return State.CHECKPOINTING
        if (
            self.step_count % self.spec.checkpoint.interval_steps == 0
            or self.step_count >= self.spec.train.steps
        ):
            return State.CHECKPOINTING
        return State.RUNNING

    def _report_progress(self, chunk) -> None:
        every = self.spec.train.log_every
        steps = [s for s, _ in chunk.losses]
        if steps and any(s % every == 0 for s in steps) or self.step_count >= self.spec.train.steps:
            t = self.spec.train
            sps = len(steps) / chunk.seconds if chunk.seconds else 0.0
            tok = sps * t.global_batch_size * self.spec.model.seq_len
            self._event(
                f"step {self.step_count}/{t.steps}  loss {chunk.losses[-1][1]:.4f}  "
                f"{sps:.2f} steps/s  {tok:,.0f} tokens/s"
            )

    def _checkpointing(self) -> State:
        assert self.group is not None
        # A step the live group already saved (a notice right at a checkpoint boundary)
        # is not saved again: its upload may still be reading the staged files.
        if self.step_count not in self.committed and self.step_count not in self._save_world:
            blocked = self.group.save()
            self.blocked_s.append(blocked)
            self._save_world[self.step_count] = self.group.world_size
        if self._jit:
            return self._answer_notices()
        if self._stop_reason is not None:
            self._collect_uploads(self.group.flush_uploads())
            return self._stopped()
        if self.step_count >= self.spec.train.steps:
            return State.FINISHING
        if self._should_grow():
            return State.RESIZING
        return State.RUNNING

    def _finishing(self) -> State:
        assert self.group is not None
        self.heldout_loss = self.group.heldout_loss()
        self._collect_uploads(self.group.flush_uploads())
        if self.backfill is not None:
            self.backfill.finish(self.spec.backfill.finish_timeout_s, self.sleep)
            self._export_counts()
        self._write_artifacts()
        self._teardown()
        if self.spec.train.steps not in self.committed:
            return self._fail(f"the final checkpoint (step {self.spec.train.steps}) did not commit")
        self._event(
            f"finished {self.step_count} steps; held-out loss {self.heldout_loss:.4f}; "
            f"checkpoints: {self.store.step_uri(self.committed[-1])}"
        )
        return State.FINISHED

    def _on_failure(
        self, error: str, process_died: bool = False, causes: list[BaseException] | None = None
    ) -> State:
        lost = self._lost_nodes(patient=process_died)
        if self.attempts:
            self.attempts[-1].error = error
            self.attempts[-1].ended_by = "node lost" if lost else "failure"
        self._teardown()
        self._interrupted_at = (self.clock(), "node loss" if lost else "failure")
        latest = max(self.committed, default=None)
        if lost:
            # Losing spot nodes is the normal weather, not a fault of the job: it does not
            # use up failure.max_failures.
            self.node_losses += len(lost)
            for node in lost:
                self.doomed.pop(node, None)
            self._event(
                f"lost node(s) {', '.join(n[:12] for n in sorted(lost))} at step "
                f"{self.step_count}; resuming from the latest committed step ({latest}) on "
                f"what is left",
                logging.WARNING,
            )
            return State.RECOVERING
        kind = classify(causes or [], error)
        if kind.retryable:  # only transient faults use up failure.max_failures
            self.failures += 1
        self._event(f"worker failure at step {self.step_count}: {error}", logging.WARNING)
        decision = self.failure_policy.decide(self.failures, error, kind)
        if isinstance(decision, Fail):
            return self._fail(decision.reason)
        self._event(decision.reason)
        return State.RECOVERING

    def _lost_nodes(self, patient: bool) -> set[str]:
        """Nodes of the live group that are gone. A failure may surface first as a peer's
        collective error; a worker reported dead gets a few checks, as its node can be
        seen gone a moment after its processes."""
        if self.group is None:
            return set()
        mine = self.group.node_ids()
        for _ in range(constants.SPOTLINE_NODE_LOSS_CHECKS if patient else 1):
            lost = self.cluster.gone(mine)
            if lost:
                return lost
            if patient:
                self.sleep(1.0)
        return set()

    def _recovering(self) -> State:
        return State.SCHEDULING

    # --- spot capacity --------------------------------------------------------------

    def notify(self, notice: dict[str, Any]) -> None:
        """A preemption notice (Notice fields). Thread-safe: node watchers call it any time.

        When the doomed node runs ranks of the live group, every rank is asked to stop at
        the next step boundary, so the just-in-time checkpoint starts within one step.
        """
        key = (notice["source"], notice.get("node_id"), notice["deadline"])
        with self._lock:
            if key in self._notice_keys:
                return
            self._notice_keys.add(key)
            record = dict(notice, received_at=time.time(), received_clock=self.clock())
            self._pending_notices.append(record)
        node = notice.get("node_id")
        if node is not None:
            self.doomed[node] = notice["deadline"]
        group = self.group
        if group is not None and (node is None or node in group.node_ids()):
            group.request_checkpoint(f"{notice['source']}: {notice['reason']}")

    def _take_notices(self) -> bool:
        """Move pending notices that concern the live group to the JIT list; True if any."""
        with self._lock:
            pending, self._pending_notices = self._pending_notices, []
        mine = self.group.node_ids() if self.group is not None else set()
        for n in pending:
            node = n.get("node_id")
            left = n["deadline"] - time.time()
            where = f"node {node[:12]}" if node else "an unnamed node"
            self._event(
                f"preemption notice ({n['source']}: {n['reason']}) for {where}, "
                f"{left:.0f}s before its deadline",
                logging.WARNING,
            )
            if node is not None:
                self.cluster.drain(node, n["deadline"], f"{n['source']}: {n['reason']}")
            n["step"] = self.step_count
            if node is None or node in mine:
                self._jit.append(n)
            else:
                n["outcome"] = "no ranks of this job on that node"
                self.notices.append(n)
        return bool(self._jit)

    def _answer_notices(self) -> State:
        """Commit the just-saved step now, then restart off the doomed nodes."""
        assert self.group is not None
        step = self.step_count
        self._collect_uploads(self.group.flush_uploads())
        committed = step in self.committed
        now = self.clock()
        for n in self._jit:
            n["committed_step"] = step if committed else max(self.committed, default=None)
            n["notice_to_commit_s"] = now - n["received_clock"] if committed else None
            n["committed_at"] = time.time() if committed else None
            n["before_deadline_s"] = n["deadline"] - time.time()
            n["outcome"] = "just-in-time checkpoint committed" if committed else "commit failed"
            self.notices.append(n)
        first = self._jit[0]
        self._jit = []
        if committed:
            took = now - first["received_clock"]
            budget = self.spec.preemption.jit_checkpoint_budget_s
            self._event(
                f"just-in-time checkpoint step {step} committed {took:.1f}s after the notice, "
                f"{first['deadline'] - time.time():.0f}s before the deadline"
                + (
                    f"; that is over preemption.jit_checkpoint_budget_s ({budget:.0f}s): "
                    "shorten steps (fewer micro-batches) or raise the budget and the "
                    "nodes' grace period"
                    if took > budget
                    else ""
                ),
                logging.WARNING if took > budget else logging.INFO,
            )
        else:
            self._event(
                f"just-in-time checkpoint step {step} did not commit; the latest committed "
                f"step is {max(self.committed, default=None)}",
                logging.WARNING,
            )
        doomed_here = self.group.node_ids() & set(self.doomed)
        if not doomed_here:
            return State.RUNNING
        self.attempts[-1].ended_by = "preemption notice"
        self._restart("preemption", f"leaving node(s) {', '.join(n[:12] for n in doomed_here)}")
        return State.SCHEDULING

    def request_stop(self, reason: str = "stop requested") -> None:
        """Stop at the next step boundary, commit a checkpoint there, and end STOPPED.

        Thread-safe. The job resumes from that checkpoint when it is submitted again.
        """
        self._stop_reason = reason
        group = self.group
        if group is not None:
            group.request_checkpoint(reason)

    def _stopped(self) -> State:
        self._teardown()
        latest = max(self.committed, default=None)
        self._event(
            f"stopped at step {self.step_count} ({self._stop_reason}); latest committed "
            f"step {latest} at {self.store.uri}: submitting the job again resumes there"
        )
        return State.STOPPED

    def _should_grow(self) -> bool:
        assert self.group is not None
        e = self.spec.elastic
        if self.group.replicas >= e.max_replicas:
            return False
        capacity = self.cluster.capacity(held_workers=self.group.world_size)
        decision = self.grow_policy.decide(
            replicas=self.group.replicas,
            capacity=capacity,
            steps_left=self.spec.train.steps - self.step_count,
            steps_per_s=self._sps_by_replicas.get(self.group.replicas, 0.0),
            restart_s=self._restart_s or 0.0,
            since_resize_s=self.clock() - self._last_resize,
            measured=self._sps_by_replicas,
        )
        if decision is None:
            return False
        self._grow_to = decision.replicas
        return True

    def _resizing(self) -> State:
        """Grow: commit the boundary checkpoint, then restart bigger from it."""
        assert self.group is not None
        self._collect_uploads(self.group.flush_uploads())
        if self.step_count not in self.committed:
            self._event(
                f"not growing: checkpoint step {self.step_count} did not commit", logging.WARNING
            )
            return State.RUNNING
        self.attempts[-1].ended_by = "grow"
        self._restart(
            "grow",
            f"capacity for {self._grow_to} replica(s) (restart cost {self._restart_s or 0:.1f}s, "
            f"rule: elastic.scale_up_interval_s and time saved > 2 x restart cost)",
        )
        return State.SCHEDULING

    def _restart(self, why: str, detail: str) -> None:
        assert self.group is not None
        before = self.group.replicas
        self.resizes.append(
            {"step": self.step_count, "from_replicas": before, "why": why, "detail": detail}
        )
        self._event(f"restarting at step {self.step_count} from {before} replica(s): {detail}")
        self._teardown()
        self._interrupted_at = (self.clock(), why)

    def _teardown(self) -> None:
        if self.backfill is not None:
            self.backfill.detach()
        if self.group is not None:
            self.group.shutdown()
            self.group = None
        # Uploads of a dead group never complete; their steps stay uncommitted.
        self._uploads.clear()
        self._save_world.clear()

    # --- bubbles and backfill -------------------------------------------------------

    def trace(self) -> dict[str, Any] | None:
        """Chrome-trace JSON of the latest recorded steps of every stage (None for pp=1)."""
        if self.bubbles is None:
            return None
        slices = self.backfill.slices() if self.backfill is not None else {}
        return self.bubbles.trace(self.spec.name, slices)

    def _write_artifacts(self, with_trace: bool = True) -> None:
        """Keep the trace, summary and ledger beside the checkpoints current, for
        `spotline trace/status/report` on a finished job and for a restarted controller.
        Never into a URI this job does not own (another job's artifacts stay intact)."""
        if not self._owns_store:
            return
        self.telemetry.store(self.store, self.summary())
        if not with_trace or self.bubbles is None or not self.bubbles.latest:
            return
        trace = self.trace()
        try:
            self.store.write_artifact(TRACE_ARTIFACT, json.dumps(trace).encode())
        except StorageError as e:
            self._event(f"could not write the pipeline trace: {e}", logging.WARNING)

    def _backfill_result(self, result: dict[str, Any]) -> None:
        if result.get("kind") == "eval":
            self.telemetry.eval_result(result)

    def _export_counts(self) -> None:
        restarts: dict[str, int] = {}
        for a in self.attempts[:-1]:
            why = (a.ended_by or "unknown").replace(" ", "_")
            restarts[why] = restarts.get(why, 0) + 1
        tasks: dict[str, int] = {}
        for t in self.backfill.results() if self.backfill else []:
            if t["state"] in ("done", "failed"):
                tasks[t["state"]] = tasks.get(t["state"], 0) + 1
        self.telemetry.counts(len(self.notices), self.node_losses, restarts, tasks)

    def summary(self) -> dict[str, Any]:
        """Everything `spotline status` and `spotline report` show, in one dict."""
        group = self.group
        last = self.committed[-1] if self.committed else None
        tel = self.telemetry
        return {
            **self._headline(group),
            "waiting": self._waiting_reason,
            "train_loss": tel.last.get("train_loss"),
            "heldout_loss": self.heldout_loss,
            "eval": tel.evals[-1] if tel.evals else None,
            "evals": list(tel.evals),
            "tokens_per_s": tel.last.get("tokens_per_s"),
            "mfu": tel.last.get("mfu"),
            "data_stall_fraction": tel.last.get("data_stall_fraction"),
            "hfu": tel.last.get("hfu"),
            "peak_flops_per_device": tel.peak_flops,
            "bubbles": self.bubbles.summary() if self.bubbles else None,
            "last_checkpoint": (
                {"step": last, "uri": self.store.step_uri(last)} if last is not None else None
            ),
            "preemption_notices": len(self.notices),
            "node_losses": self.node_losses,
            "restarts": max(0, len(self.attempts) - 1),
            "failures": self.failures,
            "ledger": tel.ledger_summary(),
            "cost": tel.cost(),
            "alerts": [a.message() for a in tel.deviation.alerts],
            "history": list(tel.history),
            "losses": {str(k): v for k, v in sorted(self.losses.items())},
            "notices": [
                {k: n.get(k) for k in ("source", "node_id", "committed_step", "notice_to_commit_s")}
                for n in self.notices
            ],
            "resizes": list(self.resizes),
            "error": self.error,
            "updated_at": time.time(),
        }

    def submit_backfill(self, task: Any, name: str | None = None) -> int:
        if self.backfill is None:
            raise RuntimeError(
                "backfill is off for this job; set backfill.enabled: true (it needs "
                "parallel.pipeline_stages >= 2) to run backfill tasks"
            )
        return self.backfill.submit(task, name)

    def backfill_record(self, task_id: int) -> dict[str, Any] | None:
        return self.backfill.record(task_id) if self.backfill is not None else None

    # --- commits ------------------------------------------------------------------

    def _collect_uploads(self, uploads: list[Any]) -> None:
        for u in uploads:
            if u.step not in self._save_world:
                continue
            if u.error:
                self._event(
                    f"checkpoint step {u.step} abandoned: rank {u.rank} upload failed: {u.error}",
                    logging.WARNING,
                )
                self._save_world.pop(u.step, None)
                self._uploads.pop(u.step, None)
                continue
            self._uploads.setdefault(u.step, []).append(u)
            if len(self._uploads[u.step]) == self._save_world[u.step]:
                uploads = self._uploads.pop(u.step)
                self._commit(
                    u.step,
                    [f for x in uploads for f in x.files],
                    self._save_world.pop(u.step),
                    max(x.seconds for x in uploads),
                )

    def _commit_from_receipts(self) -> None:
        """Commit steps whose uploads all finished but whose reports died with their group.

        Every rank writes a receipt after its upload; a step newer than the latest
        commit with a receipt from every rank of the group that saved it is complete.
        """
        latest = max(self.store.committed_steps(), default=-1)
        for step in self.store.uncommitted_steps():
            if step <= latest:
                continue
            receipts = self.store.read_receipts(step)
            if not receipts:
                continue
            world = receipts[0]["world_size"]
            if sorted(r["rank"] for r in receipts) != list(range(world)):
                continue
            files = [FileEntry(**f) for r in receipts for f in r["files"]]
            self._event(f"step {step}: every rank's upload had finished; committing it now")
            self._commit(step, files, world, upload_s=None)

    def _commit(
        self, step: int, files: list[FileEntry], world: int, upload_s: float | None
    ) -> None:
        files = sorted(files, key=lambda f: f.path)
        replicas = world // self.spec.parallel.pipeline_stages
        manifest = Manifest(
            step=step,
            files=files,
            topology=self.spec.topology(replicas),
            data_position={"next_step": step, "seed": self.spec.data.seed},
            spec_hash=self.spec.spec_hash(),
            created_at=time.time(),
            extra={
                "job": self.spec.name,
                "batch": self.spec.batch_record(replicas),
                "spec": self.spec.hashed_fields(),  # so a refused resume can say what differs
                "vocab_size": self.spec.vocab_size(),
            },
        )
        try:
            self.store.commit(manifest)
        except (StorageError, CorruptCheckpointError) as e:
            # Training goes on; the next checkpoint commits in its place.
            self._event(f"checkpoint step {step} not committed: {e}", logging.WARNING)
            return
        self.committed.append(step)
        if upload_s is not None:
            self.upload_s.append(upload_s)
        self.upload_bytes.append(manifest.total_bytes)
        deleted = self.store.apply_retention(self.spec.checkpoint.keep_last)
        self.committed = [s for s in self.committed if s not in deleted]
        self._event(
            f"committed checkpoint step {step} ({manifest.total_bytes / 1e6:.1f} MB, "
            f"{len(files)} files) -> {self.store.step_uri(step)}"
        )
        self.telemetry.commit(
            step, manifest.total_bytes, self.blocked_s[-1] if self.blocked_s else None, upload_s
        )
        if self.backfill is not None:
            self.backfill.on_commit(manifest, final=step >= self.spec.train.steps)
            self.backfill.poll()  # start what is due now, not after the next chunk
        self._write_artifacts()
