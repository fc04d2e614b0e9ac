"""State keepers: training-state snapshots in the host memory of live nodes.

One `StateKeeper` actor per node the job runs on (no CPU of its own, pinned to its
node, owned by the controller, so it outlives every worker group). Each rank sends
its peer copy of a step (`spotline.checkpoint.peer`: the bytes its checkpoint holds)
to its own node's keeper and to its buddy: the keeper of the next node in the ring of
the group's nodes. A node lost takes its keeper with it, and its ranks' copies live
on in their buddies'. Who places the keepers, sends to them and reads from them is
`spotline.runtime.peers`.

Memory has a budget (recovery.peer_memory, `spotline.planning.peer_memory`), and the
budget counts what the node really holds for the keeper:
- per rank, the newest step the controller said is complete in every keeper
  (`settle`) and the one arriving: two steps, or one when the budget is short;
- the copy arriving, twice: its room here and its bytes in Ray's object store on this
  node (the sender's `put` for the node's own ranks, the pulled copy for its buddy's)
  until it is in;
- reads on their way to a restoring rank (a copy each, until the read returns);
- the process's working heap beyond its copies (`SPOTLINE_KEEPER_HEAP_BYTES`);
- the step offered for a restore (`hold`): it is pinned, never pruned, until the group
  that restored from it has a settled step of its own here, or its room is needed for
  that group's copies (the restore has read it by then: the group trains and sends);
- the copies live in anonymous memory maps, outside the Python heap, so the keeper's
  resident memory is its data and a dropped copy goes back to the OS at once;
- it refuses a copy that would take it over its budget (`KeeperFull`, naming the node);
- it answers on several threads, and copies bytes in and out without its lock: a
  question about what it holds never waits behind a large copy, and restores reading
  from it do not queue behind each other.

This module is what a keeper's process imports: it loads neither torch nor the
planner, so a keeper's resident memory and start-up CPU are its copies' and little
else (the node's training ranks pay for neither).
"""

from __future__ import annotations

import ctypes
import mmap
import resource
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spotline import constants
from spotline.checkpoint.peer import PeerCopy
from spotline.units import human_bytes


def keeper_name(job: str, node_id: str, generation: int = 0) -> str:
    """A keeper's actor name. A node's keeper is started again (a new generation) when
    the group's share of the node outgrows the memory it reserved from Ray."""
    tail = f":{generation}" if generation else ""
    return f"spotline:{job}:keeper:{node_id}{tail}"


class KeeperFull(RuntimeError):
    """A copy that would take a keeper over its budget (recovery.peer_memory)."""


def _rss() -> dict[str, int]:
    """This process's resident memory now, by kind (Linux /proc; zeros where it cannot
    be read): `anon`, its own (the copies' rooms, the heap), and `shmem`, pages of Ray's
    object store it mapped while copies arrived (the store's memory, counted there)."""
    out = {"anon": 0, "shmem": 0, "file": 0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("RssAnon", "RssShmem", "RssFile"):
                    out[key[3:].lower()] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _rss_peak() -> int:
    """This process's resident high-water mark (the kernel's: no moment is missed)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _let_go(blobs: list[Any]) -> None:
    """Unmap this process's pages of `blobs` that lie in shared mappings (a copy's
    bytes in Ray's object store, or a file), once they are copied: their bytes stay
    where they are, and the keeper's resident memory stops counting the store's pages
    it read through (they are the store's, counted there). Pages of private memory are
    never touched."""
    page = mmap.PAGESIZE
    spans = []
    for blob in blobs:
        mv = memoryview(blob).cast("B")
        if mv.nbytes < page:
            continue
        at = np.frombuffer(mv, dtype=np.uint8).ctypes.data
        lo, hi = -(-at // page) * page, (at + mv.nbytes) // page * page
        if hi > lo:
            spans.append((lo, hi))
    if not spans:
        return
    try:
        with open("/proc/self/maps") as f:
            shared = [
                (int(a, 16), int(b, 16))
                for a, b, perms in (
                    (*line.split(" ", 1)[0].split("-"), line.split(" ", 2)[1]) for line in f
                )
                if perms[3] == "s"
            ]
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError, IndexError, ValueError):
        return  # not Linux: the store's pages stay counted in the keeper's RSS
    for lo, hi in spans:
        if any(a <= lo and hi <= b for a, b in shared):
            madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), mmap.MADV_DONTNEED)


def _let_go_store() -> None:
    """Unmap this process's pages of every shared mapping but its own copies' maps
    (those are `/dev/zero` maps): Ray's object store, where copies arrived and where
    answers to restores' reads were written. Their bytes stay in the store; the
    keeper's resident memory stops counting pages that are the store's."""
    try:
        with open("/proc/self/maps") as f:
            lines = [line.split() for line in f]
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return
    for cols in lines:
        if len(cols) < 6 or cols[1][3] != "s" or cols[5] == "/dev/zero":
            continue
        lo, hi = (int(x, 16) for x in cols[0].split("-"))
        madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), mmap.MADV_DONTNEED)


@dataclass
class _Held:
    """One rank's copy of one step: its description and its bytes, in one memory map."""

    copy: PeerCopy
    size: int
    """The bytes of its room: what it holds, whatever its description declares."""
    region: mmap.mmap | None = None
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)
    """path -> (offset, length) in the region."""
    ready: bool = False
    """Its bytes are all in: a placeholder holds the room while they arrive."""
    readers: int = 0
    """Reads copying out of its region now (without the keeper's lock)."""
    dropped: bool = False
    """No longer held: its region is closed once the last read is out."""

    def close(self) -> None:
        if self.region is not None:
            self.region.close()
            self.region = None


class StateKeeper:
    """Peer copies of ranks' snapshots, in this process's memory (see the module)."""

    def __init__(
        self,
        budget: int | None = None,
        steps: int = 2,
        node: str = "",
        reserved: int = 0,
        heap: int | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._copies: dict[tuple[str, int, int], _Held] = {}
        self._settled: dict[str, int] = {}  # attempt -> newest step complete everywhere
        self._pins: set[tuple[str, int]] = set()  # (attempt, step) offered for a restore
        self.budget = budget
        self.steps = steps
        self.node = node
        self.reserved = reserved  # what the controller reserved from Ray for it
        self._transit = 0  # bytes of copies arriving, still in the object store
        self._reading = 0  # bytes of reads copied out, on their way to a reader
        self.heap = constants.SPOTLINE_KEEPER_HEAP_BYTES if heap is None else heap
        """Its process's working heap beyond the copies, counted against the budget."""
        self._peak = 0  # the most counted at once: held, arriving, read, and the heap
        self._rss0 = _rss()
        self._rss_peak = dict(self._rss0)  # per kind, sampled as each copy is in

    # --- the level, the budget, and what a restore may read --------------------------

    def configure(self, steps: int, budget: int | None) -> int:
        """A new level (`steps` per rank) and budget; drops what no longer fits (never a
        pinned step). Returns the bytes held."""
        with self._lock:
            self.steps, self.budget = steps, budget
            for key in {(a, r) for a, r, _ in self._copies}:
                self._prune(*key, arriving=None)
            return self._held()

    def hold(self, attempt: str, step: int) -> int:
        """Step `step` of group `attempt` is offered for a restore: pin its copies, and
        drop that group's other steps (older ones, and a newer one some rank never
        completed: no restore reads them). Returns the bytes held."""
        with self._lock:
            self._pins.add((attempt, step))
            for key in [k for k in self._copies if k[0] == attempt and k[2] != step]:
                self._drop(key)
            return self._held()

    def put(self, copy: dict[str, Any], blobs: dict[str, Any]) -> int:
        """Keep a rank's copy of a step (`blobs`: each file's bytes, any buffer). What
        it replaces goes first, so a keeper never holds more than its level allows.
        Returns the bytes this keeper holds; raises KeeperFull over the budget."""
        c = PeerCopy.from_dict(copy)
        if set(blobs) != {f.path for f in c.files}:
            raise ValueError(f"rank {c.rank}'s copy of step {c.step} names other files")
        sizes = {p: memoryview(b).nbytes for p, b in blobs.items()}
        size = sum(sizes.values())
        key = (c.attempt, c.rank, c.step)
        _let_go_store()  # the pages earlier copies and answers left mapped here
        with self._lock:
            if key in self._copies:  # the same copy again: the new one replaces it
                self._drop(key)
            self._prune(c.attempt, c.rank, arriving=c.step)
            if self._over(size):
                # The group sending copies has restored: a restore's source now only
                # stands in until this group settles a step, and this group's copies
                # come first.
                gone = self._unpin_for(c.attempt)
                for k in [k for k in self._copies if (k[0], k[2]) in gone]:
                    self._drop(k)
            if self._over(size):
                raise KeeperFull(
                    f"node {self.node[:12] or '?'}'s state keeper cannot take rank {c.rank}'s "
                    f"copy of step {c.step} ({human_bytes(size)}, and as much again in Ray's "
                    f"object store while it arrives): it holds {human_bytes(self._count())} "
                    f"and its budget is {human_bytes(self.budget or 0)} (recovery.peer_memory)"
                )
            self._copies[key] = _Held(c, size)  # its room, taken now
            self._transit += size
            self._peak = max(self._peak, self._count())
        region = None
        try:
            region = mmap.mmap(-1, size) if size else None
            spans, at = {}, 0
            for path, blob in blobs.items():
                n = sizes[path]
                if n:
                    region[at : at + n] = memoryview(blob).cast("B")
                spans[path] = (at, n)
                at += n
        except BaseException:
            with self._lock:
                self._transit -= size
                if self._copies.get(key) is not None and not self._copies[key].ready:
                    self._drop(key)
            if region is not None:
                region.close()
            raise
        with self._lock:
            self._sample()  # the copy is in and its transit still mapped: the most
        _let_go(list(blobs.values()))
        with self._lock:
            self._transit -= size
            held = self._copies.get(key)
            if held is not None and not held.ready and not held.dropped:
                self._copies[key] = _Held(c, size, region, spans, ready=True)
            elif region is not None:  # dropped meanwhile (a settle, a retain)
                region.close()
            return self._held()

    def _over(self, size: int) -> bool:
        """A copy of `size` bytes arriving (its room and its transit) would take the
        keeper over its budget."""
        return self.budget is not None and self._count() + 2 * size > self.budget

    def _unpin_for(self, attempt: str) -> set[tuple[str, int]]:
        """Unpin the steps of other groups than `attempt` (a restore's source, which
        that group has read): the (attempt, step)s unpinned."""
        other = {p for p in self._pins if p[0] != attempt}
        self._pins -= other
        return other

    def _prune(self, attempt: str, rank: int, arriving: int | None) -> None:
        """Drop `rank`'s copies of `attempt` that its level does not keep beside the one
        `arriving`: with two steps, all but the newest settled one (and the newest
        one, when nothing is arriving); with one step, all of them. A pinned step
        stays; while another group's step is pinned (the one this group restored
        from), it stands in for this group's settled step."""
        mine = sorted(s for a, r, s in self._copies if (a, r) == (attempt, rank))
        keep: set[int] = set()
        if self.steps >= 2:
            settled = self._settled.get(attempt)
            done = [s for s in mine if settled is not None and s <= settled]
            keep |= {max(done)} if done else set()
            source = any(a != attempt for a, _ in self._pins)
            if not done and mine and not source:  # the newest copy stands in
                keep.add(mine[-1])
        if arriving is None and mine and self.steps >= 1:
            keep.add(mine[-1])
        for step in mine:
            if step not in keep and step != arriving and (attempt, step) not in self._pins:
                self._drop((attempt, rank, step))

    def settle(self, attempt: str, step: int) -> int:
        """Every rank of group `attempt` has its copy of `step` in its keepers: older
        steps of that group, and every other group's copies (a restore's source
        included), are no longer read by any restore. Only where this keeper holds
        that step for each of the group's ranks it keeps: one it pruned meanwhile (a
        newer copy arrived before the settle) leaves the older complete one standing.
        Returns the bytes held."""
        with self._lock:
            self._settled[attempt] = max(step, self._settled.get(attempt, step))
            ranks = {r for a, r, _ in self._copies if a == attempt}
            have = {r for a, r, s in self._copies if a == attempt and s == step}
            if ranks and ranks <= have:
                self._pins = {p for p in self._pins if p[0] == attempt}
                for a, r, s in list(self._copies):
                    if (a != attempt or s < step) and (a, s) not in self._pins:
                        self._drop((a, r, s))
            return self._held()

    def retain(self, attempts: list[str]) -> int:
        """Drop every copy of the groups not in `attempts`, and their pins; the bytes
        left."""
        with self._lock:
            self._pins = {p for p in self._pins if p[0] in attempts}
            for key in [k for k in self._copies if k[0] not in attempts]:
                self._drop(key)
            return self._held()

    # --- reading -----------------------------------------------------------------------

    def holdings(self) -> list[dict[str, Any]]:
        """What this keeper holds: every complete copy's description, without its bytes."""
        with self._lock:
            return [h.copy.to_dict() for h in self._copies.values() if h.ready and not h.dropped]

    def read(self, attempt: str, step: int, path: str, start: int, length: int) -> bytes:
        """Bytes [start, start + length) of `path` of a held copy. The bytes are copied
        out without the lock: other reads, copies arriving and questions go on."""
        with self._lock:
            found = None
            for (a, _, s), h in self._copies.items():
                if a == attempt and s == step and h.ready and not h.dropped and path in h.spans:
                    found = h
                    break
            if found is None:
                raise KeyError(f"no copy of {path} of step {step} (attempt {attempt}) here")
            at, size = found.spans[path]
            if start < 0 or start + length > size:
                raise ValueError(f"{path} of step {step} holds fewer bytes than asked")
            if not length:
                return b""
            found.readers += 1
            # The bytes copied out, then again in Ray's object store as the answer.
            self._reading += 2 * length
            self._peak = max(self._peak, self._count())
        try:
            return found.region[at + start : at + start + length]
        finally:
            with self._lock:
                self._sample()
                found.readers -= 1
                self._reading -= 2 * length
                if found.dropped and not found.readers:
                    found.close()

    # --- what it holds -----------------------------------------------------------------

    def nbytes(self) -> int:
        with self._lock:
            return self._held()

    def peak_nbytes(self) -> int:
        """The most this keeper counted at once so far (held, arriving and read): what
        its budget had to cover (read rarely, it misses no moment between two reads)."""
        with self._lock:
            return self._peak

    def memory(self, reset: bool = False) -> dict[str, Any]:
        """What this keeper counts and what its process measures: bytes held, the peak
        it counted, its budget and reservation, and its resident memory by kind now, at
        its start (its process before any copy) and at its highest as each copy was in
        (`rss_hwm`: the kernel's high-water mark of all of it). `reset`: the peaks start
        again from now once read (what one moment, such as a restore, adds)."""
        with self._lock:
            out = {
                "node": self.node,
                "held": self._held(),
                "peak": self._peak,
                "budget": self.budget,
                "reserved": self.reserved,
                "heap": self.heap,
                "steps": self.steps,
                "pinned": sorted(self._pins),
                "rss": _rss(),
                "rss_start": self._rss0,
                "rss_peak": self._sample(),
                "rss_hwm": _rss_peak(),
            }
            if reset:
                self._peak, self._rss_peak = self._count(), {}
                self._sample()
            return out

    def _sample(self) -> dict[str, int]:
        """Take this moment's resident memory into its per-kind peaks; the peaks."""
        now = _rss()
        for kind, n in now.items():
            self._rss_peak[kind] = max(self._rss_peak.get(kind, 0), n)
        self._rss_peak["anon_shmem"] = max(
            self._rss_peak.get("anon_shmem", 0), now["anon"] + now["shmem"]
        )
        return dict(self._rss_peak)

    def _drop(self, key: tuple[str, int, int]) -> None:
        h = self._copies.pop(key)
        h.dropped = True
        if not h.readers:
            h.close()

    def _held(self) -> int:
        return sum(h.size for h in self._copies.values())

    def _count(self) -> int:
        """What the budget counts now: the rooms held, copies in transit, reads out, and
        the process's working heap."""
        return self._held() + self._transit + self._reading + self.heap


__all__ = ["KeeperFull", "StateKeeper", "keeper_name"]
