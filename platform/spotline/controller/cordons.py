"""Cordons: keeping a bad node out of the job, and leaving it when that pays.

A node is cordoned when a rank there hung `failure.cordon_after_hangs` times, or
straggled past `failure.cordon_straggler_threshold` (the health book judges both),
but only when the job could still run at `elastic.min_replicas` without it. A
cordoned node gets no part of a new group, the autoscaler is asked for a replacement,
and the list is kept beside the checkpoints so that a resubmitted job keeps it. A
running group leaves a cordoned node at its next checkpoint boundary when the restart
pays (`policies.restart_pays`). This room decides and carries out cordons; it never
starts, stops or restarts a group: `leave_at` answers, the controller leaves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from spotline.config.schema import JobSpec
from spotline.controller.health import CORDON_ARTIFACT, HangError, HealthBook
from spotline.controller.policies import next_boundary, restart_pays

# How often a running job weighs leaving a cordoned node.
CHECK_S = 2.0


class Cordons:
    """The job's cordons (see the module). `replicas_without(nodes)` counts the replicas
    the cluster holds for the job without `nodes`."""

    def __init__(
        self,
        spec: JobSpec,
        health: HealthBook,
        cluster: Any,
        coordinator: Any,
        artifacts: Any,
        demand: Any,
        event: Callable[..., None],
        clock: Callable[[], float],
    ):
        self.spec = spec
        self.health = health
        self.cluster = cluster
        self.coordinator = coordinator
        self.artifacts = artifacts
        self.demand = demand
        self._event = event
        self.clock = clock
        self.checked = 0.0

    def keep(self) -> None:
        """A job started again keeps the nodes its earlier controllers cordoned out."""
        self.health.load(self.coordinator.read_artifact(CORDON_ARTIFACT))
        for node, why in self.health.cordoned.items():
            self.cluster.cordon(node)
            self._event(f"node {node[:12]} stays cordoned ({why})")

    def after_hang(
        self, causes: list[BaseException], step: int, replicas_without: Callable[[set[str]], int]
    ) -> None:
        """Count a hang against the nodes of the ranks that held the group up (named by
        the hang watch, or by the heartbeats when a rank's collective timeout fired
        first), and cordon a node that reached failure.cordon_after_hangs."""
        declared = [c for c in causes if isinstance(c, HangError)]
        nodes = declared[0].nodes if declared else self.health.behind_nodes()
        for node in self.health.hung(nodes, step):
            n = self.health.hangs_on[node]
            self.cordon(node, f"a rank there hung {n} times", replicas_without)

    def stragglers(self, replicas_without: Callable[[set[str]], int]) -> None:
        """Cordon the node of each rank straggling past the threshold for long enough."""
        for s in self.health.cordon_due(self.clock()):
            why = f"rank {s.rank} there computed {s.slowdown:.0%} slower than its peers"
            self.cordon(s.node, why, replicas_without)

    def cordon(self, node: str, why: str, replicas_without: Callable[[set[str]], int]) -> bool:
        """Keep `node` out of every new group of this job, when the job can still run at
        elastic.min_replicas without it; True once cordoned."""
        least = self.spec.elastic.min_replicas
        left = replicas_without({node})
        if left < least:
            self.health.refused[node] = self.clock()
            self._event(
                f"node {node[:12]}: {why}; not cordoned, as without it the cluster holds "
                f"{left} replica(s), below elastic.min_replicas ({least})",
                logging.WARNING,
            )
            return False
        self.health.cordon(node, why)
        self.cluster.cordon(node)
        if self.demand is not None:
            self.demand.keep(force=True)  # a replacement for it, now
        if self.artifacts.owned:
            self.coordinator.write_artifact(CORDON_ARTIFACT, self.health.to_json())
        self._event(
            f"cordoned node {node[:12]} for the rest of the job: {why}. No new group is "
            "placed there (the list is kept beside the checkpoints)",
            logging.WARNING,
            track="cordon",
        )
        return True

    def leave_at(
        self, group: Any, pace: Any, step: int, replicas_left: int
    ) -> tuple[int, str] | None:
        """The checkpoint boundary at which the running `group` should leave its cordoned
        nodes, with why; None while it has none, or the restart does not pay (the grow
        rule's cost test: the remaining steps at the pace without the straggler save
        more than twice the measured restart)."""
        bad = set(self.health.cordoned) & group.node_ids()
        now = self.clock()
        if not bad or now - self.checked < CHECK_S:
            return None
        self.checked = now
        restart_s = pace.restart_cost_s()
        if restart_s is None or replicas_left < self.spec.elastic.min_replicas:
            return None
        slowest = max(
            (s.slowdown for s in self.health.stragglers.values() if s.node in bad), default=0.0
        )
        sps = pace.sps.get(group.replicas, 0.0)
        faster = sps * (1.0 + slowest) * replicas_left / group.replicas
        steps_left = self.spec.train.steps - step
        if not restart_pays(steps_left, sps, faster, restart_s, now - pace.group_started):
            return None
        interval = self.spec.checkpoint.interval_steps
        boundary = next_boundary(step, interval, sps, self.spec.train.steps)
        return (
            boundary,
            f"restart without cordoned node(s) {', '.join(n[:12] for n in sorted(bad))}",
        )
