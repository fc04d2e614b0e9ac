"""Growing onto capacity that came back: the one owner of the grow's state.

While a group trains, every `_GROW_CHECK_S` the job looks at the free capacity: it
keeps replicas started ahead on it (`fleet.Fleet.keep_standby`), and asks
`policies.GrowPolicy` whether a restart at a bigger size pays (the measured rates,
the restart cost, the steps left). A grow that pays waits, training on, while replicas
started ahead get ready, at most SPOTLINE_STANDBY_WAIT_S from when it was first due;
free capacity it does not grow onto is explained once per group and size. What it
remembers between looks (when it last looked, the size it declined, since when a grow
waits) lives here alone and starts afresh with each group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from spotline import constants
from spotline.config.schema import JobSpec
from spotline.controller.clock import Clock
from spotline.controller.fleet import Fleet
from spotline.controller.pace import Pace
from spotline.controller.policies import GrowPolicy, ScalingPolicy, dwelling
from spotline.runtime.cluster import ClusterView

_GROW_CHECK_S = 2.0
"""How often a running job reads the cluster's capacity to see whether growing pays."""


class Growth:
    def __init__(
        self,
        spec: JobSpec,
        scaling: ScalingPolicy,
        pace: Pace,
        cluster: ClusterView,
        fleet: Fleet,
        event: Callable[..., None],
        clock: Clock,
    ):
        self.spec = spec
        self.scaling = scaling
        self.policy = GrowPolicy(scaling)
        self.pace = pace
        self.cluster = cluster
        self.fleet = fleet
        self._event = event
        self.clock = clock
        self.checked = 0.0  # clock: the latest look at capacity
        self.declined: int | None = None  # the size the live group was told does not pay
        self.wanted: float | None = None  # clock: since a grow that pays waits for standby

    def new_group(self) -> None:
        """A new group runs: what was said or awaited of the last one ends."""
        self.declined = None
        self.wanted = None

    def decide(self, step: int, avoid: set[str]) -> int | None:
        """The replicas to grow to now, or None (too soon to look, nothing to grow onto,
        it does not pay, or replicas started ahead are still getting ready)."""
        group = self.fleet.group
        assert group is not None
        pace, now = self.pace, self.clock()
        if group.replicas >= self.spec.elastic.max_replicas or now - self.checked < _GROW_CHECK_S:
            return None
        self.checked = now
        limit = (self.scaling.fit(self.spec.elastic.max_replicas) or 0) - group.replicas
        ahead = self.fleet.keep_standby(self.cluster.capacity(), limit, avoid)
        for text in self.fleet.take_failures():  # the group starts its own processes instead
            self._event(text, logging.WARNING)
        restart_s = pace.restart_cost_s()
        if restart_s is None:
            return None  # no start is measured yet
        capacity = self.cluster.capacity(held_workers=group.world_size + ahead)
        running_s = now - pace.group_started
        decision = self.policy.decide(
            replicas=group.replicas,
            capacity=capacity,
            steps_left=self.spec.train.steps - step,
            steps_per_s=pace.sps.get(group.replicas, 0.0),
            restart_s=restart_s,
            running_s=running_s,
            measured=pace.sps,
        )
        if decision is None:
            self.wanted = None
            self._declined(capacity, restart_s, running_s)
            return None
        # Training on while replicas started ahead get ready, but not for ever: one stuck
        # in its start, or one failing and started again, must not hold the grow back.
        if self.wanted is None:
            self.wanted = now
        if self.fleet.standby_starting():
            if now - self.wanted < constants.SPOTLINE_STANDBY_WAIT_S:
                return None
            self._event(
                f"replica(s) started ahead not ready {now - self.wanted:.0f}s after the "
                "grow was due: growing with processes of its own",
                logging.WARNING,
            )
        self.wanted = None
        return decision.replicas

    def _declined(self, capacity: int, restart_s: float, running_s: float) -> None:
        """Free capacity the job does not grow onto says why, once per group and size, so
        that nobody wonders at an idle node: the measured rates, or the dwell."""
        group = self.fleet.group
        assert group is not None
        target = self.scaling.fit(capacity) or 0
        if target <= group.replicas or target == self.declined:
            return
        if dwelling(running_s, restart_s):
            return  # the decision comes once the group has run long enough
        self.declined = target
        rates = self.pace.sps
        at_target = f"{rates[target]:.2f}" if target in rates else "not measured"
        self._event(
            f"capacity for {target} replica(s) is free, staying at {group.replicas}: growing "
            f"does not pay (measured steps/s: {rates.get(group.replicas, 0.0):.2f} at "
            f"{group.replicas}, {at_target} at {target}; restart cost {restart_s:.1f}s)"
        )
