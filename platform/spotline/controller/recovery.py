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
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any

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
