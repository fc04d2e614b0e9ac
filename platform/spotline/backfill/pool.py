"""The controller's side of backfill: a queue of tasks, the executors, retries, results.

The pool lives in the controller and is driven by it between chunks of training
steps: `on_commit` queues the spec's tasks that are due on a newly committed
checkpoint, `poll` hands queued tasks to idle executors and collects finished
ones, `on_chunk` feeds the governor and passes its decision (pause, margin) to
every executor. When a worker group is torn down its executors go with it;
their running tasks go back to the queue without using up a retry.

Every call into Ray here is non-blocking or bounded, so backfill can never hold
up the training loop.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from spotline.backfill.governor import BackfillDecision, SlowdownGovernor
from spotline.backfill.tasks import PythonTask
from spotline.checkpoint import Manifest
from spotline.config.schema import JobSpec
from spotline.storage.retry import try_again

log = logging.getLogger("spotline.backfill")


@dataclass
class TaskRecord:
    id: int
    task: Any
    name: str
    manifest: Manifest | None = None  # the weights; None: the latest commit when it starts
    spec_index: int | None = None  # position in backfill.tasks; None: from the SDK
    state: str = "queued"  # queued, running, done, failed
    attempts: int = 0
    result: dict[str, Any] | None = None
    error: str | None = None
    errors: list[str] = field(default_factory=list)  # one per failed attempt
    last_executor: int | None = None

    @property
    def step(self) -> int | None:
        return self.manifest.step if self.manifest else None

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "step": self.step,
            "state": self.state,
            "attempts": self.attempts,
            "result": self.result,
            "error": self.error,
            "errors": list(self.errors),
        }


class BackfillPool:
    def __init__(self, spec: JobSpec, event=None, on_result=None):
        self.spec = spec
        self._on_result = on_result or (lambda result: None)
        bf = spec.backfill
        self.governor = SlowdownGovernor(
            bf.max_slowdown, bf.baseline_steps, bf.rebaseline_every_steps
        )
        self._event = event or (lambda text, level=logging.INFO: log.log(level, text))
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.records: dict[int, TaskRecord] = {}
        self._queue: deque[int] = deque()
        self._running: dict[Any, tuple[int, int]] = {}  # ObjectRef -> (task id, executor)
        self._executors: list[Any] = []
        self._busy: set[int] = set()
        # Executors whose process died: Ray restarts them; no task goes to one until it
        # answers a ping again (else every retry would land on the dead process).
        self._probes: dict[Any, int] = {}
        self._last_step: dict[int, int] = {}  # spec task index -> step it last ran on
        self._latest: Manifest | None = None
        self._applied: BackfillDecision | None = None
        self._free_run = False

    # --- wiring -------------------------------------------------------------------

    def bind(self, event, on_result) -> None:
        """Report to the job's controller: its events, and each result as it comes."""
        self._event = event
        self._on_result = on_result

    def attach(self, executors: list[Any]) -> None:
        """A new worker group started with these executors (one per worker)."""
        with self._lock:
            self._executors = list(executors)
            self._busy.clear()
            self._probes.clear()
            self._applied = None
        self._apply(self.governor.decision())

    def detach(self) -> None:
        """The worker group (and its executors) is going away: requeue what ran."""
        with self._lock:
            for tid, _ in self._running.values():
                rec = self.records[tid]
                rec.state = "queued"
                self._queue.appendleft(tid)
            self._running.clear()
            self._executors = []
            self._busy.clear()
            self._probes.clear()

    # --- queueing -----------------------------------------------------------------

    def on_commit(self, manifest: Manifest, final: bool = False) -> None:
        """Queue the spec's tasks that are due on this newly committed step.

        A spec task still queued for an older step moves to this one instead of
        queueing twice: backfill works on the newest weights and never falls behind
        (the older step may be gone to retention by the time an executor is free).
        One still running is not queued again beside itself (a second copy would only
        hold another executor with the same work): it is due again at the first commit
        after it ends, and always on the final one.
        """
        with self._lock:
            self._latest = manifest
            queued = {self.records[t].spec_index: self.records[t] for t in self._queue}
            running = {self.records[t].spec_index for t, _ in self._running.values()}
        for i, task in enumerate(self.spec.backfill.tasks):
            last = self._last_step.get(i)
            if last == manifest.step or (i in running and not final):
                continue
            if final or last is None or manifest.step - last >= task.every_steps:
                self._last_step[i] = manifest.step
                if i in queued:
                    queued[i].manifest = manifest
                else:
                    self._add(task, f"{task.kind}[{i}]", manifest, spec_index=i)

    def submit(self, task: Any, name: str | None = None) -> int:
        """Queue a task from the SDK (a task spec or a PythonTask); its id."""
        if name is None:
            name = getattr(task, "name", None) or getattr(task, "kind", "task")
        return self._add(task, name, None)

    def _add(
        self, task: Any, name: str, manifest: Manifest | None, spec_index: int | None = None
    ) -> int:
        with self._lock:
            tid = next(self._ids)
            self.records[tid] = TaskRecord(tid, task, name, manifest, spec_index=spec_index)
            self._queue.append(tid)
        return tid

    # --- driving ------------------------------------------------------------------

    def poll(self) -> None:
        """Collect finished tasks and start queued ones on idle executors. Never blocks."""
        import ray

        with self._lock:
            refs = list(self._running)
            probes = list(self._probes)
        if refs:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            for ref in ready:
                self._finish(ref)
        if probes:
            ready, _ = ray.wait(probes, num_returns=len(probes), timeout=0)
            for ref in ready:
                ex = self._probes.pop(ref)
                try:
                    ray.get(ref)
                    with self._lock:
                        self._busy.discard(ex)  # it is back
                except Exception:  # noqa: BLE001 - still restarting: ask again
                    with self._lock:
                        if ex < len(self._executors):
                            self._probes[self._executors[ex].stats.remote()] = ex
        self._dispatch()

    def _finish(self, ref: Any) -> None:
        import ray

        with self._lock:
            tid, ex = self._running.pop(ref)
            self._busy.discard(ex)
            rec = self.records[tid]
        try:
            rec.result = ray.get(ref)
            rec.state = "done"
            self._event(f"backfill {rec.name} on step {rec.step}: {_summary(rec.result)}")
            self._on_result(rec.result)
        except Exception as e:  # noqa: BLE001 - any task failure is reported, never raised
            rec.error = _describe(e)
            rec.errors.append(rec.error)
            if rec.error == EXECUTOR_DIED:
                with self._lock:
                    self._busy.add(ex)  # out of rotation until a ping answers
                    self._probes[self._executors[ex].stats.remote()] = ex
            tries = getattr(rec.task, "retries", 0) + 1
            # On another executor, any failure may pass but one in the user's code.
            if try_again(e, rec.attempts, tries, transient=lambda _: True):
                rec.state = "queued"
                with self._lock:
                    self._queue.append(tid)
                self._event(
                    f"backfill {rec.name} failed (attempt {rec.attempts} of {tries}), "
                    f"retrying: {rec.error}",
                    logging.WARNING,
                )
            else:
                rec.state = "failed"
                self._event(
                    f"backfill {rec.name} failed after {rec.attempts} attempt(s); training "
                    f"is not affected: {rec.error}",
                    logging.WARNING,
                )

    def _dispatch(self) -> None:
        with self._lock:
            while self._queue and self._latest is not None:
                idle = [i for i in range(len(self._executors)) if i not in self._busy]
                if not idle:
                    return
                tid = self._queue.popleft()
                rec = self.records[tid]
                if rec.manifest is None:
                    rec.manifest = self._latest
                # A retry goes to another executor when there is one.
                ex = next((i for i in idle if i != rec.last_executor), idle[0])
                rec.last_executor = ex
                rec.attempts += 1
                rec.state = "running"
                ref = self._executors[ex].run.remote(rec.task, rec.manifest.to_json())
                self._running[ref] = (tid, ex)
                self._busy.add(ex)

    def on_chunk(self, steps: int, seconds: float, warm: bool = True) -> BackfillDecision:
        """Feed one chunk of training to the governor; pass a changed decision on."""
        decision = self.governor.observe(steps, seconds, warm)
        if decision != self._applied:
            self._apply(decision)
        return decision

    def _apply(self, decision: BackfillDecision) -> None:
        with self._lock:
            executors = list(self._executors)
            self._applied = decision
        for ex in executors:
            ex.configure.remote(decision.paused, decision.margin, self._free_run)

    def pinned_steps(self) -> set[int]:
        """The committed steps that queued and running tasks will read: retention keeps
        them until the tasks are done."""
        with self._lock:
            return {
                r.manifest.step
                for r in self.records.values()
                if r.state in ("queued", "running") and r.manifest is not None
            }

    def pending(self) -> int:
        with self._lock:
            return len(self._queue) + len(self._running)

    def finish(self, timeout_s: float, sleep=time.sleep) -> None:
        """Training is over: let queued and running tasks use the devices freely."""
        self._free_run = True
        self._apply(BackfillDecision(paused=False, margin=1.0, phase="finishing"))
        deadline = time.monotonic() + timeout_s
        while self.pending() and self._executors and time.monotonic() < deadline:
            self.poll()
            sleep(0.2)
        self.poll()
        with self._lock:
            left = [self.records[t] for t in self._queue] + [
                self.records[t] for t, _ in self._running.values()
            ]
        for rec in left:
            rec.state = "failed"
            rec.error = rec.error or (
                f"not finished within backfill.finish_timeout_s ({timeout_s:.0f}s) after training"
            )
        with self._lock:  # given up: the teardown's detach must not queue them again
            self._queue.clear()
            self._running.clear()

    # --- reading ------------------------------------------------------------------

    def slices(self, timeout_s: float = 2.0) -> dict[int, list[tuple[int, int, str]]]:
        """Recent units each executor ran, by rank (for the trace); bounded wait."""
        import ray

        with self._lock:
            executors = list(self._executors)
        refs = {rank: ex.recent_slices.remote() for rank, ex in enumerate(executors)}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        out = {}
        for rank, ref in refs.items():
            if ref in ready:
                with contextlib.suppress(Exception):
                    out[rank] = ray.get(ref)
        return out

    def record(self, tid: int) -> dict[str, Any] | None:
        rec = self.records.get(tid)
        return rec.public() if rec else None

    def results(self) -> list[dict[str, Any]]:
        return [r.public() for r in self.records.values()]

    def summary(self) -> dict[str, Any]:
        g = self.governor
        return {
            "baseline_step_s": g.baseline_s,
            "slowdown": g.slowdown,
            "margin": g.margin,
            "phase": g.phase,
            "governor": list(g.history),
            "done": sum(r.state == "done" for r in self.records.values()),
            "failed": sum(r.state == "failed" for r in self.records.values()),
        }


EXECUTOR_DIED = "the backfill executor process died (crash or out of memory)"


def _describe(e: BaseException) -> str:
    name = type(e).__name__
    if "ActorDied" in name or "RayActorError" in name or "ActorUnavailable" in name:
        return EXECUTOR_DIED
    cause = getattr(e, "cause", None)
    text = str(cause if cause is not None else e).strip().splitlines()
    return text[0] if text else name


def _summary(result: dict[str, Any] | None) -> str:
    if not result:
        return "done"
    if result.get("deferred"):
        return _kind_summary(result) + f"; {result['deferred']['why']}"
    return _kind_summary(result)


def _kind_summary(result: dict[str, Any]) -> str:
    if result.get("kind") == "eval":
        return f"held-out loss {result['loss']:.4f} (perplexity {result['perplexity']:.2f})"
    if result.get("kind") == "speculative":
        return (
            f"{result['new_tokens']} tokens, {result['accepted_per_verification']:.2f} "
            f"accepted/verification, {result['tokens_per_s']:.1f} tokens/s"
        )
    return "done"


__all__ = ["BackfillPool", "PythonTask", "TaskRecord"]
