"""Ranks that hang, wait for data or straggle: the signals, judged.

Policies first, as pure functions of what the ranks reported (unit-tested without
Ray): `hang_bound` (how long without a step is a hang), `find_hang` (who holds the
others up, and whether that is a hang or a data stall), `find_stragglers` (a rank
slower than its peers that do the same work) and `StragglerWatch` (when a straggler
is reported and when it is well again). `HealthBook` keeps their inputs between polls
(every rank's latest heartbeat, each rank's compute over a window of steps), publishes
them (status, metrics, events), and keeps the evidence of each hang (the stacks'
summary). Which node is cordoned, and for how long, is `cordons.py`'s business.

A rank in the data phase is waiting on storage, not hung: when only such ranks hold
the group up, that is a data stall, said once, never counted against a node; past
SPOTLINE_DATA_STALL_LIMIT_S the group ends as a data failure that names storage.

A straggler is judged against the ranks of its own pipeline stage on the other
replicas: they run the same layers on the same batch size. A single-replica
pipeline has no such peers; its stages' imbalance is the stage re-partition's
business (`repartition.py`), measured against the partition's prediction there.
This room reads signals and says what they mean; it never stops a group, takes a
stack or writes to storage.
"""

from __future__ import annotations

import bisect
import logging
import statistics
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from spotline import constants
from spotline.config.schema import JobSpec
from spotline.runtime.progress import RankBeat
from spotline.train.health import DATA_PHASE

# Pipeline and collective waits: a rank in one of these is held up by another.
_WAITING = ("(collective)", "(p2p)")
# A straggler is well again once its slowdown stayed below this share of
# failure.straggler_threshold for more than a window.
_CLEAR_SHARE = 0.5
# Stack summaries kept for status and report (the stacks themselves are artifacts).
_STACKS_KEPT = 10


class HangError(RuntimeError):
    """The controller declared a hang (no step for longer than the bound); `nodes`:
    those of the ranks that held the others up."""

    def __init__(self, message: str, nodes: list[str] | None = None):
        super().__init__(message)
        self.nodes = list(nodes or [])


class DataStallError(RuntimeError):
    """Ranks waited for their step's batches past SPOTLINE_DATA_STALL_LIMIT_S: storage
    or the data source, not a hang (no node is blamed)."""


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

    def error(self) -> HangError:
        return HangError(self.message(), self.nodes)

    @property
    def nodes(self) -> list[str]:
        return sorted({b.node for b in self.behind if b.node})


@dataclass(frozen=True)
class DataStall:
    """Only ranks waiting for their step's batches hold the group up: storage or the data
    source is slow; no rank is hung."""

    quiet_s: float
    """Seconds since the group's step last advanced."""
    behind: tuple[RankBeat, ...]
    """The ranks waiting for data."""
    limit_s: float = float("inf")
    """How long a stall may last before the group ends as a data failure."""

    @property
    def waited_s(self) -> float:
        """How long the longest-waiting rank has waited for its batches."""
        return max((b.phase_s for b in self.behind), default=0.0)

    def _named(self) -> str:
        return "; ".join(
            f"rank {b.rank} (stage {b.stage}, replica {b.replica}, node {b.node[:12]}) for "
            f"{b.phase_s:.0f}s in step {b.step}"
            for b in self.behind
        )

    def message(self) -> str:
        """The event, said once per stall."""
        return (
            f"data stall: {self._named()} waiting for its step's batches; its peers wait "
            f"for it. Storage or the data source is slow, no rank is hung: nothing is "
            f"restarted, counted or cordoned. If it lasts {self.limit_s:.0f}s "
            "(SPOTLINE_DATA_STALL_LIMIT_S) the group restarts as a data failure; check the "
            "storage the spec's data section reads"
        )

    def failure(self) -> str:
        return (
            f"data stall: {self._named()} waiting for its step's batches, past "
            f"SPOTLINE_DATA_STALL_LIMIT_S ({self.limit_s:.0f}s): the storage or data source "
            "the spec's data section reads is not answering. Not a hang: no node is "
            "cordoned. The group restarts from the newest committed step; check that "
            "storage, or raise SPOTLINE_DATA_STALL_LIMIT_S if reads this slow are expected"
        )

    def error(self) -> DataStallError:
        return DataStallError(self.failure())

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


def find_hang(quiet_s: float, bound_s: float, beats: list[RankBeat]) -> Hang | DataStall | None:
    """When some rank still runs and no step advanced for longer than the bound: a data
    stall when every rank holding the others up answers and waits for its batches, else
    a hang."""
    if quiet_s <= bound_s or not any(b.running for b in beats):
        return None
    behind = tuple(behind_ranks(beats, bound_s / 2))
    if behind and all(b.phase == DATA_PHASE and b.silent_s < bound_s / 2 for b in behind):
        return DataStall(quiet_s, behind)
    return Hang(quiet_s, bound_s, behind)


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


def rank_slowdowns(per_step: dict[int, float], beats: list[RankBeat]) -> dict[int, Straggler]:
    """Every rank's compute per step (`per_step`, over a full window) against the median
    of its stage's other ranks; a rank with no such peers is left out. Each stage's
    values are sorted once: a rank's peers' median is read off them without it."""
    by_rank = {b.rank: b for b in beats}
    stages: dict[int, list[float]] = {}
    for rank, v in per_step.items():
        if rank in by_rank:
            stages.setdefault(by_rank[rank].stage, []).append(v)
    for values in stages.values():
        values.sort()
    out = {}
    for rank, mine in per_step.items():
        b = by_rank.get(rank)
        if b is None or len(stages[b.stage]) < 2:
            continue
        peers_s = _median_without(stages[b.stage], mine)
        out[rank] = Straggler(rank, b.stage, b.replica, b.node, mine, peers_s)
    return out


def _median_without(values: list[float], v: float) -> float:
    """The median of sorted `values` with one copy of `v` (one of them) left out."""
    i = bisect.bisect_left(values, v)
    n = len(values) - 1

    def at(k: int) -> float:  # the k-th of the values without index i
        return values[k if k < i else k + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def find_stragglers(
    per_step: dict[int, float], beats: list[RankBeat], threshold: float
) -> list[Straggler]:
    """The ranks whose compute per step is more than `threshold` slower than the median
    of their stage's other ranks."""
    return [s for s in rank_slowdowns(per_step, beats).values() if s.slowdown > threshold]


class StragglerWatch:
    """Straggler verdicts with hysteresis, so that a rank hovering around the threshold
    is reported once, not every few seconds: a rank becomes a straggler once its
    slowdown stayed above `threshold` for more than `hold` steps, and is well again once
    it stayed below `clear` for more than `hold` steps. In between nothing changes."""

    def __init__(self, threshold: float, clear: float, hold: int):
        self.threshold, self.clear, self.hold = threshold, clear, hold
        self.flagged: dict[int, Straggler] = {}
        self._since: dict[int, int] = {}  # rank -> first step of its current run across

    def judge(self, measured: dict[int, Straggler], step: int) -> tuple[list[Straggler], list[int]]:
        """`measured`: every rank's slowdown now; returns (newly raised, newly cleared)."""
        raised: list[Straggler] = []
        cleared: list[int] = []
        flagged = dict(self.flagged)
        for rank, s in measured.items():
            was = rank in flagged
            if was:
                flagged[rank] = s  # its latest figures
            crossing = s.slowdown < self.clear if was else s.slowdown > self.threshold
            if not crossing:
                self._since.pop(rank, None)
                continue
            since = self._since.setdefault(rank, step)
            if step - since <= self.hold:
                continue
            del self._since[rank]
            if was:
                del flagged[rank]
                cleared.append(rank)
            else:
                flagged[rank] = s
                raised.append(s)
        self.flagged = flagged  # replaced whole: status reads it
        return raised, cleared


# --- the book ----------------------------------------------------------------------------


@dataclass
class _Window:
    """A rank's compute over its latest steps: (steps, seconds) chunks."""

    chunks: deque = field(default_factory=deque)
    steps: int = 0
    _median: float | None = None  # per_step() until the window changes

    def add(self, steps: int, seconds: float, keep: int) -> None:
        self.chunks.append((steps, seconds))
        self.steps += steps
        while self.chunks and self.steps - self.chunks[0][0] >= keep:
            self.steps -= self.chunks.popleft()[0]
        self._median = None

    def per_step(self) -> float:
        """The median over the window's chunks of their seconds per step: one chunk
        that a pause on the host stretched does not make a straggler. Computed once per
        change (the straggler watch, the metrics and status all read it)."""
        if not self.steps:
            return 0.0
        if self._median is None:
            self._median = statistics.median(s / n for n, s in self.chunks if n)
        return self._median


# A straggler's node that could not be cordoned (the job needed it) is asked about
# again this much later: capacity may have joined.
_RETRY_CORDON_S = 30.0


class HealthBook:
    """Heartbeats, compute windows, stragglers, data stalls, hangs and their stacks."""

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
        self._watch = self._new_watch()
        self.hangs: list[dict[str, Any]] = []
        self.stacks: list[dict[str, Any]] = []
        """Summaries of the stacks taken at hangs, latest last (`_STACKS_KEPT`)."""
        self.stall: DataStall | None = None
        """The data stall going on, as last seen."""
        self._stall_since = 0.0
        self.refused: dict[str, float] = {}  # node -> when the job could not do without it
        self.bound_s: float | None = None
        self._exported = float("-inf")  # when the per-rank gauges were last set

    def _new_watch(self) -> StragglerWatch:
        f = self.f
        return StragglerWatch(
            f.straggler_threshold, f.straggler_threshold * _CLEAR_SHARE, f.straggler_window_steps
        )

    @property
    def stragglers(self) -> dict[int, Straggler]:
        """The ranks reported as stragglers now, with their latest figures."""
        return self._watch.flagged

    # --- a group's life ------------------------------------------------------------

    def group_started(self, now: float, start_step: int) -> None:
        self.beats = []
        self.last_advance = now
        self._step = start_step
        self._first_step = start_step + 1
        self._windows = {}
        self._watch = self._new_watch()
        self.refused = {}
        self.stall = None

    def take(self, ranks: list[RankBeat], step: int, now: float) -> None:
        """A poll's heartbeats and compute; `step` is the group's latest step."""
        if ranks:
            self.beats = ranks
        if step > self._step:
            self._step, self.last_advance = step, now
            if self.stall is not None:
                self._stall_over(now)
        keep = self.f.straggler_window_steps
        for b in ranks:
            if b.compute_steps and step > self._first_step:
                self._windows.setdefault(b.rank, _Window()).add(b.compute_steps, b.compute_s, keep)
        self._judge_stragglers(keep)
        if now - self._exported >= constants.SPOTLINE_RANK_METRICS_S:
            self._exported = now
            self._export()

    def _judge_stragglers(self, keep: int) -> None:
        full = {r: w.per_step() for r, w in self._windows.items() if w.steps >= keep}
        raised, cleared = self._watch.judge(rank_slowdowns(full, self.beats), self._step)
        for s in raised:
            self._event(
                f"{s.message()} over the last {keep} steps", logging.WARNING, track="straggler"
            )
            self.metrics.inc("spotline_stragglers_total")
        for rank in cleared:
            clear = self.f.straggler_threshold * _CLEAR_SHARE
            self._event(
                f"rank {rank} is no longer a straggler (below {clear:.0%} slower than its "
                f"peers for {keep} steps)"
            )

    def hang(
        self, now: float, step_seconds: list[float], save_blocked_s: list[float]
    ) -> Hang | DataStall | None:
        """A hang to end the group for; a data stall only once it lasted past its limit
        (before that it is said once, and the hang clock starts again when it ends)."""
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
        verdict = find_hang(now - self.last_advance, self.bound_s, self.beats)
        if isinstance(verdict, DataStall):
            stall = replace(verdict, limit_s=self._stall_limit())
            if self.stall is None:
                self._stall_since = now - stall.waited_s
                self._event(stall.message(), logging.WARNING, track="data_stall")
            self.stall = stall
            return stall if stall.waited_s >= stall.limit_s else None
        if self.stall is not None:
            # The batches came: the hang clock runs from here, not from the last step.
            self._stall_over(now)
            return None
        return verdict

    def _stall_limit(self) -> float:
        limit = min(constants.SPOTLINE_DATA_STALL_LIMIT_S, 0.9 * self.f.collective_timeout_s)
        return max(limit, self.bound_s or 0.0)

    def _stall_over(self, now: float) -> None:
        assert self.stall is not None
        ranks = ", ".join(str(b.rank) for b in self.stall.behind)
        self._event(
            f"data stall over: rank(s) {ranks} got their batches after "
            f"{now - self._stall_since:.0f}s; training goes on"
        )
        self.stall = None
        self.last_advance = max(self.last_advance, now)

    # --- hangs, their stacks, and cordon candidates -----------------------------------

    def record_hang(self, nodes: list[str], step: int) -> None:
        self.hangs.append({"step": step, "nodes": nodes})
        self.metrics.inc("spotline_hangs_total")

    def took_stacks(self, summary: dict[str, Any]) -> None:
        """Keep the summary of stacks taken at a hang (status and report show it)."""
        self.stacks = [*self.stacks, summary][-_STACKS_KEPT:]  # replaced whole: status

    def behind_nodes(self) -> list[str]:
        """The nodes of the ranks holding the group up, from the latest heartbeats."""
        return sorted({b.node for b in behind_ranks(self.beats, 1.0) if b.node})

    def cordon_due(self, now: float, cordoned) -> list[Straggler]:
        """Stragglers past failure.cordon_straggler_threshold whose node is not in
        `cordoned` (nor refused in the last _RETRY_CORDON_S: capacity may have joined
        since)."""
        if not self.f.cordon:
            return []
        return [
            s
            for s in self.stragglers.values()
            if s.slowdown > self.f.cordon_straggler_threshold
            and s.node not in cordoned
            and now - self.refused.get(s.node, -_RETRY_CORDON_S) >= _RETRY_CORDON_S
        ]

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
        watch, a data stall going on, and the hangs with their stacks."""
        ranks = []
        stragglers = self.stragglers
        for b in self.beats:
            w = self._windows.get(b.rank)
            s = stragglers.get(b.rank)
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
        stall = self.stall
        return {
            "ranks": ranks,
            "quiet_s": max(0.0, now - self.last_advance) if self.beats else None,
            "hang_bound_s": self.bound_s,
            "data_stall": None
            if stall is None
            else {
                "ranks": [b.rank for b in stall.behind],
                "nodes": stall.nodes,
                "waited_s": stall.waited_s,
                "limit_s": stall.limit_s,
            },
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
                for s in stragglers.values()
            ],
            "hangs": list(self.hangs),
            "stacks": list(self.stacks),
        }
