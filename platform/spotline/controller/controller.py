"""The job controller: a loop over states over a worker group that trains on its own.

`Controller.step()` runs one iteration: it takes what the inbox holds (notices, a stop)
in whatever state it is, runs the state's handler, which returns the next state, and
publishes a snapshot (other threads read only that, through the `Door`). States carry
their payload (`state.py`); policies decide and the loop carries decisions out with
the parts it holds, all on one clock (`clock.py`): `fleet` (the processes), `sizing`,
`growth`, `intake` (a poll taken in), `departures` (leaving at a checkpoint),
`failures`, and the rooms that keep books (`rooms.py`). The record is its own to write.

The ranks train on their own, saving every checkpoint.interval_steps; the loop polls
what they publish and steers with messages (save at step k, stop at step k). Storage
is touched only through the commit coordinator, never on the training path. A
group's start never blocks the loop (`Starting`): a notice, a loss or a stop during
it is handled at once. The worker group is injected: tests drive a fake one.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

from spotline import constants
from spotline.checkpoint import CheckpointMismatchError, CorruptCheckpointError, StorageError
from spotline.checkpoint.peer import PEER_KEY
from spotline.config.loader import SpecError
from spotline.config.redact import redact
from spotline.config.schema import JobSpec
from spotline.controller.artifacts import trace
from spotline.controller.clock import Clock
from spotline.controller.departures import Departures, Gone
from spotline.controller.door import Door
from spotline.controller.failures import Failures
from spotline.controller.fleet import Fleet
from spotline.controller.growth import Growth
from spotline.controller.intake import Intake
from spotline.controller.policies import Fail, FailurePolicy, Resize, ScalingPolicy, Wait
from spotline.controller.recovery import restored_what
from spotline.controller.rooms import build_rooms
from spotline.controller.sizing import Sizing
from spotline.controller.snapshot import (
    Attempt,
    PlanView,
    Published,
    as_result,
    as_summary,
    take_snapshot,
)
from spotline.controller.state import (
    Failed,
    Finished,
    Finishing,
    Leaving,
    Pending,
    Running,
    Scheduling,
    Starting,
    State,
    Stopped,
    Waiting,
)
from spotline.registry import user_code_error
from spotline.runtime.cluster import ClusterView
from spotline.runtime.demand import Demand
from spotline.runtime.progress import Backfill, Stacks, Standby, WorkerFailure, WorkerGroup

log = logging.getLogger("spotline.controller")

_ENDED = {"grow": "grow", "preemption": "preemption notice", "rebalance": "re-partition"}


class Controller:
    """The loop over states and the transitions between them, over its rooms."""

    def __init__(
        self,
        spec: JobSpec,
        store: Any,
        group_factory: Any,
        cluster: ClusterView,
        clock: Clock | None = None,
        backfill: Backfill | None = None,
        demand: Demand | None = None,
        peers: Any = None,
        standby: Standby | None = None,
        stacks: Stacks | None = None,
    ):
        self.spec, self.cluster, self.demand = spec, cluster, demand
        self.clock = clock = clock or Clock()
        r = build_rooms(spec, store, cluster, clock, demand, peers, backfill)
        self.events, self.inbox, self.rec, self.coordinator = r.events, r.inbox, r.rec, r.coordinator  # fmt: skip
        self.recovery, self.telemetry, self.health, self.jit = r.recovery, r.telemetry, r.health, r.jit  # fmt: skip
        self.partitions, self.artifacts, self.cordons = r.partitions, r.artifacts, r.cordons
        self.bubbles, self.backfill_api, self.backfill = r.bubbles, r.backfill_api, backfill
        self.pace, tel, self.say = r.telemetry.pace, r.telemetry, r.events.say
        say = self.say
        self.events.tracker = lambda kind, text: tel.event(self.step_count, kind, text)
        e = spec.elastic
        self.failure_policy = FailurePolicy(spec.failure.max_failures)
        self.scaling_policy = ScalingPolicy(e.min_replicas, e.max_replicas, spec.replica_counts())
        self.stacks = stacks
        self.fleet = Fleet(spec, group_factory, standby)
        self.sizing = Sizing(spec, self.scaling_policy, cluster, self.fleet, self.cordons, self.inbox, clock)  # fmt: skip
        self.failures = Failures(cluster, self.fleet, self.cordons, self.sizing.replicas_left, clock)  # fmt: skip
        self.growth = Growth(spec, self.scaling_policy, self.pace, cluster, self.fleet, say, clock)
        self.published = Published()
        # What other threads ask (status, notices, stop): never the loop's state.
        self.door = Door(spec, self.published, self.events, self.inbox, self.coordinator, self.fleet, stacks, clock)  # fmt: skip
        self.intake = Intake(
            spec, self.rec, fleet=self.fleet, telemetry=tel, health=self.health,
            coordinator=self.coordinator, recovery=self.recovery, jit=self.jit,
            partitions=self.partitions, artifacts=self.artifacts, backfill=backfill,
            backfill_api=self.backfill_api, bubbles=self.bubbles, stacks=stacks,
            notify=self.door.notify, write_artifacts=self._write_artifacts, event=say, clock=clock,
        )  # fmt: skip
        self.departures = Departures(
            spec, fleet=self.fleet, intake=self.intake, inbox=self.inbox, jit=self.jit,
            coordinator=self.coordinator, partitions=self.partitions, pace=self.pace,
            growth=self.growth, cordons=self.cordons, cluster=cluster, demand=demand,
            replicas_left=self.sizing.replicas_left, event=say, clock=clock,
        )  # fmt: skip
        self.plan_view = PlanView(spec)
        self.state: State = Pending()
        self._publish()

    @property
    def store(self) -> Any:
        return self.coordinator.store

    @property
    def step_count(self) -> int:  # the latest step the live group reported
        return self.intake.step

    @property
    def group(self) -> WorkerGroup | None:
        return self.fleet.group

    # --- the loop -----------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        while not self.state.terminal:
            self.step()
        return as_result(take_snapshot(self, wait_for_plan=True))

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
            # After the step's commits are taken (notices answered, backfill told): it
            # lists their files before keep_last deletes anything older.
            self.coordinator.retain()
        except WorkerFailure as e:
            if e.progress is not None and self.group is not None:
                # What the living ranks published in the failing poll (steps, finished
                # uploads) happened: a commit made from it must keep its steps' losses.
                try:
                    self.intake.take(e.progress, self.clock() - t0)
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
            self.rec.finished_at = self.clock.wall()
            try:
                self._write_artifacts(with_trace=False)  # the group is gone; the last trace stands
                self.cluster.close()
            finally:
                if self.demand is not None:
                    self.demand.withdraw()
                self.coordinator.close()
                self.telemetry.close(self.state.name)  # every end: finished, failed, stopped
        self._publish()
        return self.state

    def _handle(self, state: State) -> State:  # `Running` -> `_running`, ...
        return getattr(self, f"_{type(state).__name__.lower()}")(state)

    def _publish(self) -> None:  # the snapshot other threads read, after each step
        self.published.publish(take_snapshot(self), self._trace, self.state.terminal)

    def _fail(self, reason: str) -> State:
        reason = redact(" ".join(reason.split()))  # one line, and never a secret
        self.rec.error = reason
        self.say(f"FAILED: {reason}", logging.ERROR, track="end")
        self._teardown()
        return Failed(error=reason)

    def _pending(self, state: Pending) -> State:
        self.say(f"job {self.spec.name}: checkpoints at {self.store.uri}")
        # The preflight checked this already; checked again here, before anything is
        # written, because another job may have committed there since.
        self.coordinator.check_owner()
        done = self.coordinator.finished_summary()
        if done is not None:
            # Nothing to train: report the finished job as it ended, from what it stored,
            # starting no worker (and writing nothing over that summary).
            return Finished(reported=done)
        self.artifacts.own()
        self.telemetry.resume(self.coordinator)
        self.cordons.keep()
        self.jit.check_fit()
        return Scheduling(reason="start", since=self.clock())

    # --- scheduling and starting ------------------------------------------------------

    def _scheduling(self, state: Scheduling) -> State:
        self.cluster.watch()
        decision = self.sizing.next_size(state.want)  # cordons in the way of min_replicas lifted
        if isinstance(decision, Wait):
            self.say(
                f"{decision.reason} Waiting up to {self.spec.elastic.wait_for_capacity_s:.0f}s "
                "(elastic.wait_for_capacity_s).",
                logging.WARNING,
            )
            return Waiting(reason=decision.reason, since=self.clock())
        return self._start_group(decision.replicas, state.reason)

    def _waiting(self, state: Waiting) -> State:
        decision = self.sizing.next_size()
        now = self.clock()
        if isinstance(decision, Resize):
            self.rec.waited_s += now - state.since
            self.say(f"capacity is back: {decision.replicas} replica(s) fit")
            return self._start_group(decision.replicas, "capacity")
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
        self.clock.sleep(1.0)
        return state

    def _start_group(self, replicas: int, reason: str) -> State:
        """Begin a group: it starts while the loop goes on (`Starting`)."""
        pp = self.spec.parallel.pipeline_stages
        self.say(
            f"starting {replicas} replica(s) x {pp} stage(s) = {replicas * pp} workers "
            f"(elastic {self.spec.elastic.min_replicas}..{self.spec.elastic.max_replicas})",
            track="start",
        )
        if self.rec.resizes and "to_replicas" not in self.rec.resizes[-1]:
            self.rec.resizes[-1]["to_replicas"] = replicas
        self.pace.starting(self.clock())
        latest, doomed = max(self.coordinator.committed, default=0), set(self.inbox.doomed())
        offer = self.recovery.offer(self.rec.attempts, self.coordinator.partitions, latest, doomed)
        self.telemetry.fig.step_seconds.clear()
        # A group that restores a checkpoint next leaves its weights empty: no rank
        # runs the random init that the load would overwrite. A peer copy alone does not
        # count: should no rank be able to read it, nothing durable is left to load.
        pin = self.partitions.for_start(self.coordinator.recorded_partition)
        group = self.fleet.start(replicas, pin, init=not self.coordinator.has_checkpoint())
        self.rec.attempts.append(Attempt(replicas=replicas, attempt=group.attempt))
        start = Starting(reason=reason, since=self.clock(), offer=offer, reached=self.step_count)
        return self._starting(start, wait_s=0.0)  # a group ready at once trains at once

    def _starting(
        self, state: Starting, wait_s: float = constants.SPOTLINE_POLL_INTERVAL_S
    ) -> State:
        """Move the start on for up to `wait_s`; restore and train once it is ready."""
        group = self.fleet.group
        assert group is not None
        if not group.advance(wait_s):
            return state
        attempt = self.rec.attempts[-1]
        attempt.device, attempt.kept, attempt.ahead = group.device, group.kept, group.ahead
        if group.kept or group.ahead:
            ahead = f" ({group.ahead} of them started ahead)" if group.ahead else ""
            kept = f"{group.kept + group.ahead} of {group.world_size} rank(s)"
            self.say(f"{kept} re-formed in their processes{ahead}")
        info = group.partition()
        if self.rec.attempts[:-1]:  # the group before: what it ran and measured
            self.rec.attempts[-2].partition = dict(self.partitions.current)
        self.partitions.started(info)
        if info.get("bounds"):  # the manifests of this group's commits record them
            self.coordinator.partitions[group.attempt] = list(info["bounds"])
        self.telemetry.peak_flops = group.peak_flops()
        if self.bubbles is not None:
            self.bubbles.reset_ranks()
        if self.backfill is not None:
            self.backfill.attach(group.executors())
        return self._restore(group, attempt, state)

    def _restore(self, group: WorkerGroup, attempt: Attempt, state: Starting) -> State:
        offer = state.offer
        restored, manifest = self.coordinator.restore(group, self.clock.sleep, peer=offer)
        for done in self.coordinator.take_recovered():  # a dead group's, from its receipts
            self.intake.committed(done)
        source = offer if manifest is not None and PEER_KEY in manifest.extra else None
        if manifest is not None:
            attempt.restored(manifest.step, group.restored_bytes, source)
            what = restored_what(manifest, attempt, self.spec.parallel.pipeline_stages, group.replicas)  # fmt: skip
            self.say(f"restored {what}", track="resume")
        # The copies a later restore may read: this group's, and the one it restored
        # from until this group has its own. Another lineage's never mix in.
        self.recovery.restored(group.attempt, source, attempt.restored_bytes)
        if source is not None:
            self.rec.take_losses(source.attempt, source.losses)
        self.intake.step = attempt.start_step = restored
        self.telemetry.start_tracking(manifest.step if manifest is not None else None)
        self.telemetry.ledger.lost(state.reached - restored)  # trained again from here
        if restored >= self.spec.train.steps:
            return Finishing()
        group.run(self.spec.train.steps, self.recovery.run_every())
        self.pace.group_started = self.clock()
        self.growth.new_group()
        self.health.group_started(self.pace.group_started, restored)
        return Running(target=self.spec.train.steps)

    # --- training -------------------------------------------------------------------

    def _running(self, state: Running) -> State:
        progress = self.intake.poll()
        if progress.finished is None:
            return self.departures.due() or state
        stopped = int(progress.finished["stopped_at"])
        if stopped >= self.spec.train.steps:
            return Finishing()
        # Short of the last step, the ranks stopped on their own (a rank's SIGTERM, its
        # notice in this poll): that save is the notice's just-in-time checkpoint.
        return Leaving("preemption", stopped, self.clock())

    # --- leaving a group: preemption, grow, re-partition, cordon, stop -----------------

    def _leaving(self, state: Leaving) -> State:
        out = self.departures.follow(state)
        return self._gone(out) if isinstance(out, Gone) else out

    def _gone(self, gone: Gone) -> State:
        """The group left (`Departures`): record it, end it, and stop or start again."""
        attempt = self.rec.attempts[-1]
        if gone.why == "stop":
            attempt.ended_by = "stop"
            self._teardown()
            self.say(gone.detail, track="end")
            return Stopped(reason=self.inbox.stop_reason or "stop requested")
        attempt.ended_by = _ENDED.get(gone.why, gone.why)
        assert self.group is not None
        before = self.group.replicas
        resize = {"step": self.step_count, "from_replicas": before, "why": gone.why}
        self.rec.resizes.append(resize | {"detail": gone.detail})
        self.say(
            f"restarting at step {self.step_count} from {before} replica(s): {gone.detail}",
            track="restart",
        )
        # The ranks off noticed (and cordoned) nodes go on in their own processes.
        self._teardown(
            leaving=set(self.sizing.doomed_here()) if gone.why == "preemption" else set()
        )
        self.pace.restart_from = (self.clock(), gone.why)
        return Scheduling(reason=gone.why, since=self.clock(), want=gone.want)

    def _finishing(self, state: Finishing) -> State:
        group = self.group
        assert group is not None
        last = self.spec.train.steps
        deadline = self.clock() + constants.SPOTLINE_UPLOAD_FLUSH_TIMEOUT_S
        while last not in self.coordinator.committed and last in self.coordinator.pending_steps():
            if self.clock() > deadline:
                break
            self.intake.poll()
        if self.jit.pending:
            self.departures.answer(last, last in self.coordinator.committed)
        self.rec.heldout_loss = group.heldout_loss()
        self.telemetry.heldout(last, self.rec.heldout_loss)
        if self.backfill is not None:
            self.backfill.finish(self.spec.backfill.finish_timeout_s, self.clock.sleep)
            self.intake.export_counts()
        self._write_artifacts()
        self._teardown()
        if last not in self.coordinator.committed:
            return self._fail(f"the final checkpoint (step {last}) did not commit")
        self.say(
            f"finished {last} steps; held-out loss {self.rec.heldout_loss:.4f}; "
            f"checkpoints: {self.store.step_uri(last)}",
            track="end",
        )
        return Finished()

    # --- failures -------------------------------------------------------------------

    def _on_failure(
        self, error: str, process_died: bool = False, causes: list[BaseException] | None = None
    ) -> State:
        v = self.failures.judge(error, process_died, causes or [], self.step_count)
        r = self.rec
        if r.attempts:
            r.attempts[-1].error = error
            r.attempts[-1].ended_by = "node lost" if v.lost else v.what
        self._teardown(leaving=set(v.leaving) if v.leaving is not None else None)
        self.pace.restart_from = (self.clock(), v.what)
        if v.lost:
            # Losing spot nodes is the normal weather, not a fault of the job: it does not
            # use up failure.max_failures. Their notices and keepers went with them, and
            # the autoscaler is asked at once to replace them.
            r.node_losses += len(v.lost)
            if self.demand is not None:
                self.demand.keep(force=True)
            self.inbox.forget(v.lost)
            self.recovery.forget(set(v.lost))
            latest = max(self.coordinator.committed, default=None)
            self.say(
                f"lost node(s) {', '.join(n[:12] for n in sorted(v.lost))} at step "
                f"{self.step_count}; resuming from the latest committed step ({latest}) on "
                f"what is left",
                logging.WARNING,
                track="node_loss",
            )
            return Scheduling(reason="node loss", since=self.clock(), want=v.want)
        if v.kind.retryable:  # only transient faults (hangs included) use up max_failures
            r.failures += 1
        self.say(
            f"worker {v.what} at step {self.step_count}: {error}", logging.WARNING, track=v.what
        )
        decision = self.failure_policy.decide(r.failures, error, v.kind)
        if isinstance(decision, Fail):
            return self._fail(decision.reason)
        self.say(decision.reason)
        return Scheduling(reason="failure", since=self.clock(), want=v.want)

    # --- notices and stops, in any state ----------------------------------------------

    def _take_inbox(self) -> None:
        notices, stop = self.inbox.take()
        state = self.state
        out = self.departures.take_notices(state, notices)
        if stop is not None and not isinstance(state, (Running, Leaving, Finishing)):
            if not state.terminal:
                self._teardown()
                self.state = Stopped(reason=stop)
        elif isinstance(out, Gone):
            self.rec.attempts[-1].ended_by = "preemption notice"
            self.say(f"{out.detail}: starting the group again without it", logging.WARNING)
            self._teardown()
            self.state = Scheduling(reason="preemption", since=self.clock())
        elif out is not None:
            self.state = out

    # --- the processes ------------------------------------------------------------------

    def _teardown(self, leaving: set[str] | None = None) -> None:
        """End the live group; with `leaving` (recovery.in_place) its good replicas go on
        to the next group, never those on a cordoned or noticed node (`Fleet.end`)."""
        if self.backfill is not None:
            self.backfill.detach()
        if self.group is not None:
            self.coordinator.abandon(self.group.attempt)
        keep_off = set(self.cluster.cordoned) | set(self.inbox.doomed()) if leaving else set()
        hung = partial(self.cordons.after_comms_hung, replicas_without=self.sizing.replicas_left)
        said = self.fleet.end(leaving, keep_off, hung)
        for text in self.fleet.take_failures():
            self.say(text, logging.WARNING)
        if said is not None:
            self.say(said.text, logging.WARNING if said.slow else logging.INFO)

    # --- artifacts ----------------------------------------------------------------------

    def _trace(self) -> dict[str, Any] | None:
        """Chrome-trace JSON of the latest steps of every stage (None for pp=1)."""
        stragglers, part = self.health.view(self.clock())["stragglers"], self.partitions.summary()
        return trace(self.spec.name, self.bubbles, self.backfill, part, stragglers)

    def _write_artifacts(self, with_trace: bool = True) -> None:
        """Keep the trace, summary and ledger beside the checkpoints current."""
        latest = with_trace and self.bubbles is not None and self.bubbles.latest
        summary = lambda: as_summary(take_snapshot(self))  # noqa: E731 - read when written
        ledger = self.telemetry.ledger.to_dict()
        self.artifacts.write(summary, ledger, self._trace if latest else None)
