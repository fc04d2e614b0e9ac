"""Peer-memory recovery, the controller's side: how often the ranks take peer copies
(k), what the copies cost the job, and which copy a new group restores.

k: fixed by `recovery.peer_interval_steps`, or measured ("auto"). What a copy costs is
what the job pays for it, read off the group's own pace: the wall time of the steps
from the copy's host copy to the end of its send (serialization, the object store,
the keepers receiving it, on the same host cores as training on CPU), less what those
steps take without a copy (the median of the steps no copy touched). A group's first
steps warm up and are nobody's pace (`SPOTLINE_PEER_WARM_STEPS`): its first run takes
one copy right after them to measure, priced once enough steady steps give the pace;
`peer_interval` then picks the smallest k whose copies cost at most
`recovery.peer_cost_budget` of training.
Later copies refine it; the ranks are asked for a new k, and the event log says it,
only when k moves by more than a quarter.

A step every rank has in all its keepers is settled: the keepers drop older steps
and other groups' copies (`spotline.runtime.keeper`). The copies' measured sizes are
held against each node's budget once per group. A keeper's refusal (over its budget)
is said once per node, and a later loss says the newer copies were not kept.

The step offered for a restore is pinned in the keepers as soon as it is chosen, so
that nothing (the new group's placement, retention) drops it before the restore has
read it; it stands in for the new group's settled step until that group settles one.

The copy restored after a failure is the newest step the failed group left complete
in live keepers (`spotline.checkpoint.peer`), when it is at least as new as the newest
commit; the commit coordinator falls back to the commits when it cannot be read.
`PeerRecovery` is the controller's one door to all of it: it finds the offer, keeps
the book, and keeps in the keepers only the copies a later restore may read.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spotline import constants
from spotline.checkpoint.peer import PeerOffer
from spotline.config.schema import JobSpec

MEASURE = -1
"""`peer_every` for a group's run: take one copy after the warm-up steps, to measure."""


def peer_interval(cost_s: float, step_s: float, budget: float) -> int:
    """The smallest k with cost_s / (k x step_s) <= budget (at least 1)."""
    if step_s <= 0:
        return 1
    return max(1, math.ceil(cost_s / (budget * step_s) - 1e-9))


_K_MOVE = 0.25
"""k changes (and is said) only when the measured one differs by more than this share."""
_STEPS_KEPT = 400
"""Steps of the group's pace the book keeps to read copies' costs from."""
_BASE_STEPS = 5
"""Steady steps no copy touched before a copy is priced against their median."""


@dataclass
class _Copy:
    """One step's peer copies as the ranks reported them."""

    started: float = float("inf")  # wall time the first rank's host copy began
    ended: float = 0.0  # wall time the last rank's send ended
    sent: int = 0
    fully_kept: bool = True  # every rank's copy taken by all its keepers
    with_save: bool = False  # a checkpoint's own files: its cost is the checkpoint's
    blocked: float = 0.0  # the longest host copy
    why: str = ""  # why a keeper did not take a rank's copy (the first said)
    nbytes: dict[int, int] = field(default_factory=dict)


class PeerBook:
    """k, and the figures of the peer copies the ranks took (see the module)."""

    def __init__(self, spec: JobSpec):
        self.fixed = spec.recovery.fixed_interval()  # None: auto; 0: off
        self.budget = spec.recovery.peer_cost_budget
        self.k: int | None = self.fixed or None
        self._copies: dict[int, _Copy] = defaultdict(_Copy)
        self._unpriced: list[_Copy] = []  # complete, waiting for the step after its end
        self._pace: deque[tuple[int, float]] = deque(maxlen=_STEPS_KEPT)  # (step, wall end)
        self._warming = constants.SPOTLINE_PEER_WARM_STEPS  # the group's steps left to warm
        self.costs: list[float] = []  # per complete copy: the job's seconds lost to it
        self.base_step_s: float | None = None
        self.copies = 0  # steps every rank sent to its keepers
        self.skipped = 0  # rank copies not taken: the upload thread was busy with a save
        self.newest: int | None = None
        self.settled: int | None = None  # newest step every rank has in all its keepers
        self.rank_bytes: dict[int, int] = {}  # the newest complete copy's size, per rank
        self.errors: list[str] = []
        self.restores: list[dict[str, Any]] = []
        self.kept: int | None = None  # the group's newest step every keeper took
        self.unkept: tuple[int, str] | None = None  # the group's newest step one did not
        self.refused: list[dict[str, str]] = []  # keepers' refusals, not yet said

    @property
    def enabled(self) -> bool:
        return self.fixed != 0

    def run_every(self) -> int:
        """`peer_every` for a group's run: k once known, MEASURE before, 0 when off."""
        if not self.enabled:
            return 0
        return self.k if self.k else MEASURE

    def new_group(self) -> None:
        """A group starts: its pace and its copies are its own."""
        self._copies.clear()
        self._unpriced.clear()
        self._pace.clear()
        self._warming = constants.SPOTLINE_PEER_WARM_STEPS
        self.settled = None
        self.rank_bytes = {}
        self.kept = None
        self.unkept = None

    def take(
        self, reports: list[dict[str, Any]], world: int, steps: list[tuple] | None = None
    ) -> int | None:
        """Fold a poll's peer reports and the group's steps ((step, loss, seconds, wall
        end), rank 0's); the new k to ask the ranks for, or None."""
        for st in steps or []:
            if self._warming > 0:  # allocation and caches, not the group's pace
                self._warming -= 1
                continue
            self._pace.append((int(st[0]), float(st[3])))
        for r in reports:
            if "error" in r:
                self.errors.append(f"rank {r.get('rank')}, step {r['step']}: {r['error']}")
                self.errors = self.errors[-5:]
                continue
            c = self._copies[r["step"]]
            if "taken" in r:  # a host copy, or one skipped while a save uploaded
                if r["taken"]:
                    c.blocked = max(c.blocked, r["blocked_s"])
                    c.started = min(c.started, r.get("started", c.started))
                else:
                    self.skipped += 1
                continue
            c.sent += 1
            c.ended = max(c.ended, r.get("ended", 0.0))
            c.with_save = c.with_save or bool(r.get("with_save"))
            c.fully_kept = c.fully_kept and r.get("kept_by", 0) >= r.get("keepers", 1)
            c.nbytes[r["rank"]] = r.get("nbytes", 0)
            if r.get("not_kept"):
                c.why = c.why or f"rank {r.get('rank')}: " + "; ".join(r["not_kept"])
            if r.get("refused"):
                self.refused.append(r["refused"])
        for step in sorted(self._copies):
            c = self._copies[step]
            if c.sent < world:
                continue
            del self._copies[step]
            self.copies += 1
            self.newest = step if self.newest is None else max(self.newest, step)
            self.rank_bytes = dict(c.nbytes)
            if c.fully_kept and (self.settled is None or step > self.settled):
                self.settled = step
            if c.fully_kept:
                self.kept = step if self.kept is None else max(self.kept, step)
            elif self.unkept is None or step > self.unkept[0]:
                self.unkept = (step, c.why or "a keeper did not take it")
            if not c.with_save and c.started < c.ended:
                self._unpriced.append(c)
        self._price()
        if self.fixed is not None or not self.costs or not self.base_step_s:
            return None
        k = peer_interval(statistics.median(self.costs[-5:]), self.base_step_s, self.budget)
        if self.k is not None and abs(k - self.k) <= _K_MOVE * self.k:
            return None
        self.k = k
        return k

    def _price(self) -> None:
        """Each complete copy's cost once the group stepped past its end: the wall time
        of the steps it overlapped beyond what steps without a copy take."""
        pace = list(self._pace)
        # (step, wall seconds since the step before, wall end)
        walls = [(s, t - pace[i - 1][1], t) for i, (s, t) in enumerate(pace) if i]
        if not walls:
            return
        touched = {
            s for s, w, t in walls for c in self._unpriced if t > c.started and t - w <= c.ended
        }
        untouched = [w for s, w, _ in walls if s not in touched]
        if len(untouched) >= _BASE_STEPS:
            self.base_step_s = statistics.median(untouched[-50:])
        base, last_end = self.base_step_s, walls[-1][2]
        left = []
        for c in self._unpriced:
            if base is None or last_end <= c.ended:
                left.append(c)  # the step that straddles its end is still running
                continue
            # The steps ending after its host copy began (that one holds the host copy),
            # through the first ending after its send did.
            cost = 0.0
            for _, w, t in walls:
                if t <= c.started:
                    continue
                cost += w - base
                if t > c.ended:
                    break
            # Never below the host copy itself: the rank's own loop surely stood still
            # that long (the rest of the slowdown is read through the steps' noise).
            self.costs.append(max(c.blocked, cost))
        self._unpriced = left

    def summary(self) -> dict[str, Any] | None:
        if not self.enabled:
            return None
        cost = statistics.median(self.costs[-5:]) if self.costs else None
        step = self.base_step_s
        share = cost / (self.k * step) if cost is not None and step and self.k else None
        return {
            "every_steps": self.k,
            "chosen": "fixed" if self.fixed else "measured",
            "cost_s": cost,
            "share_of_training": share,
            "copies": self.copies,
            "skipped": self.skipped,
            "newest_step": self.newest,
            "errors": list(self.errors),
            "restores": list(self.restores),
        }


def restored_what(manifest: Any, attempt: Any, stages: int, replicas: int) -> str:
    """What a group restored (`manifest`, into `snapshot.Attempt` `attempt`), for the
    event log: the step, where it was read from, and the reshard if the shape changed."""
    was = (manifest.topology.get("pipeline_stages"), manifest.topology.get("replicas"))
    how = (
        f", resharded from {was[0]} stage(s) x {was[1]} replica(s) to {stages} x {replicas}"
        if was != (stages, replicas)
        else ""
    )
    if attempt.restored_via == "peer memory":
        return (
            f"step {manifest.step} from peer memory ({attempt.restored_bytes} bytes from live "
            f"nodes' keepers, none from storage{how})"
        )
    return f"committed checkpoint step {manifest.step} (sha256 verified{how})"


class PeerRecovery:
    """The job's state keepers (`spotline.runtime.peers.PeerMemory`, or None when
    recovery.peer_snapshots is off) and the book of their copies."""

    def __init__(self, spec: JobSpec, peers: Any, event: Callable[..., None]):
        self.spec = spec
        self.peers = peers if spec.recovery.peer_snapshots else None
        self.book = PeerBook(spec)
        self._event = event
        self._refitted = False  # the copies' measured sizes held against the budget
        self._refused_said: set[str] = set()  # nodes whose keeper's refusal was said

    def run_every(self) -> int:
        """`peer_every` for a new group's run (0: no copies, or none fit the budget)."""
        if self.peers is None or not self.peers.level.steps:
            return 0
        return self.book.run_every()

    def take(self, reports: list[dict[str, Any]], group: Any, steps: list[tuple]) -> None:
        """Fold a poll's peer reports and steps: settle what every keeper holds, hold
        the copies' measured sizes against the budget once, and ask the ranks for a
        new k when it moved."""
        if self.peers is None or not (reports or steps):
            return
        settled = self.book.settled
        k = self.book.take(reports, group.world_size, steps)
        if self.book.settled is not None and self.book.settled != settled:
            self.peers.settle(group.attempt, self.book.settled)
            if not self._refitted:
                self._refitted = True
                nodes = [w["node_id"] for w in group.worker_info()]
                sizes = [self.book.rank_bytes.get(r, 0) for r in range(len(nodes))]
                self.peers.refit(nodes, sizes)
        self._say_changes()
        if k is not None:
            cost, step = statistics.median(self.book.costs[-5:]), self.book.base_step_s or 0
            self._event(
                f"peer copies every {k} step(s): each costs the job {cost:.3f}s of training "
                f"({cost / step if step else 0:.1f} step(s) of {step:.3f}s), within "
                f"{self.spec.recovery.peer_cost_budget:.0%} (recovery.peer_cost_budget)"
            )
            group.request(peer_every=k)

    def _say_changes(self) -> None:
        for text in self.peers.take_changes():
            self._event(text, logging.INFO if "within" in text else logging.WARNING)
        for r in self.book.refused:  # once per node: the next copies say the same
            if r["node"] in self._refused_said:
                continue
            self._refused_said.add(r["node"])
            self._event(
                f"peer memory: {r['why']}. Until its copies fit, a loss of this group restores "
                "from an older step or from storage; raise recovery.peer_memory (`spotline "
                "plan` shows what a node needs)",
                logging.WARNING,
            )
        self.book.refused = []

    def forget(self, nodes: set[str]) -> None:
        """Lost `nodes`: their keepers and their copies went with them."""
        if self.peers is not None and nodes:
            self.peers.forget(nodes)

    def offer(
        self,
        attempts: list[Any],
        partitions: dict[str, list[int]],
        latest_commit: int,
        leaving: set[str] = frozenset(),
    ) -> PeerOffer | None:
        """The newest step the previous attempt (of `attempts`, `snapshot.Attempt`s) left
        complete in live keepers: its own copies, else the step it started from when that
        came from peer memory (the same line of steps); a group that never ran is passed
        over. Never another lineage's. The keepers of `leaving` nodes (doomed by a
        notice) do not count: a step restored after a notice is one whose copies reached
        the nodes that stay. The step offered is pinned in the keepers at once."""
        # A group lost while it started (it never ran: no device) left no copies of its
        # own, and restored nothing: the line goes on from the group before it.
        ran = [a for a in attempts if a.device] or attempts
        prev = ran[-1] if ran else None
        if self.peers is None or prev is None or not prev.attempt:
            return None
        lineage = [prev] + [a for a in attempts if a.attempt == prev.restored_attempt]
        offer = None
        for a, at in zip(lineage, [None, prev.restored_from], strict=False):
            world = a.replicas * self.spec.parallel.pipeline_stages
            try:
                found = self.peers.offer(a.attempt, world, partitions.get(a.attempt), at, leaving)
            except Exception as e:  # noqa: BLE001 - the commits are still there
                self._event(
                    f"could not ask the state keepers for peer copies ({e})", logging.WARNING
                )
                return None
            if found is not None and (offer is None or found.step > offer.step):
                offer = found
        self._say_missing(offer, latest_commit)
        if offer is not None:  # pinned: no placement or retention drops it before it is read
            try:
                self.peers.hold(offer.attempt, offer.step)
            except Exception as e:  # noqa: BLE001 - the restore falls back to the commits
                self._event(f"could not pin peer copy of step {offer.step} ({e})", logging.WARNING)
        return offer

    def _say_missing(self, offer: PeerOffer | None, latest_commit: int) -> None:
        """Say why a newer step than the one restored is not in peer memory: a step every
        keeper took is gone (a rank and its buddy lost together), or the keepers never
        kept the newer copies (and what they said)."""
        have = max(latest_commit, offer.step if offer is not None else latest_commit)
        then = f"step {offer.step} from peer memory" if offer else "the newest commit"
        book = self.book
        if book.kept is not None and book.kept > have:
            self._event(
                f"peer copy of step {book.kept} is no longer complete in live nodes' memory (a "
                f"rank and its buddy were lost together); restoring {then}",
                logging.WARNING,
            )
        elif book.unkept is not None and book.unkept[0] > have:
            step, why = book.unkept
            self._event(
                f"no peer copy newer than {then.removesuffix(' from peer memory')} was kept: "
                f"the keepers did not take step {step} ({why}); restoring {then}. Raise "
                "recovery.peer_memory if a keeper refused it",
                logging.WARNING,
            )

    def restored(self, attempt: str, offer: PeerOffer | None, nbytes: int) -> None:
        """A group (`attempt`) started, from `offer` when it restored from peer memory:
        the keepers keep only its copies and that source's pinned step, which goes once
        this group settles a step of its own (or its room is needed for this group's
        copies); restored from storage, the source goes now."""
        if self.peers is None:
            return
        self.book.new_group()
        self._refitted = False
        self._say_changes()  # what the group's placement said of the budget
        self.peers.retain([attempt] + ([offer.attempt] if offer else []))
        if offer is not None:
            self.book.restores.append({"step": offer.step, "bytes": nbytes, "from": offer.attempt})

    def summary(self) -> dict[str, Any] | None:
        if self.peers is None:
            return None
        out = self.book.summary()
        if out is not None:
            out["level"] = self.peers.level.describe()
            out["nodes"] = list(self.peers.fits)
        return out
