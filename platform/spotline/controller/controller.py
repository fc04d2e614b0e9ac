"""The job controller: an explicit state machine over a worker group.

`Controller.step()` runs one iteration: it looks at the current state, does one
thing, and moves to the next state. Policies decide (restart or fail, how many
replicas); the controller carries the decision out. The worker group is
injected, so tests drive the machine with a fake group one step at a time.

The controller is the only writer of manifests: a checkpoint is committed when
every rank of the group that saved it has reported its upload.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spotline import constants
from spotline.checkpoint import (
    CheckpointStore,
    CorruptCheckpointError,
    FileEntry,
    Manifest,
    StorageError,
)
from spotline.controller.policies import Fail, FailurePolicy, Resize, ScalingPolicy, Wait
from spotline.controller.state import State
from spotline.spec.models import JobSpec
from spotline.workers.group import WorkerFailure, WorkerGroup

log = logging.getLogger("spotline.controller")


class CheckpointMismatchError(RuntimeError):
    """The checkpoint URI holds checkpoints this job cannot resume."""


@dataclass
class Attempt:
    """One life of a worker group: where it started and the losses it produced."""

    replicas: int
    start_step: int = 0
    restored_from: int | None = None
    losses: list[tuple[int, float]] = field(default_factory=list)
    error: str | None = None


class Controller:
    def __init__(
        self,
        spec: JobSpec,
        store: CheckpointStore,
        group_factory: Callable[[int], WorkerGroup],
        capacity_fn: Callable[[], int],
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.spec = spec
        self.store = store
        self.group_factory = group_factory
        self.capacity_fn = capacity_fn
        self.sleep = sleep
        self.failure_policy = FailurePolicy(spec.failure.max_failures)
        self.scaling_policy = ScalingPolicy(spec.elastic.min_replicas, spec.elastic.max_replicas)

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
        self._waiting_since: float | None = None
        self._uploads: dict[int, list[Any]] = {}
        self._save_world: dict[int, int] = {}
        self._events: list[str] = []
        self._lock = threading.Lock()

    # --- reporting ----------------------------------------------------------------

    def _event(self, text: str, level: int = logging.INFO) -> None:
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
            "name": self.spec.name,
            "state": self.state.value,
            "step": self.step_count,
            "total_steps": self.spec.train.steps,
            "replicas": group.replicas if group else 0,
            "failures": self.failures,
            "committed_steps": list(self.committed),
            "workers": group.worker_info() if group else [],
            "events": events,
            "next_event": n_events,
            "error": self.error,
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
            State.RUNNING: self._running,
            State.CHECKPOINTING: self._checkpointing,
            State.RECOVERING: self._recovering,
            State.FINISHING: self._finishing,
        }[self.state]
        try:
            self.state = handler()
        except WorkerFailure as e:
            self.state = self._on_failure(str(e))
        except (CheckpointMismatchError, CorruptCheckpointError) as e:
            self.state = self._fail(str(e))
        except StorageError as e:
            # Storage unreachable while scheduling or restoring: a restart retries it.
            self.state = self._on_failure(f"checkpoint storage: {e}")
        if self.state.terminal:
            self.finished_at = time.time()
        return self.state

    def _fail(self, reason: str) -> State:
        self.error = reason
        self._event(f"FAILED: {reason}", logging.ERROR)
        self._teardown()
        return State.FAILED

    def _pending(self) -> State:
        self._event(f"job {self.spec.name}: checkpoints at {self.store.uri}")
        return State.SCHEDULING

    def _scheduling(self) -> State:
        decision = self.scaling_policy.decide(self.capacity_fn())
        if isinstance(decision, Wait):
            now = time.monotonic()
            if self._waiting_since is None:
                self._waiting_since = now
                self._event(decision.reason, logging.WARNING)
            if now - self._waiting_since > constants.SPOTLINE_WORKER_START_TIMEOUT_S:
                return self._fail(
                    f"{decision.reason} Gave up after {constants.SPOTLINE_WORKER_START_TIMEOUT_S:.0f}s "
                    "(SPOTLINE_WORKER_START_TIMEOUT_S)."
                )
            self.sleep(1.0)
            return State.SCHEDULING
        assert isinstance(decision, Resize)
        self._waiting_since = None
        attempt = Attempt(replicas=decision.replicas)
        self.attempts.append(attempt)
        pp = self.spec.parallel.pipeline_stages
        self._event(
            f"starting {decision.replicas} replica(s) x {pp} stage(s) = {decision.replicas * pp} workers"
        )
        self.group = self.group_factory(decision.replicas)
        self.group.start()
        self.step_count = self._restore_latest(attempt)
        attempt.start_step = self.step_count
        if self.step_count >= self.spec.train.steps:
            return State.FINISHING
        return State.RUNNING

    def _restore_latest(self, attempt: Attempt) -> int:
        assert self.group is not None
        self._commit_from_receipts()
        steps = sorted(self.store.committed_steps(), reverse=True)
        self.committed = sorted(steps)
        for i, step in enumerate(steps):
            manifest = self.store.load_manifest(step)
            reshard = self._check_compatible(manifest)
            try:
                restored = self.group.restore(manifest, reshard)
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
        if m.spec_hash != self.spec.spec_hash():
            raise CheckpointMismatchError(
                f"checkpoint step {m.step} at {self.store.uri} was written by a job with a different "
                f"model/data/train spec (hash {m.spec_hash}, this job {self.spec.spec_hash()}). "
                "Point checkpoint.uri at a new location, or restore the original spec."
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
        n = min(self._next_boundary() - self.step_count, constants.SPOTLINE_MAX_STEPS_PER_CHUNK)
        t0 = time.perf_counter()
        chunk = self.group.train(n)
        self.train_seconds += time.perf_counter() - t0
        self.steps_trained += n
        self.attempts[-1].losses.extend(chunk.losses)
        for step, loss in chunk.losses:
            self.losses[step] = loss
        self.step_count = chunk.losses[-1][0]
        self._report_progress(chunk)
        self._collect_uploads(chunk.uploads)
        if (
            self.step_count % self.spec.checkpoint.interval_steps == 0
            or self.step_count >= self.spec.train.steps
        ):
            return State.CHECKPOINTING
        return State.RUNNING

    def _report_progress(self, chunk) -> None:
        every = self.spec.train.log_every
        steps = [s for s, _ in chunk.losses]
        if any(s % every == 0 for s in steps) or self.step_count >= self.spec.train.steps:
            t = self.spec.train
            sps = len(steps) / chunk.seconds if chunk.seconds else 0.0
            tok = sps * t.global_batch_size * self.spec.model.seq_len
            self._event(
                f"step {self.step_count}/{t.steps}  loss {chunk.losses[-1][1]:.4f}  "
                f"{sps:.2f} steps/s  {tok:,.0f} tokens/s"
            )

    def _checkpointing(self) -> State:
        assert self.group is not None
        if self.step_count not in self.committed:
            blocked = self.group.save()
            self.blocked_s.append(blocked)
            self._save_world[self.step_count] = self.group.world_size
        return State.FINISHING if self.step_count >= self.spec.train.steps else State.RUNNING

    def _finishing(self) -> State:
        assert self.group is not None
        self.heldout_loss = self.group.heldout_loss()
        self._collect_uploads(self.group.flush_uploads())
        self._teardown()
        if self.spec.train.steps not in self.committed:
            return self._fail(f"the final checkpoint (step {self.spec.train.steps}) did not commit")
        self._event(
            f"finished {self.step_count} steps; held-out loss {self.heldout_loss:.4f}; "
            f"checkpoints: {self.store.step_uri(self.committed[-1])}"
        )
        return State.FINISHED

    def _on_failure(self, error: str) -> State:
        self.failures += 1
        if self.attempts:
            self.attempts[-1].error = error
        self._event(f"worker failure at step {self.step_count}: {error}", logging.WARNING)
        self._teardown()
        decision = self.failure_policy.decide(self.failures, error)
        if isinstance(decision, Fail):
            return self._fail(decision.reason)
        self._event(decision.reason.splitlines()[0])
        return State.RECOVERING

    def _recovering(self) -> State:
        return State.SCHEDULING

    def _teardown(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None
        # Uploads of a dead group never complete; their steps stay uncommitted.
        self._uploads.clear()
        self._save_world.clear()

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
            extra={"job": self.spec.name, "global_batch_size": self.spec.train.global_batch_size},
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
