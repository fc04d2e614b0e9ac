"""What the job knows about itself, typed once; status, result and summary are projections.

`Record` is what the controller's loop writes as the job goes (its groups, losses,
failures, resizes); `Figures` what telemetry measured; `Snapshot` is everything a
reader sees at one moment, taken from them and the controller's rooms after each step
of the loop, and published (`Published`): other threads read only that. `status`,
`result` and `summary` cut from it the dicts users, the CLI and the stored summary
read. `PlanView` sets the plan's predictions beside what the run measured. Nothing
here steers the job.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from spotline.controller.pace import RECENT_STEPS
from spotline.controller.state import Finished, Waiting
from spotline.planning.choice import planned_bounds
from spotline.planning.host_step import host_source, host_step
from spotline.planning.memory_model import memory_per_device
from spotline.planning.step import predict_step
from spotline.train.process import deepspeed_without_mlflow

log = logging.getLogger("spotline.controller")


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
    restored_via: str = ""  # "storage" or "peer memory", when it restored a step
    restored_bytes: int = 0  # what its ranks read to restore
    restored_attempt: str = ""  # the group whose peer copy it restored, if it did
    kept: int = 0  # ranks of the group before that it adopted (processes kept, re-formed)
    ahead: int = 0  # ranks that joined from replicas started ahead (processes kept)

    def restored(self, step: int, nbytes: int, peer: Any = None) -> None:
        """It restored `step` (reading `nbytes`): from `peer` (a peer-memory offer) or,
        without one, from storage."""
        self.restored_from, self.restored_bytes = step, nbytes
        self.restored_via = "peer memory" if peer is not None else "storage"
        self.restored_attempt = peer.attempt if peer is not None else ""


@dataclass
class Record:
    """What the loop records as the job goes: its groups and what ended each, the
    losses, failures, node losses, resizes and the end. Written by the controller's
    loop alone; the rooms keep their own figures (`Figures`, the JIT book's notices,
    the partition book's re-partitions) and the snapshot reads them all."""

    attempts: list[Attempt] = field(default_factory=list)
    losses: dict[int, float] = field(default_factory=dict)
    failures: int = 0
    node_losses: int = 0
    resizes: list[dict[str, Any]] = field(default_factory=list)
    waited_s: float = 0.0
    heldout_loss: float | None = None
    error: str | None = None
    started_at: float = 0.0  # wall clock
    finished_at: float | None = None

    def take_losses(self, attempt: str | None, losses: list[tuple[int, float]]) -> None:
        """(step, loss) group `attempt` trained, from its reports, receipts or peer
        copies: the steps it never reported (it died first) join the record too."""
        group = {a.attempt: a for a in self.attempts}.get(attempt)
        reported = {s for s, _ in group.losses} if group is not None else set()
        for step, loss in losses:
            self.losses[step] = loss
            if group is not None and step not in reported:
                group.losses.append((step, loss))
        if group is not None:
            group.losses.sort()


@dataclass
class Figures:
    """What the ranks' progress measured, kept by telemetry alone (`Telemetry.fig`)."""

    recoveries: list[dict[str, Any]] = field(default_factory=list)
    blocked_s: list[float] = field(default_factory=list)
    upload_s: list[float] = field(default_factory=list)
    upload_bytes: list[int] = field(default_factory=list)
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
    step_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    """The live group's latest steps' own seconds (the ranks' step timers)."""
    skipped_saves: list[int] = field(default_factory=list)
    """Periodic checkpoints skipped because an earlier one was still uploading."""
    saves_behind: bool = False
    """Periodic checkpoints are being skipped (said once, until they keep up again)."""
    saves_in_a_row: int = 0
    """Checkpoints taken since the latest skipped one."""


@dataclass
class Snapshot:
    """Everything the job knows about itself at one moment (field order: the dicts')."""

    name: str | None = None
    state: str | None = None
    step: int | None = None
    total_steps: int | None = None
    replicas: int | None = None
    device: str | None = None
    max_replicas: int | None = None
    waiting: str | None = None
    doomed_nodes: list[str] | None = None
    workers: list[dict[str, Any]] | None = None
    failures: int | None = None
    node_losses: int | None = None
    committed_steps: list[int] | None = None
    quarantined_steps: list[int] | None = None
    last_checkpoint: dict[str, Any] | None = None
    steps_per_s: float | None = None  # wall clock from the first step to the last
    tokens_per_s: float | None = None
    heldout_loss: float | None = None
    error: str | None = None
    restarts: int | None = None
    train_loss: float | None = None
    mfu: float | None = None
    hfu: float | None = None
    data_stall_fraction: float | None = None
    peak_flops_per_device: float | None = None
    eval: dict[str, Any] | None = None
    evals: list[dict[str, Any]] | None = None
    bubbles: dict[str, Any] | None = None
    plan: dict[str, Any] | None = None
    ledger: dict[str, Any] | None = None
    cost: dict[str, Any] | None = None
    alerts: list[str] | None = None
    batch: dict[str, Any] | None = None
    history: list[dict[str, Any]] | None = None
    losses: dict[int, float] | None = None
    attempts: list[dict[str, Any]] | None = None
    notices: list[dict[str, Any]] | None = None
    resizes: list[dict[str, Any]] | None = None
    partition: dict[str, Any] | None = None
    recoveries: list[dict[str, Any]] | None = None
    tracking: Any = None
    waited_s: float | None = None
    checkpoint_blocked_s: list[float] | None = None
    checkpoint_upload_s: list[float] | None = None
    checkpoint_bytes: list[int] | None = None
    skipped_saves: list[int] | None = None
    """Periodic checkpoints skipped while an earlier one still uploaded."""
    backfill: dict[str, Any] | None = None
    health: dict[str, Any] | None = None
    """Every rank's heartbeat and compute, the stragglers, a data stall going on, the
    hangs with the frame each named rank was in (their stacks), and the cordoned nodes
    with when their cordons expire."""
    peer_memory: dict[str, Any] | None = None
    """Peer copies: every how many steps, their cost, the newest, restores from them."""
    checkpoint_uri: str | None = None
    wall_s: float | None = None
    updated_at: float | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)
    """Keys of a stored summary this version does not know (a job reported from it)."""
    absent: frozenset[str] = field(default=frozenset(), repr=False)
    """Fields a stored summary did not have: its projections leave them out, as it did."""

    @classmethod
    def from_summary(cls, summary: dict[str, Any]) -> Snapshot:
        """A job that finished before, from its stored summary: the parts the summary
        leaves out are what this controller did (nothing)."""
        known = _FIELDS
        base: dict[str, Any] = {
            **dict.fromkeys((*STATUS_KEYS, *RESULT_KEYS)),
            "workers": [],
            "attempts": [],
            "recoveries": [],
            "checkpoint_blocked_s": [],
            "checkpoint_upload_s": [],
            "checkpoint_bytes": [],
            "skipped_saves": [],
            "backfill": None,
            "notices": [],
            "resizes": [],
            "alerts": [],
            "tracking": [],
            **summary,
        }
        base["losses"] = {int(k): v for k, v in (summary.get("losses") or {}).items()}
        base["replicas"] = 0
        return cls(
            **{k: v for k, v in base.items() if k in known},
            extra={k: v for k, v in base.items() if k not in known},
            absent=frozenset(known - base.keys()),
        )

    def as_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in _ORDER if k not in self.absent}
        out.update(self.extra)
        return out

    def __getitem__(self, key: str) -> Any:
        """Read as the dict it projects to (`snap["step"]`)."""
        if key in _FIELDS and key not in self.absent:
            return getattr(self, key)
        return self.extra[key]


_ORDER = tuple(f.name for f in fields(Snapshot) if f.name not in ("extra", "absent"))
_FIELDS = frozenset(_ORDER)

STATUS_KEYS = (
    "name", "state", "step", "total_steps", "replicas", "device", "max_replicas", "failures",
    "node_losses", "waiting", "doomed_nodes", "committed_steps", "quarantined_steps",
    "skipped_saves",
    "workers", "error",
    "batch", "health", "peer_memory",
    "partition", "train_loss", "tokens_per_s", "eval", "last_checkpoint", "ledger",
    "heldout_loss",
)  # fmt: skip
RESULT_KEYS = (
    "name", "state", "losses", "attempts", "heldout_loss", "steps_per_s", "tokens_per_s",
    "checkpoint_uri", "committed_steps", "failures", "checkpoint_blocked_s",
    "checkpoint_upload_s", "checkpoint_bytes", "skipped_saves", "wall_s", "error", "notices",
    "node_losses",
    "resizes", "recoveries", "waited_s", "ledger", "cost", "alerts", "bubbles", "backfill",
    "plan", "tracking",
    "batch",
    "partition", "health", "peer_memory",
)  # fmt: skip


def as_status(snap: Snapshot, events: list[str], next_event: int) -> dict[str, Any]:
    """What `spotline status` and the SDK poll: the live figures and the new events."""
    return {
        **{k: snap[k] for k in STATUS_KEYS},
        "preemption_notices": len(snap["notices"]),
        "events": events,
        "next_event": next_event,
    }


def as_result(snap: Snapshot) -> dict[str, Any]:
    """What `run()` returns once the job ended."""
    losses = snap["losses"]
    last = max(losses) if losses else None
    return {
        **{k: snap[k] for k in RESULT_KEYS},
        "steps": snap["step"],
        "final_train_loss": losses[last] if last is not None else None,
        "bubbles": snap["bubbles"],
    }


def as_summary(snap: Snapshot) -> dict[str, Any]:
    """What `spotline status` and `spotline report` show (stored with the checkpoints)."""
    out = snap.as_dict()
    out["losses"] = {str(k): v for k, v in out["losses"].items()}
    out["notices"] = [
        {k: n.get(k) for k in ("source", "node_id", "committed_step", "notice_to_commit_s")}
        for n in out["notices"]
    ]
    out["preemption_notices"] = len(out["notices"])
    # checkpoint_blocked_s stays: a rerun of the finished job reports from this.
    for k in ("workers", "attempts", "recoveries",
              "checkpoint_upload_s", "checkpoint_bytes", "backfill"):  # fmt: skip
        out.pop(k, None)
    return out


def take_snapshot(ctl, wait_for_plan: bool = False) -> Snapshot:
    """The controller's snapshot (`ctl`: a Controller), taken on its loop's thread."""
    state = ctl.state
    if isinstance(state, Finished) and state.reported is not None:
        return Snapshot.from_summary(state.reported)
    group, r, tel = ctl.fleet.group, ctl.rec, ctl.telemetry
    fig = tel.fig
    replicas = group.replicas if group else None
    committed = ctl.coordinator.committed
    last = committed[-1] if committed else None
    span = (
        (fig.last_step_end - fig.first_step_start)
        if fig.first_step_start is not None and fig.last_step_end is not None
        else 0.0
    )
    bubbles = ctl.bubbles.summary() if ctl.bubbles else None
    now = ctl.clock.wall()
    partition_now = ctl.partitions.current
    attempts = [asdict(a) for a in r.attempts]
    if attempts and r.attempts[-1].device:  # the latest group that started: as measured
        attempts[-1]["partition"] = dict(partition_now)
    return Snapshot(
        name=ctl.spec.name,
        state=state.name,
        step=ctl.step_count,
        total_steps=ctl.spec.train.steps,
        replicas=replicas or 0,
        device=_device(ctl, group),
        max_replicas=ctl.spec.elastic.max_replicas,
        waiting=state.reason if isinstance(state, Waiting) else None,
        doomed_nodes=ctl.inbox.doomed(),
        workers=group.worker_info() if group else [],
        failures=r.failures,
        node_losses=r.node_losses,
        committed_steps=list(committed),
        quarantined_steps=list(ctl.coordinator.quarantined),
        last_checkpoint=(
            {"step": last, "uri": ctl.store.step_uri(last)} if last is not None else None
        ),
        # Wall clock from the first step to the last: commits, restarts and gaps count.
        steps_per_s=fig.steps_trained / span if span > 0 else 0.0,
        tokens_per_s=fig.tokens_trained / span if span > 0 else 0.0,
        heldout_loss=r.heldout_loss,
        error=r.error,
        restarts=max(0, len(r.attempts) - 1),
        # A resumed controller that has not trained yet: the last loss it stored.
        train_loss=tel.last.get(
            "train_loss", tel.history[-1].get("train_loss") if tel.history else None
        ),
        mfu=tel.last.get("mfu"),
        hfu=tel.last.get("hfu"),
        data_stall_fraction=tel.last.get("data_stall_fraction"),
        peak_flops_per_device=tel.peak_flops,
        eval=tel.evals[-1] if tel.evals else None,
        evals=list(tel.evals),
        bubbles=bubbles,
        plan=ctl.plan_view.compare(
            fig,
            partition_now.get("bounds"),
            tel.peak_flops,
            tel.last.get("mfu"),
            bubbles,
            replicas,
            wait_for_plan,
            _device(ctl, group),
        ),
        ledger=tel.ledger_summary(),
        cost=tel.cost(),
        alerts=[a.message() for a in tel.deviation.alerts],
        batch=tel.batch_view(ctl.step_count, replicas),
        history=list(tel.history),
        losses=dict(sorted(r.losses.items())),
        attempts=attempts,
        notices=[dict(n) for n in ctl.jit.notices],
        resizes=[dict(x) for x in r.resizes],
        partition=ctl.partitions.summary(),
        recoveries=list(fig.recoveries),
        tracking=tel.trackers.summary(),
        waited_s=r.waited_s,
        checkpoint_blocked_s=list(fig.blocked_s),
        checkpoint_upload_s=list(fig.upload_s),
        checkpoint_bytes=list(fig.upload_bytes),
        skipped_saves=list(fig.skipped_saves),
        backfill=(
            {"tasks": ctl.backfill.results(), **ctl.backfill.summary()} if ctl.backfill else None
        ),
        health={**ctl.health.view(ctl.clock()), **ctl.cordons.view()},
        peer_memory=ctl.recovery.summary(),
        checkpoint_uri=ctl.store.uri,
        wall_s=(r.finished_at or now) - r.started_at,
        updated_at=now,
    )


class Published:
    """The latest snapshot the loop published (and, when one was asked for or the job
    has ended, the latest pipeline trace): other threads read only these, under the
    lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snap: Snapshot | None = None
        self._trace: dict[str, Any] | None = None
        self._ended = False
        self._trace_asked = threading.Event()
        self._trace_done = threading.Event()

    def publish(
        self, snap: Snapshot, trace: Callable[[], dict[str, Any] | None], ended: bool = False
    ) -> None:
        """`ended`: the loop's last publish; its trace is kept for every later ask (the
        loop steps no more to answer one)."""
        with self._lock:
            self._snap = snap
        if ended or self._trace_asked.is_set():
            self._trace_asked.clear()
            t = trace()
            with self._lock:
                self._trace, self._ended = t, ended
            self._trace_done.set()

    def snapshot(self) -> Snapshot:
        with self._lock:
            assert self._snap is not None, "published at the controller's start"
            return self._snap

    def trace(self, timeout_s: float) -> dict[str, Any] | None:
        """The trace as of the loop's next step (it takes at most a poll interval), or
        the latest one when the loop does not step within `timeout_s`; the last one,
        at once, once the job has ended."""
        with self._lock:
            if self._ended:
                return self._trace
        self._trace_done.clear()
        self._trace_asked.set()
        self._trace_done.wait(timeout_s)
        with self._lock:
            return self._trace


def _device(ctl, group) -> str | None:
    """The live group's device, else the last group's, else the one the spec fixes
    (a `device: gpu` job waiting for GPU nodes); None while 'auto' has not decided."""
    if group is not None:
        return group.device
    last = next((a.device for a in reversed(ctl.rec.attempts) if a.device), None)
    asked = ctl.spec.resources.device
    return last or (asked if asked != "auto" else None)


class PlanView:
    """The plan's predictions beside what the run measured.

    What the predictions need (the 1F1B schedule comes from DeepSpeed, the model's
    layers are built on the meta device) loads on a thread of its own: importing it on
    the controller's loop would stall it for seconds at the job's start.
    """

    def __init__(self, spec):
        self.spec = spec
        self._predictions: dict[tuple, dict[str, Any]] = {}  # by shape
        self._ready = threading.Event()
        threading.Thread(target=self._warm, name="spotline-plan", daemon=True).start()

    def _warm(self) -> None:
        try:
            # The 1F1B schedule is DeepSpeed's; MLflow, which its import would load, is
            # left to the tracker that uses it.
            deepspeed_without_mlflow(hide=all(t.kind != "mlflow" for t in self.spec.tracking))
            predict_step(self.spec, self.spec.replica_counts()[0])
        except Exception:  # noqa: BLE001 - the predictions are a report, never a reason to fail
            log.warning("the plan's predictions are not available", exc_info=True)
        finally:
            self._ready.set()

    def compare(
        self,
        fig: Figures,
        bounds: list[int] | None,
        peak_flops: float | None,
        mfu: float | None,
        bubbles: dict[str, Any] | None,
        replicas: int | None,
        wait: bool = False,
        device: str | None = None,
    ) -> dict[str, Any]:
        """At the replica count of the measurement (memory: of the first group; step
        time, MFU, bubble: of the live group). Predictions are None until the warm-up
        is done, unless `wait`. A CPU group's step is the one `spotline plan` timed on
        this host, when it did (`planning.host_step`'s cache); else the peak's."""
        if not self._ready.wait(60 if wait else 0):
            return {"replicas": replicas, "predicted": None, "measured": None}
        d = fig.peak_memory_replicas or replicas or self.spec.replica_counts()[0]
        bounds = bounds or None
        key = (d, replicas or d, peak_flops, tuple(bounds or ()), device)
        if key not in self._predictions:  # arithmetic on the spec: once per shape
            mem = memory_per_device(self.spec, d, bounds)
            cut = bounds or planned_bounds(self.spec, key[1])
            # A CPU step's parts, as `spotline plan` timed them on this host (its cache).
            # The controller never times them itself: beside the ranks it would slow
            # them and skew what they measure, and after them it would hold up the end.
            on_cpu = device == "cpu"
            host = host_step(self.spec, key[1], cut, measure=False) if on_cpu else None
            step = predict_step(self.spec, key[1], peak_flops, peak_flops, cut, host)
            self._predictions[key] = {
                "memory_bytes": {m.stage: m.total_bytes for m in mem},
                "bubble_fraction": step.bubble_fraction,
                "step_s": step.step_s,
                "mfu": step.mfu,
                "step_basis": host_source(self.spec, key[1], host)
                if host is not None
                else "compute at the device's peak (collectives, the optimizer step and "
                "per-operation work not counted)"
                + (
                    "; `spotline plan` on this host times the step's parts, and the "
                    "run then reports those"
                    if on_cpu
                    else ""
                ),
            }
        seconds = sorted(fig.step_seconds)
        return {
            "replicas": d,
            "predicted": self._predictions[key],
            "measured": {
                "memory_bytes": dict(sorted(fig.peak_memory.items())),
                "bubble_fraction": bubbles["bubble_fraction"] if bubbles else 0.0,
                "step_s": seconds[len(seconds) // 2] if seconds else None,
                "mfu": mfu,
            },
        }
