"""The job controller: a loop over states over a worker group that trains on its own.

`Controller.step()` runs one iteration: it takes what the inbox holds (preemption
notices, a stop request), in whatever state it is, then runs the current state's
handler, which returns the next state. States carry their payload (`state.py`);
policies decide (`policies.py`: restart or fail, how many replicas, when to grow;
`jit.py`: at which step to take a just-in-time checkpoint; `repartition.py`: when to
re-partition the pipeline's stages) and this loop carries the decisions out. The
worker group is injected, so tests drive the machine with a fake group.

The ranks never wait for the controller: they train from their restored step to the
last one, saving at every checkpoint.interval_steps by themselves. The controller
polls what they publish (losses, saves, finished uploads) and steers with messages:
save at step k, stop at step k. Every commit, retention, artifact and status query
happens here, off the training path, through the commit coordinator (the only
owner of storage). Telemetry takes the polls in and keeps the ledger; status, result
and summary are projections of one typed `Snapshot`.

Spot capacity: a notice drains the doomed node at once. When it runs ranks of the
live group, the JIT policy picks the step to save at (at once, or the latest one whose
save still fits the deadline); the group saves and stops there, the step commits, and
the job goes on with what is left. A node lost without notice resumes from the newest
peer copy or commit. Every restart (a loss, a notice, a grow) keeps the ranks that are
still good in their processes (recovery.in_place): they re-form at the new shape. Below
elastic.min_replicas the controller waits up to elastic.wait_for_capacity_s; when
capacity comes back it grows when `GrowPolicy`'s cost rule says it pays.

Hangs and stragglers (`health.py`): every poll carries each rank's heartbeat; no step
for longer than the hang bound tears the group down as a failure naming the ranks that
held it up. A node that hung too often, or straggled too far, is cordoned; a running
group leaves a cordoned node at the next checkpoint boundary when that pays
(`cordons.py`). A new group restores from the keepers' peer copies when they are at
least as new as the newest commit (`recovery.py`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from spotline import constants
from spotline.checkpoint import CheckpointMismatchError, CorruptCheckpointError, StorageError
from spotline.checkpoint.peer import PEER_KEY
from spotline.config.loader import SpecError
from spotline.config.redact import redact
from spotline.controller.capacity import lost_nodes
from spotline.controller.parts import ControllerParts
from spotline.controller.policies import Fail, Resize, Wait, classify
from spotline.controller.recovery import restored_what
from spotline.controller.repartition import Leave
from spotline.controller.snapshot import Attempt
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
)
from spotline.registry import user_code_error
from spotline.runtime.progress import WorkerFailure, WorkerGroup

log = logging.getLogger("spotline.controller")

# How often a running job reads the cluster's capacity to see whether growing (or leaving
# a cordoned node) pays.
_GROW_CHECK_S = 2.0
# Restarts that first train on to the next checkpoint boundary.
_AT_BOUNDARY = ("rebalance", "cordon")


class Controller(ControllerParts):
    """The loop over states and the transitions between them."""

    # --- the loop -----------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        while not self.state.terminal:
            self.step()
        return self.result()

    def step(self) -> State:
        state = self.state
        t0 = self.clock()
        self.telemetry.begin_iteration()
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
            # A rank silent while its peers failed may have gone with its node.
            self.state = self._on_failure(str(e), e.process_died or bool(e.silent), e.causes)
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
            self.telemetry.world = self.group.world_size
        self.telemetry.charge_iteration(state, self.clock() - t0)
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

    _HANDLERS = {
        Pending: "_pending",
        Scheduling: "_scheduling",
        Waiting: "_waiting",
        Running: "_running",
        Leaving: "_leaving",
        Finishing: "_finishing",
    }

    def _handle(self, state: State) -> State:
        name = self._HANDLERS.get(type(state))
        if name is None:
            raise AssertionError(f"no handler for {state!r}")
        return getattr(self, name)(state)

    def _fail(self, reason: str) -> State:
        reason = redact(" ".join(reason.split()))  # one line, and never a secret
        self.rec.error = reason
        self._event(f"FAILED: {reason}", logging.ERROR, track="end")
        self._teardown()
        return Failed(error=reason)

    def _pending(self, state: Pending) -> State:
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
        self.artifacts.own()
        self.telemetry.resume(self.coordinator)
        self.cordons.keep()
        self.jit.check_fit()
        return Scheduling(reason="start", since=self.clock())

    # --- scheduling ----------------------------------------------------------------

    def _scheduling(self, state: Scheduling) -> State:
        self.cluster.watch()
        decision = self._placement(state.want)  # cordons in the way of min_replicas lifted
        if isinstance(decision, Wait):
            self._event(
                f"{decision.reason} Waiting up to {self.spec.elastic.wait_for_capacity_s:.0f}s "
                "(elastic.wait_for_capacity_s).",
                logging.WARNING,
            )
            return Waiting(reason=decision.reason, since=self.clock())
        return self._start_group(decision.replicas)

    def _waiting(self, state: Waiting) -> State:
        decision = self._placement()
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
        self.pace.starting(self.clock())
        offer = self.recovery.offer(
            self.rec.attempts,
            self.coordinator.partitions,
            max(self.coordinator.committed, default=0),
            leaving=set(self.inbox.doomed()),
        )
        self.rec.step_seconds.clear()
        group = self.group_factory(replicas)
        self.group = group
        attempt = Attempt(replicas=replicas, attempt=group.attempt)
        self.rec.attempts.append(attempt)
        pin = self.partitions.for_start(self.coordinator.recorded_partition)
        # A group that restores a checkpoint next leaves its weights empty: no rank
        # runs the random init that the load would overwrite. A peer copy alone does not
        # count: should no rank be able to read it, nothing durable is left to load.
        survivors = self._take_survivors()  # re-formed in their processes (recovery.in_place)
        group.start(partition=pin, init=not self.coordinator.has_checkpoint(), survivors=survivors)
        attempt.device = group.device
        self._count_kept(group, attempt)
        info = group.partition()
        self.partitions.started(info, attempt)
        if info.get("bounds"):  # the manifests of this group's commits record them
            self.coordinator.partitions[group.attempt] = list(info["bounds"])
        self.telemetry.peak_flops = group.peak_flops()
        if self.bubbles is not None:
            self.bubbles.reset_ranks()
        if self.backfill is not None:
            self.backfill.attach(group.executors())
        reached = self.step_count
        restored, manifest = self.coordinator.restore(group, self.sleep, peer=offer)
        for done in self.coordinator.take_recovered():  # a dead group's, from its receipts
            self._committed(done)
        from_peers = manifest is not None and PEER_KEY in manifest.extra
        source = offer if from_peers else None
        if manifest is not None:
            attempt.restored_from = manifest.step
            attempt.restored_bytes = group.restored_bytes
            attempt.restored_via = "peer memory" if source else "storage"
            attempt.restored_attempt = source.attempt if source else ""
            self._event(
                f"restored {restored_what(manifest, attempt, pp, replicas)}", track="resume"
            )
        # The copies a later restore may read: this group's, and the one it restored
        # from until this group has its own. Another lineage's never mix in.
        self.recovery.restored(group.attempt, source, attempt.restored_bytes)
        if source is not None:
            self.rec.take_losses(source.attempt, source.losses)
        self.step_count = restored
        attempt.start_step = restored
        self.telemetry.start_tracking(manifest.step if manifest is not None else None)
        self.telemetry.ledger.lost(reached - restored)  # trained again from here
        if restored >= self.spec.train.steps:
            return Finishing()
        group.run(self.spec.train.steps, self.recovery.run_every())
        self.pace.group_running(self.clock())
        self.health.group_started(self.pace.group_started, restored)
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
        return (
            self._asked_partition()
            or self._rebalance_decision()
            or self._cordon_decision()
            or state
        )

    # --- leaving a group: preemption, grow, re-partition, stop -------------------------

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
            if state.why in _AT_BOUNDARY and self.step_count < state.step:
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
        ended = {
            "grow": "grow",
            "preemption": "preemption notice",
            "rebalance": "re-partition",
            "cordon": "cordon",
        }
        want = state.grow_to or self._replicas_left()
        if state.why == "grow":
            cost = self.pace.restart_cost_s() or 0
            detail = f"capacity for {state.grow_to} replica(s) (restart cost {cost:.1f}s)"
        elif state.why == "rebalance":
            want = self.group.replicas if self.group else want
            detail = self.partitions.restarting(state.partition, stopped)
        elif state.why == "cordon":
            nodes = sorted(
                set(self.cluster.cordoned) & (self.group.node_ids() if self.group else set())
            )
            detail = f"leaving cordoned node(s) {', '.join(n[:12] for n in nodes)}"
        else:
            detail = f"leaving node(s) {', '.join(n[:12] for n in self._doomed_here())}"
        self.rec.attempts[-1].ended_by = ended[state.why]
        self._restart(state.why, detail)
        return Scheduling(reason=state.why, since=self.clock(), want=want)

    def _grow_decision(self) -> int | None:
        group = self.group
        assert group is not None
        pace, now = self.pace, self.clock()
        if (
            group.replicas >= self.spec.elastic.max_replicas
            or now - pace.grow_checked < _GROW_CHECK_S
        ):
            return None
        pace.grow_checked = now
        ahead = self._keep_standby()
        restart_s = pace.restart_cost_s()
        if restart_s is None:
            return None  # no start is measured yet
        capacity = self.cluster.capacity(held_workers=group.world_size + ahead)
        decision = self.grow_policy.decide(
            replicas=group.replicas,
            capacity=capacity,
            steps_left=self.spec.train.steps - self.step_count,
            steps_per_s=pace.sps.get(group.replicas, 0.0),
            restart_s=restart_s,
            running_s=now - pace.group_started,
            measured=pace.sps,
        )
        if decision is None:
            pace.grow_wanted = None
            self._grow_declined(capacity, restart_s, now - pace.group_started)
            return None
        # Training on while replicas started ahead get ready, but not for ever: one stuck
        # in its start, or one failing and started again, must not hold the grow back.
        if pace.grow_wanted is None:
            pace.grow_wanted = now
        sb = self.standby
        if sb is not None and sb.starting():
            if now - pace.grow_wanted < constants.SPOTLINE_STANDBY_WAIT_S:
                return None
            self._event(
                f"replica(s) started ahead not ready {now - pace.grow_wanted:.0f}s after the "
                "grow was due: growing with processes of its own",
                logging.WARNING,
            )
        pace.grow_wanted = None
        return decision.replicas

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
        # The ranks off noticed (and cordoned) nodes go on in their own processes.
        self._teardown(leaving=set(self._doomed_here()) if why == "preemption" else set())
        self.pace.restart_from = (self.clock(), why)

    def _finishing(self, state: Finishing) -> State:
        group = self.group
        assert group is not None
        last = self.spec.train.steps
        deadline = self.clock() + constants.SPOTLINE_UPLOAD_FLUSH_TIMEOUT_S
        while last not in self.coordinator.committed and last in self.coordinator.pending_steps():
            if self.clock() > deadline:
                break
            self._poll()
        if self.jit.pending:
            self._answer_notices(last, last in self.coordinator.committed)
        self.rec.heldout_loss = group.heldout_loss()
        self.telemetry.heldout(last, self.rec.heldout_loss)
        if self.backfill is not None:
            self.backfill.finish(self.spec.backfill.finish_timeout_s, self.sleep)
            self.telemetry.export_counts(self.backfill_api.finished_counts())
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
        lost = (
            lost_nodes(self.cluster, self.group.node_ids(), process_died, self.clock, self.sleep)
            if self.group is not None
            else set()
        )
        kind = classify(causes or [], error)
        hang = kind.name == "hang" and not lost
        if hang:
            # May cordon a node: before the next size is counted.
            self.cordons.after_hang(causes or [], self.step_count, self._replicas_left)
        want = self._replicas_left(exclude=lost)
        r = self.rec
        if r.attempts:
            r.attempts[-1].error = error
            r.attempts[-1].ended_by = "node lost" if lost else ("hang" if hang else "failure")
        # A rank lost with its node, or whose process died, leaves its peers' processes
        # good: they re-form in place. After a hang nothing is kept (a rank is stuck).
        self._teardown(leaving=lost if (lost or process_died) and not hang else None)
        self.pace.restart_from = (
            self.clock(),
            "node loss" if lost else ("hang" if hang else "failure"),
        )
        latest = max(self.coordinator.committed, default=None)
        if lost:
            # Losing spot nodes is the normal weather, not a fault of the job: it does not
            # use up failure.max_failures.
            r.node_losses += len(lost)
            self._forget(lost)
            self._event(
                f"lost node(s) {', '.join(n[:12] for n in sorted(lost))} at step "
                f"{self.step_count}; resuming from the latest committed step ({latest}) on "
                f"what is left",
                logging.WARNING,
                track="node_loss",
            )
            return Scheduling(reason="node loss", since=self.clock(), want=want)
        if kind.retryable:  # only transient faults (hangs included) use up max_failures
            r.failures += 1
        self._event(
            f"worker {'hang' if hang else 'failure'} at step {self.step_count}: {error}",
            logging.WARNING,
            track="hang" if hang else "failure",
        )
        decision = self.failure_policy.decide(r.failures, error, kind)
        if isinstance(decision, Fail):
            return self._fail(decision.reason)
        self._event(decision.reason)
        return Scheduling(reason="failure", since=self.clock(), want=want)

    # --- hangs, stragglers and cordons -------------------------------------------------

    def _cordon_decision(self) -> State | None:
        """Cordon stragglers' nodes, and leave the cordoned nodes of the running group at
        the next checkpoint boundary when the restart pays (`cordons.Cordons`)."""
        group = self.group
        assert group is not None
        self.cordons.stragglers(self._replicas_left)
        leave = self.cordons.leave_at(group, self.pace, self.step_count, self._replicas_left())
        return self._leave("cordon", *leave) if leave is not None else None

    def _take_inbox(self) -> None:
        """Notices, in any state: the doomed node is drained at once (nothing new is
        placed there); a notice for the live group's nodes starts its JIT checkpoint."""
        notices, stop = self.inbox.take()
        group = self.group
        live = group.node_ids() if group else None
        jit = self.jit.triage(notices, self.step_count, live, self._drain)
        if stop is not None and not isinstance(self.state, (Running, Leaving, Finishing)):
            if not self.state.terminal:
                self._teardown()
                self.state = Stopped(reason=stop)
            return
        if not jit:
            return
        self.jit.pending.extend(jit)
        leaving_for_balance = isinstance(self.state, Leaving) and self.state.why == "rebalance"
        if (isinstance(self.state, Running) or leaving_for_balance) and group is not None:
            # A re-partition waiting for its checkpoint boundary gives way to the notice.
            if leaving_for_balance:
                self.partitions.update(-1, outcome="dropped for a preemption notice")
            self.state = self._jit(jit, group)
        # Already leaving (a grow, a stop): that checkpoint answers the notice too, and
        # the drained node gets no part of the next group.

    # --- just-in-time checkpoints ---------------------------------------------------

    def _jit(self, notices: list[dict[str, Any]], group: WorkerGroup) -> State:
        """Leave at the step of the just-in-time checkpoint (JitPolicy)."""
        doomed = set(self._doomed_here())
        left = sum(1 for w in group.worker_info() if w["node_id"] not in doomed)
        after = min(group.replicas, left // self.spec.parallel.pipeline_stages)
        at, deadline = self.jit.plan(notices, self.step_count, group.replicas, after)
        return self._leave("preemption", at, "preemption notice", deadline=deadline)

    def _keep_jit_in_time(self, state: Leaving) -> State:
        """A late JIT step moves up to the next step when steps slowed down so much that
        reaching it and saving could miss the deadline (JitPolicy.recheck)."""
        assert self.group is not None
        at = self.jit.recheck(state.step, self.step_count, state.deadline, self.group.replicas)
        if at is None:
            return state
        self.group.request(save_at=at, stop_at=at, reason="preemption notice")
        return replace(state, step=at, deadline=None)

    # --- stage re-partition -----------------------------------------------------------

    def _rebalance_decision(self) -> State | None:
        group = self.group
        if group is None:
            return None
        now = self.clock()
        leave = self.partitions.rebalance(
            now=now,
            step=self.step_count,
            replicas=group.replicas,
            restart_s=self.pace.restart_cost_s(),
            steps_per_s=self.pace.sps.get(group.replicas, 0.0),
            running_s=now - self.pace.group_started,
        )
        return self._leave_for_partition(leave)

    def _asked_partition(self) -> State | None:
        asked = self.inbox.take_repartition()
        if self.group is None:
            return None
        return self._leave_for_partition(self.partitions.asked(asked, self.step_count))

    def _leave_for_partition(self, leave: Leave | None) -> State | None:
        if leave is None:
            return None
        return self._leave("rebalance", leave.step, leave.detail, partition=leave.bounds)
