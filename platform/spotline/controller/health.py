"""Ranks that hang or straggle, and nodes kept out of new groups.

Policies first, as pure functions of what the ranks reported (unit-tested without
Ray): `hang_bound` (how long without a step is a hang), `find_hang` (and who holds
the others up), `find_stragglers` (a rank slower than its peers that do the same
work). `HealthBook` keeps their inputs between polls (every rank's latest heartbeat,
each rank's compute over a window of steps, the hang count per node, the cordon
list), publishes them (status, metrics, events), and says which node should be
cordoned; the controller decides whether the job can afford it and acts.

A straggler is judged against the ranks of its own pipeline stage on the other
replicas: they run the same layers on the same batch size. A single-replica
pipeline has no such peers; its stages' imbalance is the stage re-partition's
business (`repartition.py`), measured against the partition's prediction there.
"""

from __future__ import annotations

import json
import logging
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from spotline import constants
from spotline.config.schema import JobSpec
from spotline.runtime.progress import RankBeat

CORDON_ARTIFACT = "cordon.json"
"""The cordon list and the hang count per node, beside the checkpoints: a controller
that starts again for the same job keeps the same nodes out."""

# A straggler's node that could not be cordoned (the job needed it) is asked about
# again this much later: capacity may have joined.
_RETRY_CORDON_S = 30.0
# Pipeline and collective waits: a rank in one of these is held up by another.
_WAITING = ("(collective)", "(p2p)")


class HangError(RuntimeError):
    """The controller declared a hang (no step for longer than the bound); `nodes`:
    those of the ranks that held the others up."""

    def __init__(self, message: str, nodes: list[str] | None = None):
        super().__init__(message)
        self.nodes = list(nodes or [])


# Words of torch.distributed's own timeout errors (gloo, NCCL's watchdog, the store):
# the backstop fired, which is a hang on that rank.
_COLLECTIVE_TIMEOUT_MARKERS = (
    "timed out waiting",
    "collective operation timeout",
    "before timing out",
    "diststoreerror",
    "wait timeout",
)


def is_collective_timeout(text: str) -> bool:
    blob = text.lower()
    return any(m in blob for m in _COLLECTIVE_TIMEOUT_MARKERS)


# --- policies ----------------------------------------------------------------------------


def hang_bound(
    step_seconds: list[float],
    save_blocked_s: list[float],
    factor: float,
    floor_s: float,
    first_step_s: float,
) -> float:
    """Seconds without a step advance after which a running group is hung: factor x the
    median of the latest steps plus the longest recent save's blocked time (a save
    holds the step), never below `floor_s`. Before the group measured a step (its
    first step allocates, compiles, warms caches): `first_step_s`."""
    if not step_seconds:
        return max(floor_s, first_step_s)
    median = statistics.median(step_seconds[-50:])
    save = max(save_blocked_s[-10:], default=0.0)
    return max(floor_s, factor * median + save)


@dataclass(frozen=True)
class Hang:
    quiet_s: float
    """Seconds since the group's step last advanced."""
    bound_s: float
    behind: tuple[RankBeat, ...]
    """The ranks holding the others up."""

    def message(self) -> str:
        named = "; ".join(_describe_rank(b) for b in self.behind)
        return (
            f"hang: no step for {self.quiet_s:.1f}s (bound {self.bound_s:.1f}s): {named}. "
            "The group is torn down without waiting for the collective timeout and "
            "restarts from the newest committed step"
        )

    @property
    def nodes(self) -> list[str]:
        return sorted({b.node for b in self.behind if b.node})


def _describe_rank(b: RankBeat) -> str:
    where = f"rank {b.rank} (stage {b.stage}, replica {b.replica}, node {b.node[:12]})"
    last = f"'{b.phase}' of step {b.step}"
    if b.silent_s >= 1.0:
        return f"{where} has not answered for {b.silent_s:.1f}s; last seen in {last}"
    return f"{where} in {last} for {b.phase_s:.1f}s"


def behind_ranks(beats: list[RankBeat], silent_after_s: float) -> list[RankBeat]:
    """Who holds a stuck group up: the running ranks that stopped answering (their
    process is frozen); else those at the lowest step that are not waiting on a peer
    (in a collective or a pipeline transfer); else every rank at the lowest step."""
    running = [b for b in beats if b.running]
    if not running:
        return []
    silent = [b for b in running if b.silent_s >= silent_after_s]
    if silent:
        return silent
    low = min(b.step for b in running)
    lowest = [b for b in running if b.step == low]
    working = [b for b in lowest if not any(w in b.phase for w in _WAITING)]
    return working or lowest


def find_hang(quiet_s: float, bound_s: float, beats: list[RankBeat]) -> Hang | None:
    """A hang when some rank still runs and no step advanced for longer than the bound."""
    if quiet_s <= bound_s or not any(b.running for b in beats):
        return None
    return Hang(quiet_s, bound_s, tuple(behind_ranks(beats, bound_s / 2)))


@dataclass(frozen=True)
class Straggler:
    rank: int
    stage: int
    replica: int
    node: str
    compute_s: float
    """Its own compute per step over the window."""
    peers_s: float
    """The median of its peers' (the same stage on the other replicas)."""

    @property
    def slowdown(self) -> float:
        return self.compute_s / self.peers_s - 1.0 if self.peers_s > 0 else 0.0

    def message(self) -> str:
        return (
            f"straggler: rank {self.rank} (stage {self.stage}, replica {self.replica}) on node "
            f"{self.node[:12]} computes {self.slowdown:.0%} slower than its peers "
            f"({self.compute_s * 1e3:.1f} ms against {self.peers_s * 1e3:.1f} ms per step)"
        )


def find_stragglers(
    per_step: dict[int, float], beats: list[RankBeat], threshold: float
) -> list[Straggler]:
    """The ranks whose compute per step (`per_step`, over a full window) is more than
    `threshold` slower than the median of their stage's other ranks."""
    by_rank = {b.rank: b for b in beats}
    out = []
    for rank, mine in per_step.items():
        b = by_rank.get(rank)
        if b is None:
            continue
        peers = [
            v
            for r, v in per_step.items()
            if r != rank and r in by_rank and by_rank[r].stage == b.stage
        ]
        if not peers:
            continue
        s = Straggler(rank, b.stage, b.replica, b.node, mine, statistics.median(peers))
        if s.slowdown > threshold:
            out.append(s)
    return out


# --- the book ----------------------------------------------------------------------------


@dataclass
class _Window:
    """A rank's compute over its latest steps: (steps, seconds) chunks."""

    chunks: deque = field(default_factory=deque)
    steps: int = 0

    def add(self, steps: int, seconds: float, keep: int) -> None:
        self.chunks.append((steps, seconds))
        self.steps += steps
        while self.chunks and self.steps - self.chunks[0][0] >= keep:
            self.steps -= self.chunks.popleft()[0]

    def per_step(self) -> float:
        """The median over the window's chunks of their seconds per step: one chunk
        that a pause on the host stretched does not make a straggler."""
        if not self.steps:
            return 0.0
        return statistics.median(s / n for n, s in self.chunks if n)


class HealthBook:
    """Heartbeats, compute windows, stragglers, hang counts and the cordon list."""

    def __init__(self, spec: JobSpec, event, metrics):
        self.spec = spec
        self.f = spec.failure
        self._event = event
        self.metrics = metrics
        self.beats: list[RankBeat] = []
        self.last_advance = 0.0
        self._step = -1
        self._first_step = 0  # a group's first step warms up: not its pace
        self._windows: dict[int, _Window] = {}
        self.stragglers: dict[int, Straggler] = {}
        self.hangs: list[dict[str, Any]] = []
        self.hangs_on: dict[str, int] = {}  # node -> hangs of a rank there
        self.cordoned: dict[str, str] = {}  # node -> why
        self.refused: dict[str, float] = {}  # node -> when the job could not do without it
        self.bound_s: float | None = None

    # --- a group's life ------------------------------------------------------------

    def group_started(self, now: float, start_step: int) -> None:
        self.beats = []
        self.last_advance = now
        self._step = start_step
        self._first_step = start_step + 1
        self._windows = {}
        self.stragglers = {}
        self.refused = {}

    def take(self, ranks: list[RankBeat], step: int, now: float) -> None:
        """A poll's heartbeats and compute; `step` is the group's latest step."""
        if ranks:
            self.beats = ranks
        if step > self._step:
            self._step, self.last_advance = step, now
        keep = self.f.straggler_window_steps
        for b in ranks:
            if b.compute_steps and step > self._first_step:
                self._windows.setdefault(b.rank, _Window()).add(b.compute_steps, b.compute_s, keep)
        self._judge_stragglers(keep)
        self._export()

    def _judge_stragglers(self, keep: int) -> None:
        full = {r: w.per_step() for r, w in self._windows.items() if w.steps >= keep}
        now = {s.rank: s for s in find_stragglers(full, self.beats, self.f.straggler_threshold)}
        for rank, s in now.items():
            if rank not in self.stragglers:
                self._event(
                    f"{s.message()} over the last {keep} steps", logging.WARNING, track="straggler"
                )
                self.metrics.inc("spotline_stragglers_total")
        for rank in set(self.stragglers) - set(now):
            self._event(f"rank {rank} is no longer a straggler")
        self.stragglers = now

    def hang(
        self, now: float, step_seconds: list[float], save_blocked_s: list[float]
    ) -> Hang | None:
        if not self.beats:
            return None
        started = self._step >= self._first_step
        self.bound_s = hang_bound(
            step_seconds if started else [],
            save_blocked_s,
            self.f.hang_factor,
            constants.SPOTLINE_HANG_FLOOR_S,
            constants.SPOTLINE_WORKER_START_TIMEOUT_S,
        )
        return find_hang(now - self.last_advance, self.bound_s, self.beats)

    # --- hangs and cordons ---------------------------------------------------------

    def hung(self, nodes: list[str], step: int) -> list[str]:
        """Count a hang on `nodes`; the nodes that reached failure.cordon_after_hangs."""
        self.hangs.append({"step": step, "nodes": nodes})
        self.metrics.inc("spotline_hangs_total")
        due = []
        for node in nodes:
            self.hangs_on[node] = self.hangs_on.get(node, 0) + 1
            if self.hangs_on[node] >= self.f.cordon_after_hangs and node not in self.cordoned:
                due.append(node)
        return due if self.f.cordon else []

    def behind_nodes(self) -> list[str]:
        """The nodes of the ranks holding the group up, from the latest heartbeats."""
        return sorted({b.node for b in behind_ranks(self.beats, 1.0) if b.node})

    def cordon_due(self, now: float) -> list[Straggler]:
        """Stragglers past failure.cordon_straggler_threshold whose node is not cordoned
        (nor refused in the last _RETRY_CORDON_S: capacity may have joined since)."""
        if not self.f.cordon:
            return []
        return [
            s
            for s in self.stragglers.values()
            if s.slowdown > self.f.cordon_straggler_threshold
            and s.node not in self.cordoned
            and now - self.refused.get(s.node, -_RETRY_CORDON_S) >= _RETRY_CORDON_S
        ]

    def cordon(self, node: str, why: str) -> None:
        self.cordoned = {**self.cordoned, node: why}  # replaced whole: status reads it
        self.metrics.set("spotline_cordoned_nodes", len(self.cordoned))

    def to_json(self) -> bytes:
        return json.dumps({"cordoned": self.cordoned, "hangs_on": self.hangs_on}).encode()

    def load(self, raw: bytes | None) -> None:
        if raw is None:
            return
        saved = json.loads(raw)
        self.cordoned = {str(k): str(v) for k, v in saved.get("cordoned", {}).items()}
        self.hangs_on = {str(k): int(v) for k, v in saved.get("hangs_on", {}).items()}
        self.metrics.set("spotline_cordoned_nodes", len(self.cordoned))

    # --- what the user sees --------------------------------------------------------

    def _export(self) -> None:
        m = self.metrics
        for b in self.beats:
            tags = {"stage": b.stage, "replica": b.replica}
            m.set("spotline_heartbeat_age_seconds", b.silent_s, **tags)
            w = self._windows.get(b.rank)
            if w is not None and w.steps:
                m.set("spotline_rank_compute_seconds", w.per_step(), **tags)
            s = self.stragglers.get(b.rank)
            m.set("spotline_rank_slowdown", s.slowdown if s else 0.0, **tags)

    def view(self, now: float) -> dict[str, Any]:
        """For status: every rank's heartbeat and compute, the stragglers, the hang
        watch, and the cordoned nodes."""
        ranks = []
        for b in self.beats:
            w = self._windows.get(b.rank)
            s = self.stragglers.get(b.rank)
            ranks.append(
                {
                    "rank": b.rank,
                    "stage": b.stage,
                    "replica": b.replica,
                    "node": b.node,
                    "step": b.step,
                    "phase": b.phase,
                    "phase_s": b.phase_s,
                    "heartbeat_age_s": b.silent_s,
                    "running": b.running,
                    "compute_s": w.per_step() if w is not None and w.steps else None,
                    "slowdown": s.slowdown if s else None,
                }
            )
        return {
            "ranks": ranks,
            "quiet_s": max(0.0, now - self.last_advance) if self.beats else None,
            "hang_bound_s": self.bound_s,
            "stragglers": [
                {
                    "rank": s.rank,
                    "stage": s.stage,
                    "replica": s.replica,
                    "node": s.node,
                    "slowdown": s.slowdown,
                    "compute_s": s.compute_s,
                    "peers_s": s.peers_s,
                }
                for s in self.stragglers.values()
            ],
            "hangs": list(self.hangs),
            "cordoned": dict(self.cordoned),
        }
