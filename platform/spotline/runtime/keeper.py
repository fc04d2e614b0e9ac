"""State keepers: training-state snapshots in the host memory of live nodes.

One `StateKeeper` actor per node the job runs on (no CPU of its own, pinned to its
node, owned by the controller, so it outlives every worker group). Each rank sends
its peer copy of a step (`spotline.checkpoint.peer`: the bytes its checkpoint holds)
to its own node's keeper and to its buddy: the keeper of the next node in the ring of
the group's nodes. A node lost takes its keeper with it, and its ranks' copies live
on in their buddies'. Who places the keepers, sends to them and reads from them is
`spotline.runtime.peers`.

Memory has a budget (recovery.peer_memory, `spotline.planning.peer_memory`):
- a keeper holds, per rank, the newest step the controller said is complete in every
  keeper (`settle`) and the one arriving: two steps, or one when the budget is short;
  a settled step of a new group drops every older group's copies;
- the copies live in anonymous memory maps, outside the Python heap, so the keeper's
  resident memory is its data and a dropped copy goes back to the OS at once;
- it refuses a copy that would take it over its budget (`KeeperFull`);
- it answers on several threads, so a question about what it holds never waits
  behind a large copy arriving.

This module is what a keeper's process imports: it loads neither torch nor the
planner, so a keeper's resident memory and start-up CPU are its copies' and little
else (the node's training ranks pay for neither).
"""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass, field
from typing import Any

from spotline.checkpoint.peer import PeerCopy
from spotline.units import human_bytes


def keeper_name(job: str, node_id: str) -> str:
    return f"spotline:{job}:keeper:{node_id}"


class KeeperFull(RuntimeError):
    """A copy that would take a keeper over its budget (recovery.peer_memory)."""


@dataclass
class _Held:
    """One rank's copy of one step: its description and its bytes, in one memory map."""

    copy: PeerCopy
    region: mmap.mmap | None = None
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)
    """path -> (offset, length) in the region."""
    ready: bool = False
    """Its bytes are all in: a placeholder holds the room while they arrive."""

    def close(self) -> None:
        if self.region is not None:
            self.region.close()


class StateKeeper:
    """Peer copies of ranks' snapshots, in this process's memory (see the module)."""

    def __init__(self, budget: int | None = None, steps: int = 2) -> None:
        self._lock = threading.Lock()
        self._copies: dict[tuple[str, int, int], _Held] = {}
        self._settled: dict[str, int] = {}  # attempt -> newest step complete everywhere
        self.budget = budget
        self.steps = steps
        self._peak = 0  # the most held at once, the room of a copy arriving included

    def configure(self, steps: int, budget: int | None) -> int:
        """A new level (`steps` per rank) and budget; drops what no longer fits.
        Returns the bytes held."""
        with self._lock:
            self.steps, self.budget = steps, budget
            for key in {(a, r) for a, r, _ in self._copies}:
                self._prune(*key, arriving=None)
            return self._nbytes()

    def put(self, copy: dict[str, Any], blobs: dict[str, Any]) -> int:
        """Keep a rank's copy of a step (`blobs`: each file's bytes, any buffer). What
        it replaces goes first, so a keeper never holds more than its level allows.
        Returns the bytes this keeper holds; raises KeeperFull over the budget."""
        c = PeerCopy.from_dict(copy)
        if set(blobs) != {f.path for f in c.files}:
            raise ValueError(f"rank {c.rank}'s copy of step {c.step} names other files")
        sizes = {p: memoryview(b).nbytes for p, b in blobs.items()}
        size = sum(sizes.values())
        with self._lock:
            self._prune(c.attempt, c.rank, arriving=c.step)
            held = self._nbytes()
            if self.budget is not None and held + size > self.budget:
                raise KeeperFull(
                    f"rank {c.rank}'s copy of step {c.step} ({human_bytes(size)}) would take "
                    f"this node's keeper to {human_bytes(held + size)}, over its budget of "
                    f"{human_bytes(self.budget)} (recovery.peer_memory)"
                )
            self._copies[(c.attempt, c.rank, c.step)] = _Held(c)  # its room, taken now
            self._peak = max(self._peak, held + size)
        region = mmap.mmap(-1, size) if size else None
        spans, at = {}, 0
        for path, blob in blobs.items():
            n = sizes[path]
            if n:
                region[at : at + n] = memoryview(blob).cast("B")
            spans[path] = (at, n)
            at += n
        with self._lock:
            key = (c.attempt, c.rank, c.step)
            if key in self._copies:  # not dropped meanwhile (a settle, a retain)
                self._copies[key] = _Held(c, region, spans, ready=True)
            elif region is not None:
                region.close()
            return self._nbytes()

    def _prune(self, attempt: str, rank: int, arriving: int | None) -> None:
        """Drop `rank`'s copies of `attempt` that its level does not keep beside the one
        `arriving`: with two steps, all but the newest settled one (and the newest
        one, when nothing is arriving); with one step, all of them."""
        mine = sorted(s for a, r, s in self._copies if (a, r) == (attempt, rank))
        keep: set[int] = set()
        if self.steps >= 2:
            settled = self._settled.get(attempt)
            done = [s for s in mine if settled is not None and s <= settled]
            keep |= {max(done)} if done else set()
            if not done and mine:  # nothing settled yet: the newest copy stands in
                keep.add(mine[-1])
        if arriving is None and mine and self.steps >= 1:
            keep.add(mine[-1])
        for step in mine:
            if step not in keep and step != arriving:
                self._copies.pop((attempt, rank, step)).close()

    def settle(self, attempt: str, step: int) -> int:
        """Every rank of group `attempt` has its copy of `step` in its keepers: older
        steps of that group, and every other group's copies, are no longer read by any
        restore. Returns the bytes held."""
        with self._lock:
            self._settled[attempt] = max(step, self._settled.get(attempt, step))
            for a, r, s in list(self._copies):
                if a != attempt or s < step:
                    self._copies.pop((a, r, s)).close()
            return self._nbytes()

    def holdings(self) -> list[dict[str, Any]]:
        """What this keeper holds: every complete copy's description, without its bytes."""
        with self._lock:
            return [h.copy.to_dict() for h in self._copies.values() if h.ready]

    def read(self, attempt: str, step: int, path: str, start: int, length: int) -> bytes:
        with self._lock:
            for (a, _, s), h in self._copies.items():
                if a == attempt and s == step and h.ready and path in h.spans:
                    at, size = h.spans[path]
                    if start < 0 or start + length > size:
                        raise ValueError(f"{path} of step {step} holds fewer bytes than asked")
                    return h.region[at + start : at + start + length] if length else b""
        raise KeyError(f"no copy of {path} of step {step} (attempt {attempt}) here")

    def retain(self, attempts: list[str]) -> int:
        """Drop every copy of the groups not in `attempts`; the bytes left."""
        with self._lock:
            for key in [k for k in self._copies if k[0] not in attempts]:
                self._copies.pop(key).close()
            return self._nbytes()

    def nbytes(self) -> int:
        with self._lock:
            return self._nbytes()

    def peak_nbytes(self) -> int:
        """The most this keeper held at once so far: what its budget had to cover (read
        rarely, it misses no moment between two reads)."""
        with self._lock:
            return self._peak

    def _nbytes(self) -> int:
        return sum(h.copy.nbytes for h in self._copies.values())


__all__ = ["KeeperFull", "StateKeeper", "keeper_name"]
