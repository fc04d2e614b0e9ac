"""Cordons: keeping a bad node out of the job for a while, and letting it back.

A node is cordoned when ranks there hung `failure.cordon_after_hangs` times within
`failure.hang_count_ttl_s`, or straggled past `failure.cordon_straggler_threshold`
(the health book judges both), or once a rank there could not let go of its
communicators (its abort or destroy outran its watchdog), but only when the job could
still run at `elastic.min_replicas` without it. A cordoned node gets no part of a new
group and the autoscaler is asked for a replacement. A cordon lasts `failure.cordon_ttl_s`; before
every placement, when the job could not reach `elastic.min_replicas` without its
cordoned nodes but could with them, the oldest cordons are lifted, with an event,
rather than waiting for capacity that exists. The list (with when each cordon was
made) and the recent hangs per node are kept beside the checkpoints, so that a
resubmitted job keeps the cordons that have not expired.

The list itself lives in the cluster view (`runtime.cluster.CordonList`), which
placement, capacity and demand read; this room is the only one that changes it. A
running group leaves a cordoned node at its next checkpoint boundary when the restart
pays (`policies.restart_pays`). This room never starts, stops or restarts a group:
`leave_at` answers, the controller leaves; it writes only through the commit
coordinator.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from spotline.config.schema import JobSpec
from spotline.controller.clock import Clock
from spotline.controller.health import HangError, HealthBook
from spotline.controller.policies import next_boundary, restart_pays
from spotline.runtime.cluster import CordonList

CORDON_ARTIFACT = "cordon.json"
"""The cordons (node, why, when made) and the recent hangs per node, beside the
checkpoints: a controller that starts again for the same job keeps the same nodes out
until their cordons expire."""

# How often a running job weighs leaving a cordoned node.
CHECK_S = 2.0


def _age(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f}h"
    if seconds >= 60:
        return f"{seconds / 60:.0f}m"
    return f"{seconds:.0f}s"


class Cordons:
    """The job's cordons and hang counts (see the module). `replicas_without(nodes)`
    counts the replicas the cluster holds for the job without `nodes`. `clock` is the
    controller's; `wall` stamps cordons and hangs in seconds since the epoch, which a
    later controller of the job can compare."""

    def __init__(
        self,
        spec: JobSpec,
        health: HealthBook,
        cluster: Any,
        coordinator: Any,
        artifacts: Any,
        demand: Any,
        event: Callable[..., None],
        clock: Clock,
    ):
        self.spec = spec
        self.f = spec.failure
        self.health = health
        self.cluster = cluster
        self.coordinator = coordinator
        self.artifacts = artifacts
        self.demand = demand
        self._event = event
        self.clock = clock  # `clock()`: durations; `clock.wall()`: a cordon's stamp
        self.wall = clock.wall
        self.checked = 0.0
        self.hangs: dict[str, list[float]] = {}  # node -> when its ranks hung (wall)

    @property
    def nodes(self):
        """The cordoned nodes (the cluster view's list, read only here; none without
        a cluster view, as before a job reaches one)."""
        return self.cluster.cordoned if self.cluster is not None else CordonList()

    # --- kept beside the checkpoints ---------------------------------------------------

    def keep(self) -> None:
        """A job started again keeps the cordons its earlier controllers made that have
        not expired, and the hangs that still count."""
        raw = self.coordinator.read_artifact(CORDON_ARTIFACT)
        if raw is None:
            return
        try:
            saved = json.loads(raw)
        except ValueError:
            self._event(f"{CORDON_ARTIFACT} beside the checkpoints is not JSON: ignored")
            return
        now, ttl = self.wall(), self.f.cordon_ttl_s
        for node, c in (saved.get("cordoned") or {}).items():
            # An entry of an older version carries no time: its age is unknown.
            why, at = (c.get("why", ""), float(c.get("at", 0.0))) if isinstance(c, dict) else (c, 0)
            if now - at >= ttl:
                self._event(
                    f"node {node[:12]} was cordoned by an earlier run of this job ({why}); "
                    f"that cordon expired (failure.cordon_ttl_s {_age(ttl)}): not applied"
                )
                continue
            self.nodes.add(node, why, at)
            self._event(
                f"node {node[:12]} stays cordoned ({why}) for {_age(ttl - (now - at))} more "
                "(failure.cordon_ttl_s)"
            )
        for node, times in (saved.get("hangs") or {}).items():
            self.hangs[node] = [float(t) for t in times]
        self._decay(now)
        self._export()

    def _store(self) -> None:
        if not self.artifacts.owned:
            return
        out = {
            "cordoned": {c.node: {"why": c.why, "at": c.at} for c in self.nodes.oldest_first()},
            "hangs": self.hangs,
        }
        self.coordinator.write_artifact(CORDON_ARTIFACT, json.dumps(out).encode())

    def _export(self) -> None:
        self.health.metrics.set("spotline_cordoned_nodes", len(self.nodes))

    # --- hangs count for a while --------------------------------------------------------

    def _decay(self, now: float, add: list[str] = ()) -> None:
        """Forget the hangs older than failure.hang_count_ttl_s; count one now on each
        node of `add`. The mapping is replaced whole: status reads it."""
        ttl = self.f.hang_count_ttl_s
        kept = {n: [t for t in ts if now - t < ttl] for n, ts in self.hangs.items()}
        for node in add:
            kept[node] = [*kept.get(node, []), now]
        self.hangs = {n: ts for n, ts in kept.items() if ts}

    def hangs_on(self) -> dict[str, int]:
        """node -> hangs of its ranks that still count (within failure.hang_count_ttl_s)."""
        now, ttl = self.wall(), self.f.hang_count_ttl_s
        counts = {n: sum(1 for t in ts if now - t < ttl) for n, ts in self.hangs.items()}
        return {n: k for n, k in counts.items() if k}

    def after_hang(
        self, causes: list[BaseException], step: int, replicas_without: Callable[[set[str]], int]
    ) -> None:
        """Count a hang against the nodes of the ranks that held the group up (named by
        the hang watch, or by the heartbeats when a rank's collective timeout fired
        first), and cordon a node that reached failure.cordon_after_hangs within
        failure.hang_count_ttl_s."""
        declared = [c for c in causes if isinstance(c, HangError)]
        stall = self.health.stall
        if not declared and stall is not None:
            # The peers' collective timed out while ranks waited for their batches:
            # storage held the group up, not a node.
            self._event(
                f"the collective timeout fired while rank(s) "
                f"{', '.join(str(b.rank) for b in stall.behind)} waited for data: not "
                "counted against their node(s)"
            )
            return
        nodes = declared[0].nodes if declared else self.health.behind_nodes()
        self.health.record_hang(nodes, step)
        self._decay(self.wall(), add=nodes)
        due = [
            n
            for n in nodes
            if len(self.hangs[n]) >= self.f.cordon_after_hangs and n not in self.nodes
        ]
        if not self.f.cordon or not due:
            self._store()  # the count, for a controller started again
            return
        within = _age(self.f.hang_count_ttl_s)
        for node in due:
            n = len(self.hangs[node])
            self.cordon(node, f"a rank there hung {n} times within {within}", replicas_without)

    def after_comms_hung(
        self, hung: dict[str, str], replicas_without: Callable[[set[str]], int]
    ) -> None:
        """Cordon each node of `hung` (node -> why): a rank there could not let go of
        its communicators (an abort or a destroy outran its watchdog,
        `spotline.train.watch.CommsHung`). Once is enough: a GPU or a network that hangs
        in an abort is not trusted with the next group."""
        for node, why in hung.items():
            if node in self.nodes:
                continue
            if not self.f.cordon:
                self._event(
                    f"node {node[:12]}: {why}; not cordoned (failure.cordon is off): drain "
                    "it if it hangs again",
                    logging.WARNING,
                )
                continue
            self.cordon(node, why, replicas_without)

    # --- cordons ------------------------------------------------------------------------

    def stragglers(self, replicas_without: Callable[[set[str]], int]) -> None:
        """Cordon the node of each rank straggling past the threshold for long enough;
        let cordons that expired go."""
        self.expire()
        for s in self.health.cordon_due(self.clock(), self.nodes):
            why = f"rank {s.rank} there computed {s.slowdown:.0%} slower than its peers"
            self.cordon(s.node, why, replicas_without)

    def cordon(self, node: str, why: str, replicas_without: Callable[[set[str]], int]) -> bool:
        """Keep `node` out of every new group of this job for failure.cordon_ttl_s, when
        the job can still run at elastic.min_replicas without it; True once cordoned."""
        least = self.spec.elastic.min_replicas
        left = replicas_without({node})
        if left < least:
            self.health.refused[node] = self.clock()
            self._event(
                f"node {node[:12]}: {why}; not cordoned, as without it the cluster holds "
                f"{left} replica(s), below elastic.min_replicas ({least})",
                logging.WARNING,
            )
            self._store()
            return False
        self.nodes.add(node, why, self.wall())
        self._export()
        if self.demand is not None:
            self.demand.keep(force=True)  # a replacement for it, now
        self._store()
        self._event(
            f"cordoned node {node[:12]} for {_age(self.f.cordon_ttl_s)} "
            f"(failure.cordon_ttl_s): {why}. No new group is placed there (the list is kept "
            "beside the checkpoints)",
            logging.WARNING,
            track="cordon",
        )
        return True

    def expire(self) -> list[str]:
        """Lift the cordons older than failure.cordon_ttl_s; the nodes let back."""
        now, ttl = self.wall(), self.f.cordon_ttl_s
        gone = [c for c in self.nodes.oldest_first() if now - c.at >= ttl]
        for c in gone:
            self.nodes.lift(c.node)
            self._event(
                f"the cordon on node {c.node[:12]} ({c.why}) expired after {_age(ttl)} "
                "(failure.cordon_ttl_s): new groups may be placed there again"
            )
        if gone:
            self._export()
            self._store()
        return [c.node for c in gone]

    def make_room(self, capacity: Callable[[set[str]], int]) -> list[str]:
        """Before a placement: when the job cannot reach elastic.min_replicas without its
        cordoned nodes but can with some of them, lift the oldest cordons until it can,
        and say so. `capacity(lifted)`: whole replicas the cluster holds with the
        cordons of `lifted` lifted. Returns the nodes let back (none when the cordons
        are not what the job waits on)."""
        least = self.spec.elastic.min_replicas
        if not len(self.nodes) or capacity(set()) >= least:
            return []
        lifted: list[str] = []
        for c in self.nodes.oldest_first():
            lifted.append(c.node)
            if capacity(set(lifted)) >= least:
                break
        else:
            return []  # short even with every cordon lifted: capacity is what it waits on
        now = self.wall()
        for node in lifted:
            c = self.nodes.lift(node)
            assert c is not None
            self._event(
                f"lifted the cordon on node {node[:12]} ({c.why}, made {_age(now - c.at)} "
                f"ago): without it the cluster cannot hold elastic.min_replicas ({least}) "
                "replica(s). The job uses it again; it is cordoned again if it fails again",
                logging.WARNING,
                track="cordon",
            )
        self._export()
        self._store()
        return lifted

    def waiting_note(self) -> str:
        """What a wait for capacity says about the cordoned nodes ('' with none)."""
        if not len(self.nodes):
            return ""
        now, ttl = self.wall(), self.f.cordon_ttl_s
        named = "; ".join(
            f"{c.node[:12]} ({c.why}; expires in {_age(max(0.0, ttl - (now - c.at)))})"
            for c in self.nodes.oldest_first()
        )
        return f" Cordoned node(s) not counted: {named}."

    def view(self) -> dict[str, Any]:
        """For status: node -> why, each cordon's age and time left, the hang counts."""
        now, ttl = self.wall(), self.f.cordon_ttl_s
        cordons = self.nodes.oldest_first()
        return {
            "cordoned": {c.node: c.why for c in cordons},
            "cordons": [
                {
                    "node": c.node,
                    "why": c.why,
                    "age_s": now - c.at,
                    "expires_in_s": max(0.0, ttl - (now - c.at)),
                }
                for c in cordons
            ],
            "hangs_on": self.hangs_on(),
        }

    # --- leaving a cordoned node --------------------------------------------------------

    def leave_at(
        self, group: Any, pace: Any, step: int, replicas_left: int
    ) -> tuple[int, str] | None:
        """The checkpoint boundary at which the running `group` should leave its cordoned
        nodes, with why; None while it has none, or the restart does not pay (the grow
        rule's cost test: the remaining steps at the pace without the straggler save
        more than twice the measured restart)."""
        bad = set(self.nodes) & group.node_ids()
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
