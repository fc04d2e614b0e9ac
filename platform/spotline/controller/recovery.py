"""Peer-memory recovery, the controller's side: how often the ranks take peer copies
(k), what the copies cost, and which copy a new group restores.

k: fixed by `recovery.peer_interval_steps`, or measured ("auto"): a group's first run
takes one copy at its first steady step; from what it cost (the host copy that blocks
training, plus, on CPU, the serialization and send that share the training cores) and
the median step time, `peer_interval` picks the smallest k whose copies cost at most
`recovery.peer_cost_budget` of training. Later copies refine it; the ranks are asked
for a new k only when it changes.

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
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from spotline.checkpoint.peer import PeerOffer
from spotline.config.schema import JobSpec

MEASURE = -1
"""`peer_every` for a group's run: take one copy at the first steady step, to measure."""


def peer_interval(cost_s: float, step_s: float, budget: float) -> int:
    """The smallest k with cost_s / (k x step_s) <= budget (at least 1)."""
    if step_s <= 0:
        return 1
    return max(1, math.ceil(cost_s / (budget * step_s) - 1e-9))


class PeerBook:
    """k, and the figures of the peer copies the ranks took (see the module)."""

    def __init__(self, spec: JobSpec):
        self.fixed = spec.recovery.fixed_interval()  # None: auto; 0: off
        self.budget = spec.recovery.peer_cost_budget
        self.k: int | None = self.fixed or None
        self._taken: dict[int, list[float]] = defaultdict(list)  # step -> blocked_s per rank
        self._sent: dict[int, list[dict[str, Any]]] = defaultdict(list)
        self.costs: list[float] = []  # per complete copy: blocked + (CPU) background, s
        self.copies = 0  # steps every rank sent to its keepers
        self.skipped = 0  # rank copies not taken: the upload thread was busy with a save
        self.newest: int | None = None
        self.errors: list[str] = []
        self.restores: list[dict[str, Any]] = []

    @property
    def enabled(self) -> bool:
        return self.fixed != 0

    def run_every(self) -> int:
        """`peer_every` for a group's run: k once known, MEASURE before, 0 when off."""
        if not self.enabled:
            return 0
        return self.k if self.k else MEASURE

    def take(
        self, reports: list[dict[str, Any]], world: int, step_seconds: list[float], device: str
    ) -> int | None:
        """Fold a poll's peer reports; the new k to ask the ranks for, or None."""
        for r in reports:
            if "error" in r:
                self.errors.append(f"rank {r.get('rank')}, step {r['step']}: {r['error']}")
                self.errors = self.errors[-5:]
            elif "taken" in r:  # a host copy, or one skipped while a save uploaded
                if r["taken"]:
                    self._taken[r["step"]].append(r["blocked_s"])
                else:
                    self.skipped += 1
            else:
                self._sent[r["step"]].append(r)
        for step in sorted(self._sent):
            sent = self._sent[step]
            if len(sent) < world:
                continue
            blocked = self._taken.pop(step, [0.0])
            del self._sent[step]
            self.copies += 1
            self.newest = step if self.newest is None else max(self.newest, step)
            if any(s.get("with_save") for s in sent):
                continue  # a checkpoint's own files: its cost is the checkpoint's
            background = max(s.get("total_s", 0.0) for s in sent)
            # On a GPU the copy's serialization and send run on host cores training does
            # not use; on CPU they take the same cores, so they count.
            self.costs.append(max(blocked) + (background if device == "cpu" else 0.0))
        if self.fixed is not None or not self.costs or not step_seconds:
            return None
        k = peer_interval(
            statistics.median(self.costs[-5:]),
            statistics.median(step_seconds[-20:]),
            self.budget,
        )
        if k == self.k:
            return None
        self.k = k
        return k

    def summary(self, step_seconds: list[float]) -> dict[str, Any] | None:
        if not self.enabled:
            return None
        cost = statistics.median(self.costs[-5:]) if self.costs else None
        step = statistics.median(step_seconds[-20:]) if step_seconds else None
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
    """The job's state keepers (`spotline.runtime.keeper.PeerMemory`, or None when
    recovery.peer_snapshots is off) and the book of their copies."""

    def __init__(self, spec: JobSpec, peers: Any, event: Callable[..., None]):
        self.spec = spec
        self.peers = peers if spec.recovery.peer_snapshots else None
        self.book = PeerBook(spec)
        self._event = event

    def run_every(self) -> int:
        """`peer_every` for a new group's run (0: no copies)."""
        return self.book.run_every() if self.peers is not None else 0

    def take(self, reports: list[dict[str, Any]], group: Any, step_seconds: list[float]) -> None:
        """Fold a poll's peer reports; ask the ranks for a new k when it changed."""
        if not reports or self.peers is None:
            return
        k = self.book.take(reports, group.world_size, step_seconds, group.device)
        if k is not None:
            group.request(peer_every=k)
            self._event(
                f"peer copies every {k} step(s): each costs {self.book.costs[-1]:.3f}s, "
                f"within {self.spec.recovery.peer_cost_budget:.0%} of training"
            )

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
        came from peer memory (the same line of steps). Never another lineage's. The
        keepers of `leaving` nodes (doomed by a notice) do not count: a step restored
        after a notice is one whose copies reached the nodes that stay."""
        prev = attempts[-1] if attempts else None
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
        sent = self.book.newest
        if sent is not None and sent > latest_commit and (offer is None or offer.step < sent):
            self._event(
                f"peer copy of step {sent} is no longer complete in live nodes' memory (a "
                "rank and its buddy were lost together); restoring "
                + (f"step {offer.step} from peer memory" if offer else "the newest commit"),
                logging.WARNING,
            )
        return offer

    def restored(self, attempt: str, offer: PeerOffer | None, nbytes: int) -> None:
        """A group (`attempt`) started, from `offer` when it restored from peer memory:
        the keepers keep only its copies and that source's."""
        if self.peers is None:
            return
        self.peers.retain([attempt] + ([offer.attempt] if offer else []))
        if offer is not None:
            self.book.restores.append({"step": offer.step, "bytes": nbytes, "from": offer.attempt})

    def summary(self, step_seconds: list[float]) -> dict[str, Any] | None:
        return self.book.summary(step_seconds) if self.peers is not None else None
