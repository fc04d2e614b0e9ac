"""What a controller is made of, and what other threads may ask of it.

`ControllerParts` wires the controller's rooms together (the record, telemetry and its
pace, the inbox and event log, the JIT and partition books, health and cordons, peer
recovery, the artifacts, the backfill door, the commit coordinator) and answers the
queries and requests that come from other threads: status, result, summary and trace
(projections of one `Snapshot`), the ranks' stacks, notices, stop, re-partition and
hold requests. It also carries a poll of the live group to telemetry and the
coordinator, and the evidence of a hang (the ranks' stacks, taken before the group is
torn down) to the artifacts. It takes no decision and moves no state: the loop and its
transitions are `controller.Controller`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from spotline import constants
from spotline.bubbles.book import BubbleBook
from spotline.checkpoint import CheckpointStore
from spotline.checkpoint.coordinator import CommitCoordinator, Committed
from spotline.config.redact import redact
from spotline.config.schema import JobSpec
from spotline.controller.artifacts import Artifacts, trace
from spotline.controller.backfill_api import BackfillAPI
from spotline.controller.capacity import replicas_left, settled_capacity
from spotline.controller.cordons import Cordons
from spotline.controller.health import Hang, HealthBook
from spotline.controller.inbox import EventLog, Inbox
from spotline.controller.jit import JitBook, JitPolicy
from spotline.controller.policies import (
    FailurePolicy,
    GrowPolicy,
    Resize,
    ScalingPolicy,
    Wait,
    dwelling,
)
from spotline.controller.recovery import PeerRecovery
from spotline.controller.repartition import PartitionBook
from spotline.controller.snapshot import (
    PlanView,
    Record,
    Snapshot,
    as_result,
    as_status,
    as_summary,
    take_snapshot,
)
from spotline.controller.state import Pending, State
from spotline.controller.telemetry import Telemetry
from spotline.runtime.cluster import ClusterView
from spotline.runtime.demand import Demand
from spotline.runtime.faults import refusal
from spotline.runtime.progress import Progress, WorkerFailure, WorkerGroup
from spotline.runtime.stacks import summarise

log = logging.getLogger("spotline.controller")

_KEEPING_UP = 3
"""Checkpoints in a row, none skipped, before skipped ones are said to be over."""


class ControllerParts:
    """The controller's rooms and its answers to other threads (see the module)."""

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
        peers: Any = None,
        standby: Any = None,
        stacks: Any = None,
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
        self.events = EventLog()
        self.inbox = Inbox()
        self.rec = Record()
        self.coordinator = CommitCoordinator(spec, store, self._event)
        if demand is not None:
            demand.bind(self._event)  # its failures are warnings: the job trains on
        self.recovery = PeerRecovery(spec, peers, self._event)  # peers: the state keepers
        self.telemetry = Telemetry(spec, self._event, checkpoint_uri=self.store.uri, rec=self.rec)
        self.pace = self.telemetry.pace
        self.health = HealthBook(spec, self._event, self.telemetry.metrics)
        self.jit = JitBook(
            spec,
            JitPolicy(constants.SPOTLINE_JIT_MARGIN_S),
            self.pace,
            self.rec,
            self._event,
            constants.SPOTLINE_POLL_INTERVAL_S,
        )
        self.partitions = PartitionBook(spec, self.rec, self._event)
        self.artifacts = Artifacts(spec, self.coordinator, self._event)
        self.cordons = Cordons(
            spec,
            self.health,
            cluster,
            self.coordinator,
            self.artifacts,
            demand,
            self._event,
            clock,
        )
        pp = spec.parallel.pipeline_stages
        self.bubbles = BubbleBook(pp) if pp > 1 else None
        self.backfill = backfill
        self.backfill_api = BackfillAPI(backfill, self.telemetry)
        if backfill is not None:
            backfill.bind(self._event, self.backfill_api.on_result)
            self.coordinator.pinned = backfill.pinned_steps
        self.state: State = Pending()
        self.group: WorkerGroup | None = None
        self.survivors: Any = None
        """Ranks of the ended group that the next one adopts (`WorkerGroup.hand_over`)."""
        self.standby = standby if spec.recovery.in_place else None
        """Replicas started ahead on free capacity (`spotline.runtime.standby.Standby`)."""
        self.step_count = 0  # the latest step the live group reported
        self.plan_view = PlanView(spec)
        self.stacks = stacks
        """Takes the live group's stacks (`spotline.runtime.stacks.RayStacks`); None:
        hangs come without them."""
        refused = refusal(spec)  # a test's faults in a job not marked as a test
        if refused is not None:
            self._event(refused, logging.WARNING)

    @property
    def store(self) -> CheckpointStore:
        return self.coordinator.store

    # --- reporting ----------------------------------------------------------------

    def _event(self, text: str, level: int = logging.INFO, track: str | None = None) -> None:
        """Log an event and keep it for status; `track`: also an event of this kind in
        the job's trackers."""
        text = redact(text)
        log.log(level, text)
        self.events.append(text)
        if track is not None:
            self.telemetry.event(self.step_count, track, text)

    def snapshot(self, wait_for_plan: bool = False) -> Snapshot:
        """Everything the job knows about itself, once: status, result and summary are
        projections of it. Safe to call from any thread."""
        return take_snapshot(self, wait_for_plan)

    def status(self, since_event: int = 0) -> dict[str, Any]:
        snap = self.snapshot()
        return as_status(snap, *self.events.since(since_event))

    def result(self) -> dict[str, Any]:
        return as_result(self.snapshot(wait_for_plan=True))

    def summary(self) -> dict[str, Any]:
        """What `spotline status` and `spotline report` show (stored with the checkpoints)."""
        return as_summary(self.snapshot())

    def trace(self) -> dict[str, Any] | None:
        """Chrome-trace JSON of the latest steps of every stage (None for pp=1)."""
        stragglers = self.health.view(self.clock())["stragglers"]
        return trace(
            self.spec.name, self.bubbles, self.backfill, self.partitions.summary(), stragglers
        )

    def _write_artifacts(self, with_trace: bool = True) -> None:
        """Keep the trace, summary and ledger beside the checkpoints current."""
        latest = with_trace and self.bubbles is not None and self.bubbles.latest
        self.artifacts.write(
            self.summary, self.telemetry.ledger.to_dict(), self.trace if latest else None
        )

    # --- the live group: a poll taken in, its nodes, its teardown -----------------------

    def _poll(self) -> Progress:
        """One collection of the ranks' progress: losses, saves, commits, figures."""
        assert self.group is not None
        t0 = self.clock()
        progress = self.group.poll(constants.SPOTLINE_POLL_INTERVAL_S)
        self._ingest(progress, self.clock() - t0)
        hang = self.health.hang(self.clock(), list(self.rec.step_seconds), self.rec.blocked_s)
        if hang is not None:
            # Torn down now, not after failure.collective_timeout_s: the ranks holding
            # the others up are named, with the phase each was last seen in (a data
            # stall past its limit: the ranks waiting for data), and a hang's stacks
            # are taken first, while the stuck ranks are as they were.
            error = hang.error()
            ranks = [b.rank for b in hang.behind]
            if isinstance(hang, Hang):
                self._take_evidence(ranks)
            nodes = {b.rank: b.node for b in hang.behind}
            raise WorkerFailure("training", {str(error): ranks}, nodes, [error])
        return progress

    def _take_evidence(self, named: list[int]) -> None:
        """The stacks of the hung group's ranks (every rank of a group of at most
        SPOTLINE_STACKS_ALL_RANKS, else the named ones), and on NCCL their flight
        records, stored beside the checkpoints and summarised for status. Bounded by
        SPOTLINE_STACKS_TIMEOUT_S; it never fails the hang path."""
        group = self.group
        if self.stacks is None or group is None:
            return
        every = group.world_size <= constants.SPOTLINE_STACKS_ALL_RANKS
        try:
            record = self.stacks.take(group, None if every else named)
        except Exception as e:  # noqa: BLE001 - evidence is best effort
            self._event(f"could not take the hung ranks' stacks: {e}", logging.WARNING)
            return
        record.update(step=self.step_count, attempt=group.attempt, named=named)
        uri = self.artifacts.store_stacks(f"hang-{group.attempt}-step{self.step_count}", record)
        summary = {
            "why": "hang",
            "step": self.step_count,
            "attempt": group.attempt,
            "taken_at": record.get("taken_at"),
            "uri": uri,
            "ranks": summarise(record, named),
        }
        self.health.took_stacks(summary)
        where = "; ".join(
            f"rank {r}: {s['frame'] or s['error']}" + (f" ({s['state']})" if s["state"] else "")
            for r, s in summary["ranks"].items()
        )
        kept = f"; the stacks taken are at {uri}" if uri else ""
        self._event(f"stacks taken before the teardown: {where}{kept}", logging.WARNING)

    def take_stacks(self) -> dict[str, Any]:
        """Every rank's stack now (`spotline stacks`), with the innermost frame of each
        training thread. Thread-safe: it reads the live group and changes nothing."""
        group = self.group
        if group is None or self.stacks is None:
            return {
                "job": self.spec.name,
                "error": f"job {self.spec.name} has no group running to take stacks of (it is "
                f"{self.state.name}); try again once it trains",
            }
        record = self.stacks.take(group, None)
        record.update(step=self.step_count, attempt=group.attempt, job=self.spec.name)
        return record

    def _ingest(self, p: Progress, elapsed: float) -> None:
        """A poll of the live group: its figures to telemetry, its saves and finished
        uploads to the commit coordinator, its notices to the inbox."""
        group = self.group
        assert group is not None
        if p.steps:
            self.step_count = p.steps[-1][0]
        self.telemetry.take_steps(p, group.replicas, self.clock())
        self.health.take(p.ranks, self.step_count, self.clock())
        for step in sorted(p.saves):
            self.coordinator.expect(step, group.attempt, group.world_size)
        self._saves_skipped(p.skipped_saves, sorted(p.saves))
        for done in self.coordinator.receive(p.uploads):
            self._committed(done)
        for notice in p.notices:
            self.notify(notice)
        self.telemetry.take_memory(p, group.replicas)
        tel = self.telemetry
        tel.account(p, elapsed, group, self.clock(), self.bubbles, self.backfill, self.partitions)
        tel.export_counts(self.backfill_api.finished_counts())
        self.recovery.take(p.peer, group, p.steps)

    def _saves_skipped(self, skipped: list[int], saved: list[int]) -> None:
        """Say once when periodic checkpoints start being skipped (uploads slower than
        the interval), and once when they keep up again: three checkpoints in a row
        with none skipped between them."""
        r = self.rec
        for step, was_skipped in sorted([(s, True) for s in skipped] + [(s, False) for s in saved]):
            if was_skipped:
                r.skipped_saves.append(step)
                r.saves_in_a_row = 0
                if not r.saves_behind:
                    r.saves_behind = True
                    self._event(
                        f"checkpoint at step {step} skipped: a rank was still uploading an "
                        "earlier one (uploads take longer than checkpoint.interval_steps = "
                        f"{self.spec.checkpoint.interval_steps} steps of training). Raise "
                        "checkpoint.interval_steps, or lift checkpoint.upload_max_mb_per_s",
                        logging.WARNING,
                    )
                continue
            r.saves_in_a_row += 1
            if r.saves_behind and r.saves_in_a_row >= _KEEPING_UP:
                r.saves_behind = False
                self._event(
                    f"checkpoints keep up again at step {step} ({len(r.skipped_saves)} "
                    "skipped so far)"
                )

    def _committed(self, done: Committed) -> None:
        self.rec.commit(done)
        if done.upload_s is not None and self.group is not None:
            self.jit.check_fit(self.group.replicas)  # once, from the first measured save
        blocked = self.rec.blocked_s[-1] if self.rec.blocked_s else None
        self.telemetry.commit(done.step, done.nbytes, blocked, done.upload_s)
        if self.backfill is not None:
            self.backfill.on_commit(done.manifest, final=done.step >= self.spec.train.steps)
            self.backfill.poll()  # start what is due now
        self._write_artifacts()

    def _replicas_left(self, exclude: set[str] = frozenset()) -> int:
        """Replicas the next group can expect (nodes doomed by a notice, or in `exclude`,
        do not count)."""
        if self.group is None:
            return 0
        gone = set(self._doomed_here()) | set(exclude) | set(self.cluster.cordoned)
        ahead = self.standby.devices() if self.standby is not None else 0
        return replicas_left(self.cluster, self.group.worker_info(), gone, ahead)

    def _placement(self, want: int | None = None) -> Resize | Wait:
        """The size of the next group from what the cluster holds (`want`: read again
        for a while when short of it, as after a teardown). Cordons that expired go first;
        when the cordoned nodes alone keep the job below elastic.min_replicas, the oldest
        are lifted (`Cordons.make_room`); a wait names the nodes still cordoned."""
        self.cordons.expire()
        held = self._held()

        def capacity() -> int:
            if want is None:
                return self.cluster.capacity(held_workers=held)
            return settled_capacity(self.cluster, want, self.clock, self.sleep, held)

        free = capacity()
        if free < self.spec.elastic.min_replicas and self.cordons.make_room(
            lambda lifted: self.cluster.capacity(held_workers=held, lifted=lifted)
        ):
            free = capacity()
        decision = self.scaling_policy.decide(free)
        if isinstance(decision, Wait):
            return Wait(decision.reason + self.cordons.waiting_note())
        return decision

    def _doomed_here(self) -> list[str]:
        group = self.group
        return sorted((group.node_ids() if group else set()) & set(self.inbox.doomed()))

    def _teardown(self, leaving: set[str] | None = None) -> None:
        """End the live group. `leaving` (with recovery.in_place): the nodes whose ranks
        go (lost, or named by a notice); the group's other good ranks are handed to the
        next group rather than ended (`survivors`), never those on a cordoned or noticed
        node. None: everything ends, ranks held for a next group included."""
        if self.backfill is not None:
            self.backfill.detach()
        if self.group is not None:
            self.coordinator.abandon(self.group.attempt)
            if leaving is not None and self.spec.recovery.in_place:
                gone = set(leaving) | set(self.cluster.cordoned) | set(self.inbox.doomed())
                self._release_survivors()
                self.survivors = self.group.hand_over(gone, self.spec.recovery.reform_grace_s)
                if self.standby is not None:
                    self.survivors.replicas += self.standby.take(gone)
                    self._say_standby_failures()
                behind = self.group.left_behind
                self._event(
                    f"{self.survivors.devices()} rank(s) go on in their processes"
                    + "".join(f"; rank {k} not: {why}" for k, why in sorted(behind.items())),
                    logging.WARNING
                    if any(w.startswith("still") for w in behind.values())
                    else logging.INFO,
                )
            self.group.shutdown()
            self.group = None
        if leaving is None:
            self._release_survivors()
            if self.standby is not None:
                self.standby.release()

    def _count_kept(self, group: WorkerGroup, attempt: Any) -> None:
        attempt.kept, attempt.ahead = group.kept, group.ahead
        if group.kept or group.ahead:
            ahead = f" ({group.ahead} of them started ahead)" if group.ahead else ""
            self._event(
                f"{group.kept + group.ahead} of {group.world_size} rank(s) re-formed in their "
                f"processes{ahead}"
            )

    def _keep_standby(self) -> int:
        """Start replicas ahead on the free capacity beyond the live group, up to
        elastic.max_replicas, off cordoned and noticed nodes; returns the devices they
        hold (the job's own, as the group's are)."""
        group, standby = self.group, self.standby
        if standby is None or group is None:
            return 0
        limit = (self.scaling_policy.fit(self.spec.elastic.max_replicas) or 0) - group.replicas
        avoid = set(self.cluster.cordoned) | set(self.inbox.doomed())
        standby.keep(self.cluster.capacity(), limit, group.device, avoid)
        self._say_standby_failures()
        return standby.devices()

    def _say_standby_failures(self) -> None:
        """Each replica started ahead that failed, timed out or died: the group starts
        its own processes instead."""
        while self.standby is not None and self.standby.failures:
            self._event(self.standby.failures.pop(0), logging.WARNING)

    def _grow_declined(self, capacity: int, restart_s: float, running_s: float) -> None:
        """Free capacity the job does not grow onto says why, once per group and size, so
        that nobody wonders at an idle node: the measured rates, or the dwell."""
        group = self.group
        assert group is not None
        target = self.scaling_policy.fit(capacity) or 0
        if target <= group.replicas or target == self.pace.declined:
            return
        if dwelling(running_s, restart_s):
            return  # the decision comes once the group has run long enough
        self.pace.declined = target
        rates = self.pace.sps
        at_target = f"{rates[target]:.2f}" if target in rates else "not measured"
        self._event(
            f"capacity for {target} replica(s) is free, staying at {group.replicas}: growing "
            f"does not pay (measured steps/s: {rates.get(group.replicas, 0.0):.2f} at "
            f"{group.replicas}, {at_target} at {target}; restart cost {restart_s:.1f}s)"
        )

    def _forget(self, lost: set[str]) -> None:
        """Lost nodes: their notices and state keepers went with them, and the autoscaler
        is asked at once to replace them."""
        if self.demand is not None:
            self.demand.keep(force=True)
        self.inbox.forget(lost)
        self.recovery.forget(lost)

    def _release_survivors(self) -> None:
        if self.survivors is not None:
            self.survivors.release()
            self.survivors = None

    def _take_survivors(self) -> Any:
        out, self.survivors = self.survivors, None
        return out

    def _held(self) -> int:
        """Devices the ranks held for the next group occupy: theirs to take again."""
        return self.survivors.devices() if self.survivors is not None else 0

    # --- what other threads ask -------------------------------------------------------

    def notify(self, notice: dict[str, Any]) -> bool:
        """A preemption notice (Notice fields); True once accepted. Thread-safe: node
        watchers call it at any time, and re-send until it returns True."""
        return self.inbox.notify(notice, self.clock())

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

    def _drain(self, node: str, deadline: float, reason: str) -> None:
        self.cluster.drain(node, deadline, reason)
        if self.demand is not None:
            self.demand.keep(force=True)  # a replacement, launched during the notice

    def _answer_notices(self, step: int, committed: bool) -> None:
        latest = max(self.coordinator.committed, default=None)
        self.jit.answer(step, committed, latest, self.clock())
