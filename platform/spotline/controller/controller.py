"""The job controller: an explicit state machine over a worker group that trains on its own.

`Controller.step()` runs one iteration: it takes what the inbox holds (preemption
notices, a stop request), in whatever state it is, then runs the current state's
handler, which returns the next state. States carry their payload (`state.py`);
policies decide (restart or fail, how many replicas, when to grow, at which step to
take a just-in-time checkpoint) and the controller carries the decision out. The
worker group is injected, so tests drive the machine with a fake group.

The ranks never wait for the controller: they train from their restored step to the
last one, saving at every checkpoint.interval_steps by themselves. The controller
polls what they publish (losses, saves, finished uploads) and steers with messages:
save at step k, stop at step k. Every commit, retention, artifact and status query
happens here, off the training path, through the commit coordinator (the only
owner of storage).

Spot capacity: a notice drains the doomed node at once (nothing new lands there).
When the node runs ranks of the live group, the JIT policy picks the step to save at
(at once, or the latest one whose save still fits the deadline, moved up should
steps slow down); the group saves and stops there, the step commits, and the job restarts on the capacity that is really
left once the freed devices show. A node lost without notice resumes from the latest
commit. Below elastic.min_replicas the controller waits up to
elastic.wait_for_capacity_s. When capacity comes back it grows toward max_replicas
when `GrowPolicy`'s cost rule says it pays.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from spotline import constants
from spotline.bubbles.book import BubbleBook, stage_compute_s
from spotline.checkpoint import (
    TRACE_ARTIFACT,
    CheckpointMismatchError,
    CheckpointStore,
    CorruptCheckpointError,
    StorageError,
)
from spotline.checkpoint.coordinator import CommitCoordinator, Committed
from spotline.config.loader import SpecError
from spotline.config.redact import redact
from spotline.config.schema import JobSpec
from spotline.controller.inbox import Inbox
from spotline.controller.policies import (
    Fail,
    FailurePolicy,
    GrowPolicy,
    JitPolicy,
    RebalancePolicy,
    Resize,
    ScalingPolicy,
    Wait,
    classify,
)
from spotline.controller.state import (
    Failed,
    Finished,
    Finishing,
    Leaving,
    Pending,
    Running,
    Scheduling,
    State,
    Stopped,
    Waiting,
    reported_snapshot,
)
from spotline.controller.telemetry import Telemetry
from spotline.planning.memory import memory_per_device
from spotline.planning.partition import imbalance
from spotline.planning.step import predict_step
from spotline.registry import user_code_error
from spotline.runtime.cluster import ClusterView
from spotline.runtime.demand import Demand
from spotline.runtime.group import Progress, WorkerFailure, WorkerGroup

log = logging.getLogger("spotline.controller")

# How often a running job reads the cluster's capacity to see whether growing pays.
_GROW_CHECK_S = 2.0
_RATE_WEIGHT = 0.2  # of a new chunk in a size's moving-average rate
# Steps over which the wall-clock step time is measured (the JIT plan's, and its check).
_RECENT_STEPS = 32


@dataclass
class Attempt:
    """One life of a worker group: where it started and the losses it produced."""

    replicas: int
    attempt: str = ""
    start_step: int = 0
    restored_from: int | None = None
    losses: list[tuple[int, float]] = field(default_factory=list)
    error: str | None = None
    ended_by: str | None = None  # "failure", "node lost", "preemption notice", "grow",
    # "re-partition", "stop"
    device: str = ""  # "gpu" or "cpu": decided when the group started
    partition: dict[str, Any] = field(default_factory=dict)
    """The stage partition it ran: bounds, how they were chosen, and the stage compute
    time it measured (seconds per step per stage, and their imbalance)."""


@dataclass
class Record:
    """What the job did, as status, result and summary show it (one typed source)."""

    attempts: list[Attempt] = field(default_factory=list)
    losses: dict[int, float] = field(default_factory=dict)
    failures: int = 0
    node_losses: int = 0
    notices: list[dict[str, Any]] = field(default_factory=list)
    resizes: list[dict[str, Any]] = field(default_factory=list)
    repartitions: list[dict[str, Any]] = field(default_factory=list)
    """Each re-partition: at which step, from and to which bounds, the imbalance measured
    before it and predicted after (the next attempt's partition has the measured one)."""
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    waited_s: float = 0.0
    blocked_s: list[float] = field(default_factory=list)
    upload_s: list[float] = field(default_factory=list)
    upload_bytes: list[int] = field(default_factory=list)
    heldout_loss: float | None = None
    error: str | None = None
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    steps_trained: int = 0
    tokens_trained: int = 0
    batch: dict[str, Any] | None = None
    """The batch in force as the ranks last reported it (see Progress.batch)."""
    first_step_start: float | None = None  # wall clock, this controller's first step
    last_step_end: float | None = None
    peak_memory: dict[int, int] = field(default_factory=dict)
    """Measured peak tensor bytes per pipeline stage (the largest rank's)."""
    peak_memory_replicas: int | None = None
    """The replica count that measurement was taken at."""
    step_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=_RECENT_STEPS))
    """The live group's latest steps' own seconds (the ranks' step timers)."""


class Controller:
    def __init__(
        self,
        spec: JobSpec,
        store: CheckpointStore,
        group_factory: Callable[[int], WorkerGroup],
        cluster: ClusterView,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        backfill: Any = None,
        demand: Demand | None = None,
    ):
        self.spec = spec
        self.demand = demand  # what the job asks the autoscaler for, while it lives
        self.group_factory = group_factory
        self.cluster = cluster
        self.sleep = sleep
        self.clock = clock
        e = spec.elastic
        self.failure_policy = FailurePolicy(spec.failure.max_failures)
        self.scaling_policy = ScalingPolicy(e.min_replicas, e.max_replicas, spec.replica_counts())
        self.grow_policy = GrowPolicy(self.scaling_policy)
        self.jit_policy = JitPolicy(constants.SPOTLINE_JIT_MARGIN_S)
        p = spec.parallel
        self.rebalance_policy = (
            RebalancePolicy(p.rebalance_threshold, p.rebalance_window_steps)
            if p.partition == "balanced" and p.pipeline_stages > 1
            else None
        )
        # The stage bounds the next group starts with (a restart keeps the live group's,
        # a re-partition sets new ones); None: the group chooses by parallel.partition.
        self._partition_pin: list[int] | None = None
        self._partition_read = False  # the newest checkpoint's recorded bounds were read
        # (step, imbalance, per-stage compute s/step) of the live group's latest polls.
        self._stage_window: deque[tuple[int, float, list[float]]] = deque(maxlen=256)
        self._last_rebalance_check = 0.0
        self._lock = threading.Lock()  # everything status() reads from another thread
        self._events: list[str] = []
        self.inbox = Inbox()
        self.coordinator = CommitCoordinator(spec, store, self._event)
        self.telemetry = Telemetry(spec, self._event, checkpoint_uri=self.store.uri)
        pp = spec.parallel.pipeline_stages
        self.bubbles = BubbleBook(pp) if pp > 1 else None
        self.backfill = backfill
        if backfill is not None:
            backfill.bind(self._event, self._backfill_result)
            self.coordinator.pinned = backfill.pinned_steps
        self.state: State = Pending()
        self.group: WorkerGroup | None = None
        self.step_count = 0  # the latest step the live group reported
        self.rec = Record()
        self.doomed: dict[str, float] = {}  # node id -> deadline (under self._lock)
        self._owns_store = False  # the URI holds no other job's checkpoints (see _pending)
        self._restart_from: tuple[float, str] | None = None  # (clock, why) until training again
        self._restart_s: float | None = None  # measured: teardown to the first step after it
        # Measured: a group's start to its first step. It stands in for the restart cost
        # until a restart has been measured (a restart costs that plus the teardown).
        self._start_s: float | None = None
        self._starting_since: float | None = None  # clock, while a new group has no step
        self._group_started = 0.0  # clock: when the live group's first step came
        self._sps_by_replicas: dict[int, float] = {}
        self._warm_rates: set[int] = set()  # sizes whose rate comes from warm chunks
        # (step, wall clock at its end) of the live group's latest steps.
        self._recent_steps: deque[tuple[int, float]] = deque(maxlen=_RECENT_STEPS)
        self._last_grow_check = 0.0
        self._last_world = 0
        self._accounted = 0.0  # seconds of this iteration charged from the ranks' measurements
        self._pending_jit: list[dict[str, Any]] = []  # notices the next leave answers
        self._jit_fit_checked = False  # the check from the first measured save is done
        self._predictions: dict[tuple, dict[str, Any]] = {}  # the plan's, by shape
        self._plan_ready = threading.Event()
        threading.Thread(target=self._warm_plan, name="spotline-plan", daemon=True).start()

    @property
    def store(self) -> CheckpointStore:
        return self.coordinator.store

    # --- reporting ----------------------------------------------------------------

    def _event(self, text: str, level: int = logging.INFO, track: str | None = None) -> None:
        """Log an event and keep it for status; `track`: also an event of this kind in
        the job's trackers."""
        text = redact(text)
        log.log(level, text)
        with self._lock:
            self._events.append(text)
        if track is not None:
            self.telemetry.event(self.step_count, track, text)

    def snapshot(self, wait_for_plan: bool = False) -> dict[str, Any]:
        """Everything the job knows about itself, once: status, result and summary are
        projections of it. Safe to call from any thread."""
        state = self.state
        if isinstance(state, Finished) and state.reported is not None:
            keys = (*self._STATUS_KEYS, *self._RESULT_KEYS)  # a summary of an older version
            return {**dict.fromkeys(keys), **reported_snapshot(state.reported)}
        group = self.group
        with self._lock:
            doomed = sorted(self.doomed)
        r = self.rec
        tel = self.telemetry
        last = self.coordinator.committed[-1] if self.coordinator.committed else None
        span = (
            (r.last_step_end - r.first_step_start)
            if r.first_step_start is not None and r.last_step_end is not None
            else 0.0
        )
        tokens = r.tokens_trained
        waiting = self.state.reason if isinstance(self.state, Waiting) else None
        return {
            "name": self.spec.name,
            "state": self.state.name,
            "step": self.step_count,
            "total_steps": self.spec.train.steps,
            "replicas": group.replicas if group else 0,
            "device": self._device(group),
            "max_replicas": self.spec.elastic.max_replicas,
            "waiting": waiting,
            "doomed_nodes": doomed,
            "workers": group.worker_info() if group else [],
            "failures": r.failures,
            "node_losses": r.node_losses,
            "committed_steps": list(self.coordinator.committed),
            "quarantined_steps": list(self.coordinator.quarantined),
            "last_checkpoint": (
                {"step": last, "uri": self.store.step_uri(last)} if last is not None else None
            ),
            # Wall clock from the first step to the last: commits, restarts and gaps count.
            "steps_per_s": r.steps_trained / span if span > 0 else 0.0,
            "tokens_per_s": tokens / span if span > 0 else 0.0,
            "heldout_loss": r.heldout_loss,
            "error": r.error,
            "restarts": max(0, len(r.attempts) - 1),
            # A resumed controller that has not trained yet: the last loss it stored.
            "train_loss": tel.last.get(
                "train_loss", tel.history[-1].get("train_loss") if tel.history else None
            ),
            "mfu": tel.last.get("mfu"),
            "hfu": tel.last.get("hfu"),
            "data_stall_fraction": tel.last.get("data_stall_fraction"),
            "peak_flops_per_device": tel.peak_flops,
            "eval": tel.evals[-1] if tel.evals else None,
            "evals": list(tel.evals),
            "bubbles": self.bubbles.summary() if self.bubbles else None,
            "plan": self._plan_vs_run(group.replicas if group else None, wait_for_plan),
            "ledger": tel.ledger_summary(),
            "cost": tel.cost(),
            "alerts": [a.message() for a in tel.deviation.alerts],
            "batch": self._batch_view(),
            "history": list(tel.history),
            "losses": dict(sorted(r.losses.items())),
            "attempts": [asdict(a) for a in r.attempts],
            "notices": [dict(n) for n in r.notices],
            "resizes": list(r.resizes),
            "partition": self._partition_summary(),
            "recoveries": list(r.recoveries),
            "tracking": tel.trackers.summary(),
            "waited_s": r.waited_s,
            "checkpoint_blocked_s": list(r.blocked_s),
            "checkpoint_upload_s": list(r.upload_s),
            "checkpoint_bytes": list(r.upload_bytes),
            "backfill": (
                {"tasks": self.backfill.results(), **self.backfill.summary()}
                if self.backfill
                else None
            ),
            "checkpoint_uri": self.store.uri,
            "wall_s": (r.finished_at or time.time()) - r.started_at,
            "updated_at": time.time(),
        }

    def _warm_plan(self) -> None:
        """Load what the plan's predictions need (the 1F1B schedule comes from DeepSpeed,
        the model's layers are built on the meta device) off the controller's loop:
        importing them there would stall it for seconds at the job's start."""
        try:
            predict_step(self.spec, self.spec.replica_counts()[0])
        except Exception:  # noqa: BLE001 - the predictions are a report, never a reason to fail
            log.warning("the plan's predictions are not available", exc_info=True)
        finally:
            self._plan_ready.set()

    def _plan_vs_run(self, replicas: int | None, wait: bool = False) -> dict[str, Any]:
        """The plan's predictions beside what the run measured, at the replica count
        of the measurement (memory: of the first group; step time, MFU, bubble: of the
        live group). Predictions are None until `_warm_plan` is done, unless `wait`."""
        if not self._plan_ready.wait(60 if wait else 0):
            return {"replicas": replicas, "predicted": None, "measured": None}
        tel, r = self.telemetry, self.rec
        d = r.peak_memory_replicas or replicas or self.spec.replica_counts()[0]
        bounds = (r.attempts[-1].partition.get("bounds") or None) if r.attempts else None
        key = (d, replicas or d, tel.peak_flops, tuple(bounds or ()))
        if key not in self._predictions:  # arithmetic on the spec: once per shape
            mem = memory_per_device(self.spec, d, bounds)
            step = predict_step(self.spec, key[1], tel.peak_flops, tel.peak_flops, bounds)
            self._predictions[key] = {
                "memory_bytes": {m.stage: m.total_bytes for m in mem},
                "bubble_fraction": step.bubble_fraction,
                "step_s": step.step_s,
                "mfu": step.mfu,
            }
        seconds = sorted(r.step_seconds)
        bubbles = self.bubbles.summary() if self.bubbles else None
        return {
            "replicas": d,
            "predicted": self._predictions[key],
            "measured": {
                "memory_bytes": dict(sorted(r.peak_memory.items())),
                "bubble_fraction": bubbles["bubble_fraction"] if bubbles else 0.0,
                "step_s": seconds[len(seconds) // 2] if seconds else None,
                "mfu": tel.last.get("mfu"),
            },
        }

    def _device(self, group: WorkerGroup | None) -> str | None:
        """The live group's device, else the last group's, else the one the spec fixes
        (a `device: gpu` job waiting for GPU nodes); None while 'auto' has not decided."""
        if group is not None:
            return group.device
        last = next((a.device for a in reversed(self.rec.attempts) if a.device), None)
        asked = self.spec.resources.device
        return last or (asked if asked != "auto" else None)

    _STATUS_KEYS = (
        "name", "state", "step", "total_steps", "replicas", "device", "max_replicas", "failures",
        "node_losses", "waiting", "doomed_nodes", "committed_steps", "quarantined_steps",
        "workers", "error",
        "batch",
        "partition", "train_loss", "tokens_per_s", "eval", "last_checkpoint", "ledger",
        "heldout_loss",
    )  # fmt: skip
    _RESULT_KEYS = (
        "name", "state", "losses", "attempts", "heldout_loss", "steps_per_s", "tokens_per_s",
        "checkpoint_uri", "committed_steps", "failures", "checkpoint_blocked_s",
        "checkpoint_upload_s", "checkpoint_bytes", "wall_s", "error", "notices", "node_losses",
        "resizes", "recoveries", "waited_s", "ledger", "cost", "alerts", "bubbles", "backfill",
        "plan", "tracking",
        "batch",
        "partition",
    )  # fmt: skip

    def status(self, since_event: int = 0) -> dict[str, Any]:
        snap = self.snapshot()
        with self._lock:
            events = self._events[since_event:]
            n = len(self._events)
        return {
            **{k: snap[k] for k in self._STATUS_KEYS},
            "preemption_notices": len(snap["notices"]),
            "events": events,
            "next_event": n,
        }

    def result(self) -> dict[str, Any]:
        snap = self.snapshot(wait_for_plan=True)
        losses = snap["losses"]
        last = max(losses) if losses else None
        return {
            **{k: snap[k] for k in self._RESULT_KEYS},
            "steps": snap["step"],
            "final_train_loss": losses[last] if last is not None else None,
            "bubbles": snap["bubbles"],
        }

    def summary(self) -> dict[str, Any]:
        """What `spotline status` and `spotline report` show (stored with the checkpoints)."""
        snap = self.snapshot()
        snap["losses"] = {str(k): v for k, v in snap["losses"].items()}
        snap["notices"] = [
            {k: n.get(k) for k in ("source", "node_id", "committed_step", "notice_to_commit_s")}
            for n in snap["notices"]
        ]
        snap["preemption_notices"] = len(snap["notices"])
        # checkpoint_blocked_s stays: a rerun of the finished job reports from this.
        for k in ("workers", "attempts", "recoveries",
                  "checkpoint_upload_s", "checkpoint_bytes", "backfill"):  # fmt: skip
            snap.pop(k, None)
        return snap

    # --- the machine --------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        while not self.state.terminal:
            self.step()
        return self.result()

    def step(self) -> State:
        state = self.state
        t0 = self.clock()
        self._accounted = 0.0
        try:
            self._take_inbox()
            if not self.state.terminal:
                if self.demand is not None:
                    self.demand.keep()
                self.state = self._handle(self.state)
        except WorkerFailure as e:
            if e.progress is not None and self.group is not None:
                # What the living ranks published in the failing poll (steps, finished
                # uploads) happened: a commit made from it must keep its steps' losses.
                try:
                    self._ingest(e.progress, self.clock() - t0)
                except Exception:  # noqa: BLE001 - the failure below is what to act on
                    log.exception("could not take in the last report of the failed group")
            self.state = self._on_failure(str(e), e.process_died, e.causes)
        except (CheckpointMismatchError, CorruptCheckpointError, SpecError) as e:
            self.state = self._fail(str(e))
        except StorageError as e:
            # Storage unreachable while scheduling or restoring: a restart retries it.
            self.state = self._on_failure(f"checkpoint storage: {e}")
        except Exception as e:  # noqa: BLE001 - nothing may leave workers behind
            theirs = user_code_error(e)  # a notice source, a provider built here
            log.exception("unexpected error in the controller")
            self.state = self._fail(
                str(theirs)
                if theirs is not None
                else f"internal error in the controller while {state.name}: "
                f"{type(e).__name__}: {e}. This is a Spotline bug; the job resumes from its "
                "latest committed checkpoint when resubmitted"
            )
        if self.group is not None:
            self._last_world = self.group.world_size
        self._charge(state, self.clock() - t0)
        if self.state.terminal:
            self.rec.finished_at = time.time()
            try:
                self._write_artifacts(with_trace=False)  # the group is gone; the last trace stands
                self.cluster.close()
            finally:
                if self.demand is not None:
                    self.demand.withdraw()
                self.telemetry.close(self.state.name)  # every end: finished, failed, stopped
        return self.state

    def _handle(self, state: State) -> State:
        if isinstance(state, Pending):
            return self._pending()
        if isinstance(state, Scheduling):
            return self._scheduling(state)
        if isinstance(state, Waiting):
            return self._waiting(state)
        if isinstance(state, Running):
            return self._running(state)
        if isinstance(state, Leaving):
            return self._leaving(state)
        if isinstance(state, Finishing):
            return self._finishing()
        raise AssertionError(f"no handler for {state!r}")

    def _charge(self, state: State, seconds: float) -> None:
        """Every iteration's device-seconds go to the ledger: what the ranks measured
        (see `_account`), and the rest to the part of the state it was spent in."""
        part = {Pending: "startup_other", Waiting: "waiting"}.get(type(state), "recovery")
        if isinstance(state, (Running, Leaving, Finishing)):
            part = "startup_other"  # the final evaluation, a gap between two polls
        elif isinstance(state, Scheduling) and state.reason == "start":
            part = "startup_other"
        rest = max(0.0, seconds - self._accounted)
        self.telemetry.ledger.charge(part, rest, self._last_world)

    def _fail(self, reason: str) -> State:
        reason = redact(" ".join(reason.split()))  # one line, and never a secret
        self.rec.error = reason
        self._event(f"FAILED: {reason}", logging.ERROR, track="end")
        self._teardown()
        return Failed(error=reason)

    def _pending(self) -> State:
        self._event(f"job {self.spec.name}: checkpoints at {self.store.uri}")
        # The preflight checked this already; checked again here, before anything is
        # written, because another job may have committed there since.
        self.coordinator.check_owner()
        done = self.coordinator.finished_summary()
        if done is not None:
            # Nothing to train: report the finished job as it ended, from what it stored,
            # starting no worker (and writing nothing over that summary).
            self._event(
                f"job {self.spec.name} already finished at step {done['committed_steps'][-1]}; "
                "reporting it from its stored summary. Raise train.steps to train further, or "
                "set checkpoint.uri for a fresh run"
            )
            return Finished(reported=done)
        self._owns_store = True
        self._store_tokenizer()
        self.telemetry.resume(self.coordinator)
        self._check_jit_fit(measured=False)
        return Scheduling(reason="start", since=self.clock())

    def _store_tokenizer(self) -> None:
        """Keep the job's tokenizer files beside its checkpoints, so an export carries the
        tokenizer the model was trained with, wherever the original lives."""
        from spotline.data.tokenizer import tokenizer_files
        from spotline.export import TOKENIZER_ARTIFACTS

        try:
            files = tokenizer_files(self.spec)
        except ValueError as e:  # DataError: reading the files
            self._event(f"could not read the tokenizer files: {e}", logging.WARNING)
            return
        for name, data in files.items():
            self.coordinator.write_artifact(f"{TOKENIZER_ARTIFACTS}/{name}", data)

    # --- scheduling ----------------------------------------------------------------

    def _scheduling(self, state: Scheduling) -> State:
        self.cluster.watch()
        capacity = self._settled_capacity(state.want)
        decision = self.scaling_policy.decide(capacity)
        if isinstance(decision, Wait):
            self._event(
                f"{decision.reason} Waiting up to {self.spec.elastic.wait_for_capacity_s:.0f}s "
                "(elastic.wait_for_capacity_s).",
                logging.WARNING,
            )
            return Waiting(reason=decision.reason, since=self.clock())
        return self._start_group(decision.replicas)

    def _settled_capacity(self, want: int) -> int:
        """Whole replicas the live, non-draining capacity holds, read again (for up to
        SPOTLINE_CAPACITY_SETTLE_S) while it is short of `want`: a group just torn down
        gives its devices back a moment later, and sizing from the first reading would
        start too small."""
        deadline = self.clock() + constants.SPOTLINE_CAPACITY_SETTLE_S
        capacity = self.cluster.capacity()
        while capacity < want and self.clock() < deadline:
            self.sleep(0.2)
            capacity = self.cluster.capacity()
        return capacity

    def _waiting(self, state: Waiting) -> State:
        capacity = self.cluster.capacity()
        decision = self.scaling_policy.decide(capacity)
        now = self.clock()
        if isinstance(decision, Resize):
            self.rec.waited_s += now - state.since
            self._event(f"capacity is back: {decision.replicas} replica(s) fit")
            return self._start_group(decision.replicas)
        limit = self.spec.elastic.wait_for_capacity_s
        if now - state.since > limit:
            self.rec.waited_s += now - state.since
            last = max(self.coordinator.committed, default=None)
            resume = (
                f"the job resumes from committed step {last} at {self.store.uri}"
                if last is not None
                else "no step was committed yet"
            )
            return self._fail(
                f"{state.reason} Gave up after waiting {limit:.0f}s (elastic.wait_for_capacity_s). "
                f"Add nodes or lower elastic.min_replicas, then resubmit: {resume}."
            )
        self.sleep(1.0)
        return state

    def _start_group(self, replicas: int) -> State:
        pp = self.spec.parallel.pipeline_stages
        self._event(
            f"starting {replicas} replica(s) x {pp} stage(s) = {replicas * pp} workers "
            f"(elastic {self.spec.elastic.min_replicas}..{self.spec.elastic.max_replicas})",
            track="start",
        )
        if self.rec.resizes and "to_replicas" not in self.rec.resizes[-1]:
            self.rec.resizes[-1]["to_replicas"] = replicas
        self._starting_since = self.clock()
        self._recent_steps.clear()
        self.rec.step_seconds.clear()
        group = self.group_factory(replicas)
        self.group = group
        attempt = Attempt(replicas=replicas, attempt=group.attempt)
        self.rec.attempts.append(attempt)
        if not self._partition_read and self.spec.parallel.partition == "balanced":
            # A resumed balanced job trains at the bounds its checkpoint was trained at (a
            # uniform or explicit partition is the spec's own, whatever was recorded).
            self._partition_read = True
            self._partition_pin = self._partition_pin or self.coordinator.recorded_partition()
        # A group that restores a checkpoint next leaves its weights empty: no rank
        # runs the random init that the load would overwrite.
        group.start(partition=self._partition_pin, init=not self.coordinator.has_checkpoint())
        attempt.device = group.device
        self._started_partition(group, attempt)
        self.telemetry.peak_flops = group.peak_flops()
        if self.bubbles is not None:
            self.bubbles.reset_ranks()
        if self.backfill is not None:
            self.backfill.attach(group.executors())
        reached = self.step_count
        restored, manifest = self.coordinator.restore(group, self.sleep)
        for done in self.coordinator.take_recovered():  # a dead group's, from its receipts
            self._committed(done)
        if manifest is not None:
            attempt.restored_from = manifest.step
            resharded = (
                manifest.topology.get("pipeline_stages"),
                manifest.topology.get("replicas"),
            )
            how = (
                f", resharded from {resharded[0]} stage(s) x {resharded[1]} replica(s) to "
                f"{pp} x {replicas}"
                if resharded != (pp, replicas)
                else ""
            )
            self._event(
                f"restored committed checkpoint step {manifest.step} (sha256 verified{how})",
                track="resume",
            )
        self.step_count = restored
        attempt.start_step = restored
        self.telemetry.start_tracking(manifest.step if manifest is not None else None)
        self.telemetry.ledger.lost(reached - restored)  # trained again from here
        if restored >= self.spec.train.steps:
            return Finishing()
        group.run(self.spec.train.steps)
        self._group_started = self.clock()
        return Running(target=self.spec.train.steps)

    # --- training -------------------------------------------------------------------

    def _running(self, state: Running) -> State:
        progress = self._poll()
        if progress.finished is not None:
            return Finishing()
        if self.inbox.stop_reason is not None:
            return self._leave("stop", self.step_count + 1, self.inbox.stop_reason)
        grow = self._grow_decision()
        if grow is not None:
            return self._leave("grow", self.step_count + 1, f"capacity for {grow} replica(s)", grow)
        return self._asked_partition() or self._rebalance_decision() or state

    def _poll(self) -> Progress:
        """One collection of the ranks' progress: losses, saves, commits, figures."""
        assert self.group is not None
        t0 = self.clock()
        progress = self.group.poll(constants.SPOTLINE_POLL_INTERVAL_S)
        self._ingest(progress, self.clock() - t0)
        return progress

    def _ingest(self, p: Progress, elapsed: float) -> None:
        group = self.group
        assert group is not None
        r = self.rec
        attempt = r.attempts[-1]
        if p.batch is not None:
            r.batch = p.batch
        for step, loss, step_s, wall in p.steps:
            r.tokens_trained += self._batch_at(step) * self.spec.model.seq_len
            r.losses[step] = loss
            r.step_seconds.append(step_s)
            attempt.losses.append((step, loss))
            self._recent_steps.append((step, wall))
            if r.first_step_start is None:
                r.first_step_start = wall - step_s
            r.last_step_end = wall
        if p.steps:
            r.steps_trained += len(p.steps)
            self.step_count = p.steps[-1][0]
            if self._starting_since is not None:
                self._start_s = self.clock() - self._starting_since
                self._starting_since = None
            self._after_restart()
        for step, blocked in sorted(p.saves.items()):
            self.coordinator.expect(step, group.attempt, group.world_size)
            r.blocked_s.append(blocked)
        for done in self.coordinator.receive(p.uploads):
            self._committed(done)
        for notice in p.notices:
            self.notify(notice)
        for m in p.memory:
            if r.peak_memory_replicas not in (None, group.replicas):
                continue  # keep the first group's: the plan is compared at one shape
            r.peak_memory_replicas = group.replicas
            r.peak_memory[m["stage"]] = max(r.peak_memory.get(m["stage"], 0), m["peak_bytes"])
        self._account(p, elapsed)

    def _after_restart(self) -> None:
        if self._restart_from is None:
            return
        since, why = self._restart_from
        self._restart_from = None
        self._restart_s = self.clock() - since
        self.rec.recoveries.append(
            {
                "why": why,
                "seconds": self._restart_s,
                "resumed_at_step": self.step_count,
                "resumed_at": time.time(),
            }
        )
        self._event(f"training again {self._restart_s:.1f}s after the {why}", track="recovery")

    def _account(self, p: Progress, elapsed: float) -> None:
        """Figures of a batch of steps; the ledger gets the devices' wall time of the
        iteration, split into what the steps measured and the rest."""
        group = self.group
        assert group is not None
        world = group.world_size
        steps = [(s, loss) for s, loss, _, _ in p.steps]
        step_time = sum(st for _, _, st, _ in p.steps)
        blocked = sum(p.saves.values())
        warm = self.clock() - self._group_started > 1.0 and len(p.steps) > 0
        if self.bubbles is not None and p.bubbles:
            on = self.backfill is not None and not self.backfill.governor.decision().paused
            # The depth in force: an adaptive batch deepens the 1F1B schedule as it grows.
            micro = (self.rec.batch or {}).get("micro_batches")
            self.bubbles.add(p.bubbles, micro or self.spec.grad_accum(group.replicas), on)
            if p.steps and p.steps[0][0] > self.rec.attempts[-1].start_step + 1:
                # A group's first step allocates and warms up: not the stages' pace.
                self._measure_stages(p.bubbles)
        if self.backfill is not None:
            if p.steps:
                self.backfill.on_chunk(len(p.steps), step_time, warm=warm)
            self.backfill.poll()
        if p.steps:
            self._note_rate(group.replicas, len(p.steps) / max(step_time, 1e-9), warm)
        self.telemetry.steps(
            steps=steps,
            seconds=step_time,
            replicas=group.replicas,
            world=world,
            bubbles=self.bubbles.last_chunk if self.bubbles else None,
            per_rank=p.bubbles,
            lr=p.lr,
            tokens=sum(self._batch_at(s) for s, _ in steps) * self.spec.model.seq_len,
            batch=self._batch_view(steps[-1][0]) if steps else None,
            backfill_slowdown=self.backfill.governor.slowdown if self.backfill else None,
            data_stall_s=p.data_stall_s,
            warm=warm,
            uploading=p.uploading,
        )
        # The devices ran the whole time: what the steps and saves did not cover is
        # waiting for the slowest rank, the step agreement, and publishing progress.
        wall = max(elapsed, step_time + blocked)
        self.telemetry.ledger.charge("checkpoint_stall", blocked, world)
        self.telemetry.ledger.charge("startup_other", wall - step_time - blocked, world)
        self._accounted += elapsed
        self._report_progress(p)
        self._export_counts()

    def _report_progress(self, p: Progress) -> None:
        every = self.spec.train.log_every
        t = self.spec.train
        for step, loss, step_s, _ in p.steps:
            if step % every == 0 or step >= t.steps:
                sps = 1.0 / step_s if step_s else 0.0
                tok = sps * self._batch_at(step) * self.spec.model.seq_len
                self._event(
                    f"step {step}/{t.steps}  loss {loss:.4f}  {sps:.2f} steps/s  {tok:,.0f} tokens/s"
                )

    def _batch_at(self, step: int) -> int:
        """Sequences step `step` trained on: the adaptive schedule's history as the ranks
        reported it, else what the batch policy gives the live group."""
        hist = (self.rec.batch or {}).get("history")
        if self.spec.train.batch_schedule == "adaptive" and hist:
            return next((size for first, size in reversed(hist) if first <= step), hist[0][1])
        group = self.group
        return self.spec.global_batch(group.replicas if group else self.spec.elastic.max_replicas)

    def _batch_view(self, step: int | None = None) -> dict[str, Any]:
        """The batch of `step` (the latest step reported by default), for status and
        metrics: schedule, global_batch_size, noise_scale, history."""
        b = self.rec.batch or {}
        step = self.step_count if step is None else step
        return {
            "schedule": self.spec.train.batch_schedule,
            "global_batch_size": self._batch_at(step),
            "noise_scale": b.get("noise_scale"),
            "history": b.get("history") or [[1, self._batch_at(1)]],
        }

    def _committed(self, done: Committed) -> None:
        # The losses up to the commit, as the committing group trained them: a group
        # that died before reporting its last steps would leave them out of the record.
        r = self.rec
        group = {a.attempt: a for a in r.attempts}.get(done.manifest.extra.get("attempt"))
        reported = {s for s, _ in group.losses} if group is not None else set()
        for step, loss in done.losses:
            r.losses[step] = loss
            if group is not None and step not in reported:
                group.losses.append((step, loss))
        if group is not None:
            group.losses.sort()
        self.rec.upload_bytes.append(done.nbytes)
        if done.upload_s is not None:
            self.rec.upload_s.append(done.upload_s)
            self._check_jit_fit(measured=True)
        self.telemetry.commit(
            done.step, done.nbytes, self.rec.blocked_s[-1] if self.rec.blocked_s else None,
            done.upload_s,
        )  # fmt: skip
        if self.backfill is not None:
            self.backfill.on_commit(done.manifest, final=done.step >= self.spec.train.steps)
            self.backfill.poll()  # start what is due now
        self._write_artifacts()

    # --- leaving a group: preemption, grow, stop -------------------------------------

    def _leave(
        self,
        why: str,
        step: int,
        detail: str,
        grow_to: int = 0,
        deadline: float | None = None,
        partition: list[int] | None = None,
    ) -> State:
        assert self.group is not None
        step = min(step, self.spec.train.steps)
        self.group.request(save_at=step, stop_at=step, reason=detail)
        self._event(f"checkpoint at step {step}, then {why} ({detail})")
        late = deadline if step > self.step_count + 1 else None
        return Leaving(
            why=why,
            step=step,
            since=self.clock(),
            grow_to=grow_to,
            deadline=late,
            partition=tuple(partition) if partition is not None else None,
        )

    def _leaving(self, state: Leaving) -> State:
        progress = self._poll()
        if progress.finished is None:
            if state.deadline is not None:
                return self._keep_jit_in_time(state)
            if state.why == "rebalance" and self.step_count < state.step:
                # Training on toward the checkpoint boundary; a stop request goes first.
                if self.inbox.stop_reason is not None:
                    return self._leave("stop", self.step_count + 1, self.inbox.stop_reason)
                return replace(state, since=self.clock())
            if self.clock() - state.since > constants.SPOTLINE_UPLOAD_FLUSH_TIMEOUT_S:
                raise WorkerFailure(
                    "stopping",
                    {f"no stop within {constants.SPOTLINE_UPLOAD_FLUSH_TIMEOUT_S:.0f}s": [0]},
                )
            return state
        stopped = int(progress.finished["stopped_at"])
        if stopped >= self.spec.train.steps and state.why != "stop":
            # The group reached the last step first: the end's own commit answers.
            return Finishing()
        committed = stopped in self.coordinator.committed
        pending = stopped in self.coordinator.pending_steps()
        if pending and self.clock() - state.since < constants.SPOTLINE_UPLOAD_FLUSH_TIMEOUT_S:
            return state  # its uploads are still running: they come through the polls
        self._answer_notices(stopped, committed)
        if not committed:
            self._event(
                f"checkpoint step {stopped} did not commit; the latest committed step is "
                f"{max(self.coordinator.committed, default=None)}",
                logging.WARNING,
            )
        if state.why == "stop":
            self.rec.attempts[-1].ended_by = "stop"
            self._teardown()
            latest = max(self.coordinator.committed, default=None)
            self._event(
                f"stopped at step {stopped} ({self.inbox.stop_reason}); latest committed "
                f"step {latest} at {self.store.uri}: submitting the job again resumes there",
                track="end",
            )
            return Stopped(reason=self.inbox.stop_reason or "stop requested")
        ended = {"grow": "grow", "preemption": "preemption notice", "rebalance": "re-partition"}[
            state.why
        ]
        want = state.grow_to or self._replicas_left()
        if state.why == "grow":
            detail = f"capacity for {state.grow_to} replica(s) (restart cost {self._restart_cost_s() or 0:.1f}s)"
        elif state.why == "rebalance":
            want = self.group.replicas if self.group else want
            self._partition_pin = list(state.partition or ())
            self._update_repartition(-1, step=stopped, outcome="restarting")
            detail = f"re-partition to layers per stage {_sizes(self._partition_pin)}"
        else:
            detail = f"leaving node(s) {', '.join(n[:12] for n in self._doomed_here())}"
        self.rec.attempts[-1].ended_by = ended
        self._restart(state.why, detail)
        return Scheduling(reason=state.why, since=self.clock(), want=want)

    def _keep_jit_in_time(self, state: Leaving) -> State:
        """A late JIT step was picked from the step time measured then. Should steps slow
        down (a busy node, a slow link), reaching it and saving could miss the deadline:
        then the save moves up to the next step."""
        assert self.group is not None
        step_s = self._wall_step_s()
        if step_s is None or state.step <= self.step_count + 1:
            return state
        window = state.deadline - time.time() - self.jit_policy.margin_s
        need = (state.step - self.step_count) * step_s + self._predicted_save_s()
        if need <= window:
            return state
        at = self.step_count + 1
        self.group.request(save_at=at, stop_at=at, reason="preemption notice")
        self._event(
            f"steps slowed to {step_s * 1e3:.0f} ms: saving step {state.step} would need "
            f"{need:.0f}s of the {window:.0f}s left before the notice's deadline (less the "
            f"margin); the just-in-time checkpoint moves up to step {at}",
            logging.WARNING,
        )
        return replace(state, step=at, deadline=None)

    def _wall_step_s(self) -> float | None:
        """Wall-clock seconds per step over the latest steps (everything between steps
        included), or None before two steps of the live group."""
        recent = self._recent_steps
        if len(recent) < 2 or recent[-1][0] == recent[0][0]:
            return None
        return (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0])

    def _replicas_left(self, exclude: set[str] = frozenset()) -> int:
        """Replicas the group's healthy devices plus the free ones hold: what the next
        group can expect once Ray shows the devices of the old one free again (nodes
        doomed by a notice, or in `exclude`, do not count)."""
        group = self.group
        if group is None:
            return 0
        gone = set(self._doomed_here()) | set(exclude)
        held = sum(1 for w in group.worker_info() if w["node_id"] not in gone)
        return self.cluster.capacity(held_workers=held)

    def _doomed_here(self) -> list[str]:
        group = self.group
        with self._lock:
            doomed = set(self.doomed)
        return sorted((group.node_ids() if group else set()) & doomed)

    def _restart_cost_s(self) -> float | None:
        return self._restart_s if self._restart_s is not None else self._start_s

    def _note_rate(self, replicas: int, steps_per_s: float, warm: bool) -> None:
        """The steps per second this job runs at `replicas` replicas, as the grow and
        shrink decisions weigh it: a moving average over warm chunks, so that one chunk
        slowed by a save, a warm-up or a neighbour does not decide for the rest of the
        job that a size is not worth returning to."""
        prev = self._sps_by_replicas.get(replicas)
        if prev is None or (warm and replicas not in self._warm_rates):
            self._sps_by_replicas[replicas] = steps_per_s  # a cold figure until a warm one
        elif warm:
            self._sps_by_replicas[replicas] = prev + _RATE_WEIGHT * (steps_per_s - prev)
        if warm:
            self._warm_rates.add(replicas)

    def _grow_decision(self) -> int | None:
        group = self.group
        assert group is not None
        e = self.spec.elastic
        now = self.clock()
        if group.replicas >= e.max_replicas or now - self._last_grow_check < _GROW_CHECK_S:
            return None
        self._last_grow_check = now
        restart_s = self._restart_cost_s()
        if restart_s is None:
            return None  # no start is measured yet
        decision = self.grow_policy.decide(
            replicas=group.replicas,
            capacity=self.cluster.capacity(held_workers=group.world_size),
            steps_left=self.spec.train.steps - self.step_count,
            steps_per_s=self._sps_by_replicas.get(group.replicas, 0.0),
            restart_s=restart_s,
            running_s=now - self._group_started,
            measured=self._sps_by_replicas,
        )
        return decision.replicas if decision is not None else None

    def _restart(self, why: str, detail: str) -> None:
        assert self.group is not None
        before = self.group.replicas
        self.rec.resizes.append(
            {"step": self.step_count, "from_replicas": before, "why": why, "detail": detail}
        )
        self._event(
            f"restarting at step {self.step_count} from {before} replica(s): {detail}",
            track="restart",
        )
        self._teardown()
        self._restart_from = (self.clock(), why)

    def _teardown(self) -> None:
        if self.backfill is not None:
            self.backfill.detach()
        if self.group is not None:
            self.coordinator.abandon(self.group.attempt)
            self.group.shutdown()
            self.group = None

    def _finishing(self) -> State:
        group = self.group
        assert group is not None
        last = self.spec.train.steps
        deadline = self.clock() + constants.SPOTLINE_UPLOAD_FLUSH_TIMEOUT_S
        while last not in self.coordinator.committed and last in self.coordinator.pending_steps():
            if self.clock() > deadline:
                break
            self._poll()
        if self._pending_jit:
            self._answer_notices(last, last in self.coordinator.committed)
        self.rec.heldout_loss = group.heldout_loss()
        self.telemetry.heldout(last, self.rec.heldout_loss)
        if self.backfill is not None:
            self.backfill.finish(self.spec.backfill.finish_timeout_s, self.sleep)
            self._export_counts()
        self._write_artifacts()
        self._teardown()
        if last not in self.coordinator.committed:
            return self._fail(f"the final checkpoint (step {last}) did not commit")
        self._event(
            f"finished {last} steps; held-out loss {self.rec.heldout_loss:.4f}; "
            f"checkpoints: {self.store.step_uri(last)}",
            track="end",
        )
        return Finished()

    # --- failures -------------------------------------------------------------------

    def _on_failure(
        self, error: str, process_died: bool = False, causes: list[BaseException] | None = None
    ) -> State:
        lost = self._lost_nodes(patient=process_died)
        want = self._replicas_left(exclude=lost)
        r = self.rec
        if r.attempts:
            r.attempts[-1].error = error
            r.attempts[-1].ended_by = "node lost" if lost else "failure"
        self._teardown()
        self._restart_from = (self.clock(), "node loss" if lost else "failure")
        latest = max(self.coordinator.committed, default=None)
        if lost:
            # Losing spot nodes is the normal weather, not a fault of the job: it does not
            # use up failure.max_failures.
            r.node_losses += len(lost)
            if self.demand is not None:
                self.demand.keep(force=True)  # the autoscaler replaces what went
            with self._lock:
                for node in lost:
                    self.doomed.pop(node, None)
            self._event(
                f"lost node(s) {', '.join(n[:12] for n in sorted(lost))} at step "
                f"{self.step_count}; resuming from the latest committed step ({latest}) on "
                f"what is left",
                logging.WARNING,
                track="node_loss",
            )
            return Scheduling(reason="node loss", since=self.clock(), want=want)
        kind = classify(causes or [], error)
        if kind.retryable:  # only transient faults use up failure.max_failures
            r.failures += 1
        self._event(
            f"worker failure at step {self.step_count}: {error}", logging.WARNING, track="failure"
        )
        decision = self.failure_policy.decide(r.failures, error, kind)
        if isinstance(decision, Fail):
            return self._fail(decision.reason)
        self._event(decision.reason)
        return Scheduling(reason="failure", since=self.clock(), want=want)

    def _lost_nodes(self, patient: bool) -> set[str]:
        """Nodes of the live group that are gone. A failure may surface first as a peer's
        collective error; after a worker reported dead the checks go on for
        SPOTLINE_NODE_LOSS_WAIT_S, as its node can be seen gone a moment after its
        processes."""
        if self.group is None:
            return set()
        mine = self.group.node_ids()
        deadline = self.clock() + (constants.SPOTLINE_NODE_LOSS_WAIT_S if patient else 0.0)
        while True:
            lost = self.cluster.gone(mine)
            if lost or self.clock() >= deadline:
                return lost
            self.sleep(0.25)

    # --- spot capacity --------------------------------------------------------------

    def notify(self, notice: dict[str, Any]) -> bool:
        """A preemption notice (Notice fields); True once accepted. Thread-safe: node
        watchers call it at any time, and re-send until it returns True."""
        accepted = self.inbox.notify(notice, self.clock())
        node = notice.get("node_id")
        if node is not None:
            with self._lock:
                self.doomed[node] = notice["deadline"]
        return accepted

    def request_repartition(self, sizes: list[int]) -> None:
        """Re-partition the pipeline to `sizes` layers per stage at the next checkpoint
        boundary (through the checkpoint, as the imbalance watch does). Thread-safe."""
        self.inbox.repartition(list(sizes))

    def hold_latest(self, seconds: float = 900.0) -> dict[str, Any] | None:
        """Keep the newest committed step from retention for `seconds`, for a reader
        outside the job (a sweep trial that will continue from it); {"step", "uri"}, or
        None when nothing is committed yet. Thread-safe."""
        step = self.coordinator.hold_latest(seconds)
        return None if step is None else {"step": step, "uri": self.store.uri}

    def request_stop(self, reason: str = "stop requested") -> None:
        """Stop at the next step boundary, commit a checkpoint there, and end STOPPED.

        Thread-safe. The job resumes from that checkpoint when it is submitted again.
        """
        self.inbox.stop(reason)

    def _take_inbox(self) -> None:
        """Notices, in any state: the doomed node is drained at once (nothing new is
        placed there); a notice for the live group's nodes starts its JIT checkpoint."""
        notices, stop = self.inbox.take()
        group = self.group
        mine = group.node_ids() if group else set()
        jit: list[dict[str, Any]] = []
        for n in notices:
            node = n.get("node_id")
            left = n["deadline"] - time.time()
            where = f"node {node[:12]}" if node else "an unnamed node"
            self._event(
                f"preemption notice ({n['source']}: {n['reason']}) for {where}, "
                f"{left:.0f}s before its deadline",
                logging.WARNING,
                track="preemption",
            )
            if node is not None:
                self.cluster.drain(node, n["deadline"], f"{n['source']}: {n['reason']}")
                if self.demand is not None:
                    self.demand.keep(force=True)  # a replacement, launched during the notice
            n["step"] = self.step_count
            if group is not None and (node is None or node in mine):
                jit.append(n)
            else:
                n["outcome"] = (
                    "no ranks of this job on that node; it is drained"
                    if group is not None
                    else "no group running; the node is drained, the next group avoids it"
                )
                self.rec.notices.append(n)
        if stop is not None and not isinstance(self.state, (Running, Leaving, Finishing)):
            if not self.state.terminal:
                self._teardown()
                self.state = Stopped(reason=stop)
            return
        if not jit:
            return
        self._pending_jit.extend(jit)
        leaving_for_balance = isinstance(self.state, Leaving) and self.state.why == "rebalance"
        if (isinstance(self.state, Running) or leaving_for_balance) and group is not None:
            # A re-partition waiting for its checkpoint boundary gives way to the notice.
            if leaving_for_balance:
                self._update_repartition(-1, outcome="dropped for a preemption notice")
            self.state = self._jit(jit, group)
        # Already leaving (a grow, a stop): that checkpoint answers the notice too, and
        # the drained node gets no part of the next group.

    def _jit(self, notices: list[dict[str, Any]], group: WorkerGroup) -> State:
        """Pick the step of the just-in-time checkpoint: at once, or as late as the
        deadline allows when staying on the doomed capacity gains steps (JitPolicy)."""
        deadline = min(n["deadline"] for n in notices)
        step_s = self._wall_step_s() or 0.0
        save_s = self._predicted_save_s()
        doomed = set(self._doomed_here())
        left = sum(1 for w in group.worker_info() if w["node_id"] not in doomed)
        after = min(group.replicas, left // self.spec.parallel.pipeline_stages)
        at = self.jit_policy.decide(
            step=self.step_count,
            seconds_left=deadline - time.time(),
            step_s=step_s,
            save_s=save_s,
            replicas=group.replicas,
            replicas_after=after,
            rate_after=self._sps_by_replicas.get(after),
        )
        plan = (
            "at once" if at == self.step_count + 1 else f"after {at - self.step_count} more step(s)"
        )
        self._event(
            f"just-in-time checkpoint {plan} (step {at}; predicted save {save_s:.1f}s, "
            f"{deadline - time.time():.0f}s to the deadline)"
        )
        return self._leave("preemption", at, "preemption notice", deadline=deadline)

    def _predicted_save_s(self) -> float:
        """Host copy + serialization + upload + commit of one checkpoint, from what this job
        measured (or, before its first commit, the state size at an assumed rate)."""
        r = self.rec
        if r.upload_s:
            return (
                max(r.blocked_s[-1] if r.blocked_s else 0.0, 0.0)
                + r.upload_s[-1]
                + 2 * (constants.SPOTLINE_POLL_INTERVAL_S)
            )
        from spotline.planning.jit import predicted_save_s

        replicas = self.group.replicas if self.group else self.spec.replica_counts()[0]
        return predicted_save_s(self.spec, replicas)

    def _check_jit_fit(self, measured: bool) -> None:
        """Say so when a just-in-time checkpoint cannot meet the shortest notice: at the
        start from the state size, and once more from the first measured save."""
        from spotline.planning.jit import jit_fit_problem

        group = self.group
        if measured:
            if self._jit_fit_checked or group is None:
                return
            self._jit_fit_checked = True
            sps = self._sps_by_replicas.get(group.replicas)
            problem = jit_fit_problem(
                self.spec,
                group.replicas,
                save_s=self._predicted_save_s(),
                step_s=1.0 / sps if sps else 0.0,
            )
        else:
            problem = jit_fit_problem(self.spec, self.spec.replica_counts()[0])
        if problem:
            self._event(f"warning: {problem}", logging.WARNING)

    def _answer_notices(self, step: int, committed: bool) -> None:
        now = self.clock()
        for n in self._pending_jit:
            n["committed_step"] = (
                step if committed else max(self.coordinator.committed, default=None)
            )
            n["notice_to_commit_s"] = now - n["received_clock"] if committed else None
            n["committed_at"] = time.time() if committed else None
            n["before_deadline_s"] = n["deadline"] - time.time()
            n["outcome"] = "just-in-time checkpoint committed" if committed else "commit failed"
            self.rec.notices.append(n)
        if self._pending_jit and committed:
            first = self._pending_jit[0]
            took = now - first["received_clock"]
            budget = self.spec.preemption.jit_checkpoint_budget_s
            self._event(
                f"just-in-time checkpoint step {step} committed {took:.1f}s after the notice, "
                f"{first['deadline'] - time.time():.0f}s before the deadline"
                + (
                    f"; that is over preemption.jit_checkpoint_budget_s ({budget:.0f}s)"
                    if took > budget
                    else ""
                ),
                logging.WARNING if took > budget else logging.INFO,
            )
        self._pending_jit = []

    # --- bubbles and backfill -------------------------------------------------------

    def trace(self) -> dict[str, Any] | None:
        """Chrome-trace JSON of the latest recorded steps of every stage (None for pp=1),
        with the stage partition in force and every re-partition in its metadata."""
        if self.bubbles is None:
            return None
        slices = self.backfill.slices() if self.backfill is not None else {}
        out = self.bubbles.trace(self.spec.name, slices)
        out["otherData"] = {"partition": self._partition_summary()}
        return out

    # --- stage partitions -----------------------------------------------------------

    def _started_partition(self, group: WorkerGroup, attempt: Attempt) -> None:
        """Note the partition a new group runs: the attempt's record, its manifests."""
        info = group.partition()
        part = dict(info)
        last = self.rec.repartitions[-1] if self.rec.repartitions else None
        if last is not None and last["outcome"] == "restarting":
            self._update_repartition(-1, outcome="done")
            part["repartition"] = len(self.rec.repartitions) - 1
        attempt.partition = part
        self._stage_window.clear()
        if not info.get("bounds"):
            return
        self.coordinator.partitions[group.attempt] = list(info["bounds"])
        if self.spec.parallel.pipeline_stages < 2:
            return
        how = info.get("method", "?") + (" (kept from before)" if info.get("pinned") else "")
        predicted = info.get("predicted_imbalance")
        extra = (
            f"; predicted stage imbalance {predicted:.1%} (uniform: "
            f"{info['predicted_uniform_imbalance']:.1%})"
            if predicted is not None
            else ""
        )
        self._event(f"stage partition {how}: layers per stage {info['sizes']}{extra}")

    def _measure_stages(self, reports: list[dict[str, Any]]) -> None:
        """Each stage's compute seconds per step in this poll, and their imbalance."""
        per_stage = stage_compute_s(reports)
        pp = self.spec.parallel.pipeline_stages
        if len(per_stage) != pp or not self.rec.attempts:
            return
        stage_s = [per_stage[s] for s in range(pp)]
        steps = max(int(r.get("steps", 0)) for r in reports)
        self._stage_window.append((self.step_count, imbalance(stage_s), stage_s))
        attempt = self.rec.attempts[-1]
        # New dicts, never changed in place: status() reads them from another thread.
        old = attempt.partition.get("measured", {"steps": 0, "stage_s": [0.0] * pp})
        total = [a + s * steps for a, s in zip(old["stage_s"], stage_s, strict=True)]
        n = old["steps"] + steps
        measured = {
            "steps": n,
            "stage_s": total,
            "stage_s_per_step": [a / n for a in total],
            "imbalance": imbalance(total),
        }
        attempt.partition = {**attempt.partition, "measured": measured}
        if "repartition" in attempt.partition:  # a re-partitioned group: the imbalance after
            self._update_repartition(
                attempt.partition["repartition"], measured_imbalance_after=measured["imbalance"]
            )

    def _update_repartition(self, index: int, **fields: Any) -> None:
        """Replace (never change in place: status() reads from another thread)."""
        self.rec.repartitions[index] = {**self.rec.repartitions[index], **fields}

    def _rebalance_decision(self) -> State | None:
        """Leave for a re-partition at the next checkpoint boundary when the measured stage
        imbalance stayed over parallel.rebalance_threshold and the restart pays."""
        group = self.group
        policy = self.rebalance_policy
        now = self.clock()
        if policy is None or group is None or now - self._last_rebalance_check < _GROW_CHECK_S:
            return None
        self._last_rebalance_check = now
        info = self.rec.attempts[-1].partition
        restart_s = self._restart_cost_s()
        if restart_s is None or "layer_s" not in info or not self._stage_window:
            return None
        window = [(step, imb) for step, imb, _ in self._stage_window]
        first = window[-1][0] - policy.window_steps
        rows = [s for step, _, s in self._stage_window if step > first]
        stage_s = [sum(col) / len(rows) for col in zip(*rows, strict=True)]
        from spotline.planning.choice import balanced_partition

        decision = policy.decide(
            window=window,
            stage_s=stage_s,
            bounds=info["bounds"],
            layer_s=info["layer_s"],
            cut=lambda speeds: balanced_partition(
                self.spec, info["layer_s"], speeds, replicas=group.replicas
            ),
            steps_left=self.spec.train.steps - self.step_count,
            steps_per_s=self._sps_by_replicas.get(group.replicas, 0.0),
            restart_s=restart_s,
            running_s=now - self._group_started,
        )
        if decision is None:
            return None
        return self._leave_for_partition(
            decision.bounds,
            f"stage imbalance {decision.measured_imbalance:.1%} over "
            f"{policy.window_steps} steps > parallel.rebalance_threshold "
            f"{policy.threshold:.0%}; predicted imbalance {decision.predicted_imbalance:.1%}, "
            f"{decision.speedup:.2f}x faster stages (restart cost {restart_s:.1f}s)",
            measured_imbalance=decision.measured_imbalance,
            predicted_imbalance=decision.predicted_imbalance,
            predicted_speedup=decision.speedup,
            restart_cost_s=restart_s,
        )

    def _asked_partition(self) -> State | None:
        """A re-partition asked for with `request_repartition`, at the next boundary."""
        sizes = self.inbox.take_repartition()
        group = self.group
        if sizes is None or group is None:
            return None
        from spotline.planning.partition import bounds_from_sizes, check_bounds

        bounds = bounds_from_sizes(sizes)
        current = self.rec.attempts[-1].partition.get("bounds") or []
        problem = check_bounds(
            bounds, current[-1] if current else 0, self.spec.parallel.pipeline_stages
        )
        if problem or bounds == current:
            self._event(
                f"re-partition to layers per stage {sizes} ignored: "
                + (problem or "that is the partition in force"),
                logging.WARNING,
            )
            return None
        window = [imb for _, imb, _ in self._stage_window]
        return self._leave_for_partition(
            bounds, "asked for", measured_imbalance=window[-1] if window else None
        )

    def _leave_for_partition(self, bounds: list[int], why: str, **figures: Any) -> State:
        """Save at the next checkpoint boundary, then restart the group at `bounds`."""
        interval = self.spec.checkpoint.interval_steps
        boundary = min((self.step_count // interval + 1) * interval, self.spec.train.steps)
        before = self.rec.attempts[-1].partition.get("bounds") or []
        self.rec.repartitions.append(
            {
                "step": boundary,
                "from_bounds": list(before),
                "to_bounds": list(bounds),
                "why": why,
                **figures,
                "outcome": "waiting for the checkpoint boundary",
            }
        )
        return self._leave(
            "rebalance",
            boundary,
            f"re-partition, layers per stage {_sizes(before)} -> {_sizes(bounds)}: {why}",
            partition=bounds,
        )

    def _partition_summary(self) -> dict[str, Any] | None:
        """The partition in force (the live or latest group's), with its measured
        imbalance, and every re-partition so far."""
        if not self.rec.attempts or self.spec.parallel.pipeline_stages < 2:
            return None
        now = self.rec.attempts[-1].partition
        measured = now.get("measured", {})
        return {
            "method": now.get("method"),
            "bounds": now.get("bounds"),
            "sizes": now.get("sizes"),
            "predicted_imbalance": now.get("predicted_imbalance"),
            "predicted_uniform_imbalance": now.get("predicted_uniform_imbalance"),
            "measured_imbalance": measured.get("imbalance"),
            "stage_compute_s": measured.get("stage_s_per_step"),
            "repartitions": list(self.rec.repartitions),
        }

    def _write_artifacts(self, with_trace: bool = True) -> None:
        """Keep the trace, summary and ledger beside the checkpoints current, for
        `spotline trace/status/report` on a finished job and for a restarted controller.
        Never into a URI this job does not own (another job's artifacts stay intact)."""
        if not self._owns_store:
            return
        self.coordinator.store_summary(self.summary(), self.telemetry.ledger.to_dict())
        if with_trace and self.bubbles is not None and self.bubbles.latest:
            self.coordinator.write_artifact(TRACE_ARTIFACT, json.dumps(self.trace()).encode())

    def _export_counts(self) -> None:
        restarts: dict[str, int] = {}
        for a in self.rec.attempts[:-1]:
            why = (a.ended_by or "unknown").replace(" ", "_")
            restarts[why] = restarts.get(why, 0) + 1
        tasks: dict[str, int] = {}
        for t in self.backfill.results() if self.backfill else []:
            if t["state"] in ("done", "failed"):
                tasks[t["state"]] = tasks.get(t["state"], 0) + 1
        self.telemetry.counts(len(self.rec.notices), self.rec.node_losses, restarts, tasks)

    def _backfill_result(self, result: dict[str, Any]) -> None:
        self.telemetry.backfill_result(result)

    def submit_backfill(self, task: Any, name: str | None = None) -> int:
        if self.backfill is None:
            raise RuntimeError(
                "backfill is off for this job; set backfill.enabled: true (it needs "
                "parallel.pipeline_stages >= 2) to run backfill tasks"
            )
        return self.backfill.submit(task, name)

    def backfill_record(self, task_id: int) -> dict[str, Any] | None:
        return self.backfill.record(task_id) if self.backfill is not None else None


def _sizes(bounds: list[int]) -> list[int]:
    return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
