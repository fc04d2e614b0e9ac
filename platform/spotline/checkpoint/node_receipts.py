"""A node's upload receipts of one step, gathered into one object, so that a commit from
storage reads one object a node, not one a rank (512, not 4,096, at 4,096 ranks of 8 a
node: each read costs the controller a few ms of CPU however small the object).

Every rank still writes its own signed receipt to storage first; it then drops the same
bytes into a folder on its node's staging disk. The node's lowest rank (its leader), once
its own upload is done, waits a bounded time for the others' receipts of that step and
writes them together beside theirs (`uploads.write_node_receipts`). The bundle is only a
shortcut: each receipt in it is the rank's own, signed as the rank signed it, and checked
one by one when read; a rank it lacks (slow, dead, or on a staging disk its leader does
not see) is read from its own receipt. Nothing waits for a bundle to commit, and nothing
here raises: a bundle that cannot be made is simply not made.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

MEMBERS = "members"
POLL_S = 0.05
WAIT_FLOOR_S = 10.0
"""The least a leader waits for its node's receipts; more when its own upload took
longer (the node's ranks upload the same step's shares at the same time)."""


class NodeReceipts:
    """One rank's part in gathering its node's receipts of each step, under `root` (a
    folder of the group's on the node's staging disk, shared by the node's ranks)."""

    def __init__(
        self,
        root: Path,
        rank: int,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.root, self.rank = root, rank
        self._clock, self._sleep = clock, sleep

    def join(self) -> bool:
        """Count this rank among the node's ranks of the group. Every rank joins before
        the group's first step (it joins, then rendezvouses), so a leader gathering a
        save knows every rank of its node."""
        try:
            (self.root / MEMBERS).mkdir(parents=True, exist_ok=True)
            (self.root / MEMBERS / f"rank_{self.rank:05d}").touch()
            return True
        except OSError:
            return False

    def members(self) -> list[int]:
        try:
            names = os.listdir(self.root / MEMBERS)
        except OSError:
            return []
        return sorted(int(n[5:]) for n in names if n.startswith("rank_") and n[5:].isdigit())

    def leads(self) -> bool:
        """This rank is its node's lowest: it gathers and writes the node's receipts."""
        return min(self.members(), default=self.rank) == self.rank

    def drop(self, step: int, body: bytes) -> bool:
        """Leave this rank's receipt of `step` (already in storage) for the leader."""
        folder = self._step(step)
        final = folder / f"rank_{self.rank:05d}.json"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".rank_{self.rank:05d}.tmp"
            tmp.write_bytes(body)
            os.replace(tmp, final)  # the leader reads a whole receipt or none
            return True
        except OSError:
            return False

    def gather(self, step: int, within_s: float, stop: Callable[[], bool]) -> list[bytes]:
        """The node's receipts of `step` that are here once every member's is, or
        `within_s` has passed, or `stop()` says to go on (the rank's next save waits),
        in rank order. The step's folder, and those of earlier steps, are then removed."""
        folder = self._step(step)
        want = [folder / f"rank_{r:05d}.json" for r in self.members()]
        until = self._clock() + max(WAIT_FLOOR_S, within_s)
        while not all(p.exists() for p in want) and self._clock() < until and not stop():
            self._sleep(POLL_S)
        bodies = []
        for p in want:
            try:
                bodies.append(p.read_bytes())
            except OSError:
                continue
        self._forget(step)
        return bodies

    def _step(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def _forget(self, upto: int) -> None:
        """Remove the folders of `upto` and earlier: a receipt dropped after its leader
        gave up on it would otherwise stay until the group ends."""
        try:
            names = os.listdir(self.root)
        except OSError:
            return
        for name in names:
            if name.startswith("step_") and name[5:].isdigit() and int(name[5:]) <= upto:
                shutil.rmtree(self.root / name, ignore_errors=True)
