"""Leaving a group at a checkpoint: preemption notices, grows, re-partitions, cordons
and stops.

`Departures` is the controller's part that asks the live group to save and stop at a
step (`leave`), follows it there (`follow`: a late just-in-time step moves up when
steps slow down; a boundary restart trains on to its step; the step's uploads come
through the polls), and says how the group left (`Gone`: the step it stopped at,
why, what the next group should be). It also takes the inbox's notices in whatever
state the loop is (`take_notices`): a doomed node is drained at once, and a notice
for the live group's nodes becomes a just-in-time checkpoint. The loop records what
it returns and carries it out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from spotline import constants
from spotline.checkpoint.coordinator import CommitCoordinator
from spotline.config.schema import JobSpec
from spotline.controller.clock import Clock
from spotline.controller.cordons import Cordons
from spotline.controller.fleet import Fleet
from spotline.controller.growth import Growth
from spotline.controller.inbox import Inbox
from spotline.controller.intake import Intake
from spotline.controller.notices import JitBook
from spotline.controller.pace import Pace
from spotline.controller.repartition import PartitionBook
from spotline.controller.state import Finishing, Leaving, Running, Starting, State
from spotline.runtime.cluster import ClusterView
from spotline.runtime.demand import Demand
from spotline.runtime.progress import WorkerFailure

AT_BOUNDARY = ("rebalance", "cordon")
"""Restarts that first train on to the next checkpoint boundary."""


@dataclass(frozen=True)
class Gone:
    """The group stopped at `stopped` for `why` (committed or not): a restart toward
    `want` replicas (`detail` says why), or, for a stop, the end."""

    why: str
    stopped: int
    detail: str = ""
    want: int = 0


class Departures:
    def __init__(
        self,
        spec: JobSpec,
        *,
        fleet: Fleet,
        intake: Intake,
        inbox: Inbox,
        jit: JitBook,
        coordinator: CommitCoordinator,
        partitions: PartitionBook,
        pace: Pace,
        growth: Growth,
        cordons: Cordons,
        cluster: ClusterView,
        demand: Demand | None,
        replicas_left: Callable[..., int],
        event: Callable[..., None],
        clock: Clock,
    ):
        self.spec, self.fleet, self.intake, self.inbox, self.jit = spec, fleet, intake, inbox, jit
        self.coordinator, self.partitions, self.pace = coordinator, partitions, pace
        self.growth, self.cordons = growth, cordons
        self.cluster, self.demand, self.replicas_left = cluster, demand, replicas_left
        self._event, self.clock = event, clock

    @property
    def step(self) -> int:
        return self.intake.step

    def due(self) -> Leaving | None:
        """Whether the running group leaves now, and for what: a stop request, a grow
        that pays (`growth.py`), a re-partition asked for or measured to pay
        (`repartition.py`), a cordoned node to leave when the restart pays (`cordons.py`,
        which also cordons stragglers' nodes here)."""
        group, step, now = self.fleet.group, self.step, self.clock()
        assert group is not None
        if self.inbox.stop_reason is not None:
            return self.leave("stop", step + 1, self.inbox.stop_reason)
        grow = self.growth.decide(step, set(self.cluster.cordoned) | set(self.inbox.doomed()))
        if grow is not None:
            return self.leave("grow", step + 1, f"capacity for {grow} replica(s)", grow)
        part = self.partitions.asked(self.inbox.take_repartition(), step) or (
            self.partitions.rebalance(
                now=now,
                step=step,
                replicas=group.replicas,
                restart_s=self.pace.restart_cost_s(),
                steps_per_s=self.pace.sps.get(group.replicas, 0.0),
                running_s=now - self.pace.group_started,
            )
        )
        if part is not None:
            return self.leave("rebalance", part.step, part.detail, partition=part.bounds)
        self.cordons.stragglers(self.replicas_left)
        leave = self.cordons.leave_at(group, self.pace, step, self.replicas_left())
        return self.leave("cordon", *leave) if leave is not None else None

    def leave(
        self,
        why: str,
        step: int,
        detail: str,
        grow_to: int = 0,
        deadline: float | None = None,
        partition: list[int] | tuple[int, ...] | None = None,
    ) -> Leaving:
        """Ask the live group to save and stop at `step` (the last step at most)."""
        group = self.fleet.group
        assert group is not None
        step = min(step, self.spec.train.steps)
        group.request(save_at=step, stop_at=step, reason=detail)
        self._event(f"checkpoint at step {step}, then {why} ({detail})")
        late = deadline if step > self.step + 1 else None
        bounds = tuple(partition) if partition is not None else None
        return Leaving(why, step, self.clock(), grow_to, deadline=late, partition=bounds)

    def follow(self, state: Leaving) -> State | Gone:
        """One poll of a group on its way out: the next state, or how it left."""
        progress = self.intake.poll()
        if progress.finished is None:
            if state.deadline is not None:
                return self._keep_jit_in_time(state)
            if state.why in AT_BOUNDARY and self.step < state.step:
                # Training on toward the checkpoint boundary; a stop request goes first.
                if self.inbox.stop_reason is not None:
                    return self.leave("stop", self.step + 1, self.inbox.stop_reason)
                return replace(state, since=self.clock())
            flush = constants.SPOTLINE_UPLOAD_FLUSH_TIMEOUT_S
            if self.clock() - state.since > flush:
                raise WorkerFailure("stopping", {f"no stop within {flush:.0f}s": [0]})
            return state
        stopped = int(progress.finished["stopped_at"])
        if stopped >= self.spec.train.steps and state.why != "stop":
            return Finishing()  # the group reached the last step first: the end commits
        committed = stopped in self.coordinator.committed
        pending = stopped in self.coordinator.pending_steps()
        if pending and self.clock() - state.since < constants.SPOTLINE_UPLOAD_FLUSH_TIMEOUT_S:
            return state  # its uploads are still running: they come through the polls
        self.answer(stopped, committed)
        if not committed:
            latest = max(self.coordinator.committed, default=None)
            self._event(
                f"checkpoint step {stopped} did not commit; the latest committed step is {latest}",
                logging.WARNING,
            )
        if state.why == "stop":
            latest = max(self.coordinator.committed, default=None)
            reason = self.inbox.stop_reason or "stop requested"
            then = (
                f"latest committed step {latest} at {self.coordinator.store.uri}: submitting "
                "the job again resumes there"
                if latest is not None
                else "no step is committed: submitting the job again starts it afresh"
            )
            return Gone("stop", stopped, f"stopped at step {stopped} ({reason}); {then}")
        group = self.fleet.group
        want = state.grow_to or self.replicas_left()
        if state.why == "grow":
            cost = self.pace.restart_cost_s() or 0
            detail = f"capacity for {state.grow_to} replica(s) (restart cost {cost:.1f}s)"
        elif state.why == "rebalance":
            want = group.replicas if group else want
            detail = self.partitions.restarting(state.partition, stopped)
        elif state.why == "cordon":
            nodes = self.fleet.here(self.cluster.cordoned)
            detail = f"leaving cordoned node(s) {', '.join(n[:12] for n in nodes)}"
        else:
            doomed = self.fleet.here(self.inbox.doomed())
            detail = f"leaving node(s) {', '.join(n[:12] for n in doomed)}"
        return Gone(state.why, stopped, detail, want)

    def _keep_jit_in_time(self, state: Leaving) -> State:
        """A late JIT step moves up to the next step when steps slowed down so much that
        reaching it and saving could miss the deadline (JitPolicy.recheck)."""
        group = self.fleet.group
        assert group is not None and state.deadline is not None
        at = self.jit.recheck(state.step, self.step, state.deadline, group.replicas)
        if at is None:
            return state
        group.request(save_at=at, stop_at=at, reason="preemption notice")
        return replace(state, step=at, deadline=None)

    def answer(self, step: int, committed: bool) -> None:
        """The pending notices, answered by step `step` (committed or not)."""
        latest = max(self.coordinator.committed, default=None)
        self.jit.answer(step, committed, latest, self.clock())

    # --- the inbox's notices --------------------------------------------------------------

    def take_notices(self, state: State, notices: list[dict]) -> State | Gone | None:
        """New notices, in any state: each doomed node is drained at once (nothing new is
        placed there). Those for the live group's nodes become its just-in-time
        checkpoint when it runs (the state to go on in); when it is leaving already, that
        checkpoint answers them. None: nothing changes for the loop."""
        group = self.fleet.group
        live = group.node_ids() if group else None
        jit = self.jit.triage(notices, self.step, live, self._drain)
        if not jit or group is None:
            return None
        self.jit.pending.extend(jit)
        if isinstance(state, Starting):  # it starts again without the doomed node
            self.answer(self.step, committed=False)
            return Gone("preemption", self.step, "a node of the group being started is doomed")
        for_balance = isinstance(state, Leaving) and state.why == "rebalance"
        if not isinstance(state, Running) and not for_balance:
            return None  # already leaving (a grow, a stop); a start goes again (the loop)
        if for_balance:  # a re-partition waiting for its boundary gives way to the notice
            self.partitions.update(-1, outcome="dropped for a preemption notice")
        doomed = set(self.fleet.here(self.inbox.doomed()))
        left = sum(1 for w in group.worker_info() if w["node_id"] not in doomed)
        after = min(group.replicas, left // self.spec.parallel.pipeline_stages)
        at, deadline = self.jit.plan(jit, self.step, group.replicas, after)
        return self.leave("preemption", at, "preemption notice", deadline=deadline)

    def _drain(self, node: str, deadline: float, reason: str) -> None:
        self.cluster.drain(node, deadline, reason)
        if self.demand is not None:
            self.demand.keep(force=True)  # a replacement, launched during the notice
