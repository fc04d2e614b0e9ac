"""State keepers: training-state snapshots in the host memory of live nodes.

One `StateKeeper` actor per node the job runs on (no CPU of its own, pinned to its
node, owned by the controller, so it outlives every worker group). Each rank sends
its peer copy of a step (`spotline.checkpoint.peer`: the bytes its checkpoint holds)
to its own node's keeper and to its buddy: the keeper of the next node in the ring of
the group's nodes. A node lost takes its keeper with it, and its ranks' copies live
on in their buddies'. A keeper holds the newest `KEEP_STEPS` steps of each rank.

- `PeerMemory` (controller side): places keepers, names each rank's two, asks the
  live ones what they hold (`offer`: the newest step a failed group left complete)
  and drops what no restore may read any more.
- `PeerSender` (a rank's upload thread): reads the files a save wrote and sends them.
- `PeerReader` (a rank restoring): `read_range` from the keepers a peer manifest
  names, own node's first; what it reads is verified against the manifest's hashes
  exactly as a read from storage is.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from spotline.checkpoint.errors import CorruptCheckpointError
from spotline.checkpoint.layout import RankFiles
from spotline.checkpoint.manifest import Manifest
from spotline.checkpoint.peer import PEER_KEY, PeerCopy, PeerOffer, newest_complete, peer_copy
from spotline.config.schema import JobSpec

log = logging.getLogger("spotline.keeper")

KEEP_STEPS = 2
"""Steps a keeper holds per rank: the newest complete one stays while the next arrives."""
ASK_TIMEOUT_S = 10.0
"""How long a question to one keeper may take before it counts as lost."""


def keeper_name(job: str, node_id: str) -> str:
    return f"spotline:{job}:keeper:{node_id}"


class StateKeeper:
    """Peer copies of ranks' snapshots, in this process's memory (see the module)."""

    def __init__(self) -> None:
        self._copies: dict[tuple[str, int, int], tuple[PeerCopy, dict[str, bytes]]] = {}

    def put(self, copy: dict[str, Any], blobs: dict[str, bytes]) -> int:
        """Keep a rank's copy of a step; drop that rank's copies beyond the newest
        KEEP_STEPS. Returns the bytes this keeper holds."""
        c = PeerCopy.from_dict(copy)
        if set(blobs) != {f.path for f in c.files}:
            raise ValueError(f"rank {c.rank}'s copy of step {c.step} names other files")
        self._copies[(c.attempt, c.rank, c.step)] = (c, dict(blobs))
        mine = sorted(s for a, r, s in self._copies if (a, r) == (c.attempt, c.rank))
        for old in mine[:-KEEP_STEPS]:
            del self._copies[(c.attempt, c.rank, old)]
        return self.nbytes()

    def holdings(self) -> list[dict[str, Any]]:
        """What this keeper holds: every copy's description, without its bytes."""
        return [c.to_dict() for c, _ in self._copies.values()]

    def read(self, attempt: str, step: int, path: str, start: int, length: int) -> bytes:
        for (a, _, s), (_, blobs) in self._copies.items():
            if a == attempt and s == step and path in blobs:
                data = blobs[path][start : start + length]
                if len(data) != length:
                    raise ValueError(f"{path} of step {step} holds fewer bytes than asked")
                return data
        raise KeyError(f"no copy of {path} of step {step} (attempt {attempt}) here")

    def retain(self, attempts: list[str]) -> int:
        """Drop every copy of the groups not in `attempts`; the bytes left."""
        for key in [k for k in self._copies if k[0] not in attempts]:
            del self._copies[key]
        return self.nbytes()

    def nbytes(self) -> int:
        return sum(c.nbytes for c, _ in self._copies.values())


class PeerMemory:
    """The controller's side of the keepers (see the module)."""

    def __init__(self, spec: JobSpec):
        self.spec = spec
        self._keepers: dict[str, Any] = {}  # node id -> keeper handle

    def place(self, nodes_of_ranks: list[str]) -> list[tuple[str, str | None]]:
        """Make sure a keeper lives on each node of the group; per rank (by position in
        `nodes_of_ranks`), the names of its own node's keeper and its buddy's (None
        on a one-node group: there is no other node to hold a copy)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ring = sorted(set(nodes_of_ranks))
        for node in ring:
            handle = self._keepers.get(node)
            if handle is not None and self._alive(handle):
                continue
            cls = ray.remote(StateKeeper)
            self._keepers[node] = cls.options(
                name=keeper_name(self.spec.name, node),
                num_cpus=0,
                max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                get_if_exists=True,
            ).remote()
        out = []
        for node in nodes_of_ranks:
            buddy = ring[(ring.index(node) + 1) % len(ring)]
            name = keeper_name(self.spec.name, node)
            out.append((name, keeper_name(self.spec.name, buddy) if buddy != node else None))
        return out

    @staticmethod
    def _alive(handle: Any) -> bool:
        import ray

        try:
            ray.get(handle.nbytes.remote(), timeout=ASK_TIMEOUT_S)
            return True
        except Exception:  # noqa: BLE001 - a dead or unreachable keeper is replaced
            return False

    def held(self, leaving: set[str] = frozenset()) -> list[tuple[str, PeerCopy]]:
        """(keeper, copy) for every copy the live keepers hold; a keeper that does not
        answer (its node is gone) holds nothing and is forgotten. The keepers of
        `leaving` nodes (a preemption notice dooms them) are not asked: a restore must
        not read from a node that may vanish under it."""
        import ray

        asks = {
            node: h.holdings.remote() for node, h in self._keepers.items() if node not in leaving
        }
        out: list[tuple[str, PeerCopy]] = []
        for node, ref in asks.items():
            try:
                got = ray.get(ref, timeout=ASK_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - its node is gone: so are its copies
                log.info("state keeper on node %s is gone (%s)", node[:12], type(e).__name__)
                del self._keepers[node]
                continue
            out += [(keeper_name(self.spec.name, node), PeerCopy.from_dict(c)) for c in got]
        return out

    def offer(
        self,
        attempt: str,
        world: int,
        partition: list[int] | None,
        at: int | None = None,
        leaving: set[str] = frozenset(),
    ) -> PeerOffer | None:
        """The newest step (or step `at`) group `attempt` left complete in the live
        keepers of nodes that are not `leaving`."""
        return newest_complete(self.spec, self.held(leaving), attempt, world, partition, at)

    def forget(self, nodes: set[str]) -> None:
        """The keepers of `nodes` are gone with them (a node loss the controller saw):
        never asked again, so no restore waits on a dead actor to answer."""
        for node in nodes:
            self._keepers.pop(node, None)

    def retain(self, attempts: list[str]) -> None:
        """Keep only the copies of `attempts` (the group that runs, and the one it
        restored from until it has its own): no later restore may read another's."""
        import ray

        refs = [h.retain.remote(list(attempts)) for h in self._keepers.values()]
        with contextlib.suppress(Exception):  # a lost keeper holds nothing to drop
            ray.get(refs, timeout=ASK_TIMEOUT_S)

    def close(self) -> None:
        import ray

        for h in self._keepers.values():
            with contextlib.suppress(Exception):  # already gone
                ray.kill(h, no_restart=True)
        self._keepers = {}


def _keeper(handles: dict[str, Any], name: str) -> Any:
    """The handle of keeper `name`, looked up once per process."""
    import ray

    if name not in handles:
        handles[name] = ray.get_actor(name)
    return handles[name]


class PeerSender:
    """A rank's side: send what a save wrote to its own and its buddy's keeper."""

    def __init__(self, rank: int, world_size: int, attempt: str, keepers: list[str]):
        self.rank = rank
        self.world_size = world_size
        self.attempt = attempt
        self.keepers = keepers
        self._handles: dict[str, Any] = {}

    def __call__(
        self,
        step: int,
        local: Path,
        written: RankFiles,
        batch: dict[str, Any] | None,
        losses: list[tuple[int, float]],
    ) -> dict[str, Any]:
        """Send the rank's files of `step` (under `local`, as `written` describes them);
        returns what happened: bytes, seconds, and the keepers that took it."""
        import ray

        t0 = time.perf_counter()
        copy, blobs = peer_copy(
            self.attempt, self.rank, self.world_size, step, local, written, batch, losses
        )
        refs = {
            name: _keeper(self._handles, name).put.remote(copy.to_dict(), blobs)
            for name in self.keepers
        }
        took = []
        for name, ref in refs.items():
            try:
                ray.get(ref, timeout=ASK_TIMEOUT_S)
                took.append(name)
            except Exception as e:  # noqa: BLE001 - the other copy may still land
                log.warning(
                    "rank %d: peer copy of step %d not kept by %s (%s)",
                    self.rank,
                    step,
                    name,
                    type(e).__name__,
                )
        return {
            "step": step,
            "nbytes": sum(len(b) for b in blobs.values()),
            "send_s": time.perf_counter() - t0,
            "kept_by": len(took),
        }


class PeerReader:
    """`read_range` over the keepers a peer manifest names (own node's first), for a
    rank restoring from peer memory."""

    def __init__(self, manifest: Manifest, own_keeper: str | None):
        self.step = manifest.step
        self.attempt = manifest.extra["attempt"]
        self.uri = "peer memory"
        holders = manifest.extra[PEER_KEY]["holders"]
        self._holders: dict[str, list[str]] = defaultdict(list)
        for prefix, names in holders.items():
            mine = [n for n in names if n == own_keeper]
            self._holders[prefix] = mine + [n for n in names if n != own_keeper]
        self._handles: dict[str, Any] = {}

    def read_range(self, step: int, path: str, start: int, length: int) -> bytes:
        import ray

        prefix = path.rsplit("/", 1)[0]
        why = "no keeper holds it"
        for name in self._holders.get(prefix, []):
            try:
                data = ray.get(
                    _keeper(self._handles, name).read.remote(
                        self.attempt, step, path, start, length
                    ),
                    timeout=ASK_TIMEOUT_S,
                )
            except Exception as e:  # noqa: BLE001 - the next holder, else the commit
                why = f"{name.rsplit(':', 1)[-1][:12]}: {type(e).__name__}"
                continue
            return data
        raise CorruptCheckpointError(
            step, path, f"the peer copy cannot be read ({why})", uri=self.uri
        )


__all__ = ["PeerMemory", "PeerReader", "PeerSender", "StateKeeper", "keeper_name"]
