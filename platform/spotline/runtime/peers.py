"""Peer memory from both sides of the state keepers (`spotline.runtime.keeper`).

- `PeerMemory` (controller side): places a keeper on each node of the group, fits
  the job's copies to each node's budget (the degrade order of
  `planning.peer_memory`), reserves what a keeper holds from Ray's scheduler
  (`memory`), names each rank's two keepers, asks the live ones what they hold
  (`offer`, all at once), settles complete steps and drops what no restore may read
  any more. A keeper is forgotten only when Ray says it died, never for being slow.
- `PeerSender` (a rank's upload thread): maps the files a save wrote, puts them in the
  object store once, and hands the same object to both keepers; a put that does not
  land in time is cancelled.
- `PeerReader` (a rank restoring): `read_range` from the keepers a peer manifest
  names, own node's first; what it reads is verified against the manifest's hashes
  exactly as a read from storage is.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotline.checkpoint.errors import CorruptCheckpointError
from spotline.checkpoint.layout import RankFiles
from spotline.checkpoint.manifest import Manifest
from spotline.checkpoint.peer import PEER_KEY, PeerCopy, PeerOffer, newest_complete, peer_copy
from spotline.config.schema import JobSpec
from spotline.heap import collection_held
from spotline.planning.peer_memory import (
    KEEPER_THREADS,
    LEVELS,
    READ_PIECE,
    PeerLevel,
    fit_level,
    rank_copy_bytes,
)
from spotline.runtime.keeper import KeeperFull, StateKeeper, keeper_name
from spotline.units import human_bytes

log = logging.getLogger("spotline.keeper")

ASK_TIMEOUT_S = 10.0
"""How long a question to the keepers, or a copy sent to one, may take."""


def _dead(e: BaseException) -> bool:
    """Ray says the actor is gone for good (not merely slow or briefly unreachable)."""
    import ray.exceptions as rex

    return isinstance(e, rex.ActorDiedError)


def _node_ram() -> dict[str, int]:
    """Each alive node's host RAM as Ray manages it (its memory and object store)."""
    import ray

    return {
        n["NodeID"]: int(
            n["Resources"].get("memory", 0) + n["Resources"].get("object_store_memory", 0)
        )
        for n in ray.nodes()
        if n.get("Alive")
    }


@dataclass
class _Keeper:
    """One keeper actor: its name, handle, and what it reserved from Ray."""

    name: str
    handle: Any
    reserved: int


class PeerMemory:
    """The controller's side of the keepers (see the module)."""

    def __init__(self, spec: JobSpec, keeper_cls: type = StateKeeper):
        self.spec = spec
        self._cls = keeper_cls
        self._keepers: dict[str, _Keeper] = {}  # node id -> its keeper now
        self._retiring: dict[str, _Keeper] = {}  # node id -> the one it replaced
        """Keepers started again with another reservation leave their predecessor up
        while it holds a restore's source: it goes once the restore has read it."""
        self._generation = 0
        self.pinned: tuple[str, int] | None = None
        """(attempt, step) offered for the restore under way, pinned in the keepers."""
        self.level: PeerLevel = LEVELS[0]
        self.fits: list[dict[str, Any]] = []
        """Per node of the latest placement: own and buddy bytes, budget, RAM, need."""
        self.changes: list[str] = []
        """What the controller says about the level (taken with `take_changes`)."""
        self._quiet: set[str] = set()  # nodes whose slowness was already said
        self._said = False  # the level, at the first placement

    # --- placement and the budget ---------------------------------------------------

    def fit(
        self, nodes_of_ranks: list[str], copy_bytes: list[int], ram: dict[str, int]
    ) -> PeerLevel:
        """The fullest level at which every node's keeper fits its budget, for ranks on
        `nodes_of_ranks` whose copies are `copy_bytes` (by rank)."""
        ring = sorted(set(nodes_of_ranks))
        own = defaultdict(int)
        for node, n in zip(nodes_of_ranks, copy_bytes, strict=True):
            own[node] += n
        rec = self.spec.recovery
        level, self.fits = LEVELS[0], []
        for i, node in enumerate(ring):
            buddy = own[ring[i - 1]] if len(ring) > 1 else 0
            budget = rec.peer_budget_bytes(ram.get(node))
            mine = fit_level(own[node], buddy, budget)
            level = max(level, mine, key=LEVELS.index)
            self.fits.append(
                {
                    "node": node,
                    "own": own[node],
                    "buddy": buddy,
                    "budget": budget,
                    "ram": ram.get(node),
                    "fits": LEVELS.index(mine),
                }
            )
        for f in self.fits:
            f["need"] = level.need(f["own"], f["buddy"])
            f["reserve"] = level.held(f["own"], f["buddy"])
            if f["node"] in self._keepers:
                f["keeper"] = self._keepers[f["node"]].name
                f["reserved"] = self._keepers[f["node"]].reserved
        return level

    def place(
        self, nodes_of_ranks: list[str], replicas: int, bounds: list[int] | None = None
    ) -> list[tuple[str, str | None]] | None:
        """Make sure a keeper lives on each node of the group, at the level the budget
        allows for this shape, with a reservation from Ray that covers the group's share
        of the node; per rank (by position in `nodes_of_ranks`), the names of its own
        node's keeper and its buddy's (None on a one-node group, or when copies stay on
        their own node). None: no peer snapshots fit at all."""

        copy_bytes = rank_copy_bytes(self.spec, replicas, bounds)
        self._set_level(self.fit(nodes_of_ranks, copy_bytes, _node_ram()))
        if not self.level.steps:
            return None
        ring = sorted(set(nodes_of_ranks))
        fits = {f["node"]: f for f in self.fits}
        steps = self.level.steps
        asks = {n: (steps, fits[n]["budget"]) for n in ring}
        for node, answer in self._ask("configure", asks).items():
            if isinstance(answer, Exception) and _dead(answer):
                del self._keepers[node]
        for node in ring:
            k, reserve = self._keepers.get(node), fits[node]["reserve"]
            if k is not None and not _reserves(k.reserved, reserve):
                # Ray cannot change what an actor reserved: a keeper of this size starts
                # anew; the old one stays while it holds the step a restore reads.
                self._retire(node)
                k = None
            if k is None:  # a keeper alive, or only slow, keeps its copies
                self._keepers[node] = self._start(node, fits[node]["budget"], reserve)
            fits[node]["keeper"] = self._keepers[node].name
            fits[node]["reserved"] = self._keepers[node].reserved
        out = []
        at = {n: i for i, n in enumerate(ring)}
        for node in nodes_of_ranks:
            buddy = ring[(at[node] + 1) % len(ring)]
            name = self._keepers[node].name
            far = self._keepers[buddy].name if buddy != node and self.level.buddy else None
            out.append((name, far))
        return out

    def _start(self, node: str, budget: int | None, reserve: int) -> _Keeper:
        """A keeper pinned to `node`, reserving `reserve` bytes from Ray (0: none). Its
        name is new: never an older keeper's, whose budget and reservation it would keep."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        while True:
            name = keeper_name(self.spec.name, node, self._generation)
            try:
                handle = (
                    ray.remote(self._cls)
                    .options(
                        name=name,
                        num_cpus=0,
                        memory=reserve or None,
                        max_restarts=0,
                        max_concurrency=KEEPER_THREADS,
                        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                    )
                    .remote(budget, self.level.steps, node, reserve)
                )
            except ValueError:  # the name is taken (a keeper of an earlier life): the next
                self._generation += 1
                continue
            return _Keeper(name, handle, reserve)

    def _retire(self, node: str) -> None:
        """The keeper of `node` is replaced: kept aside while a restore's source is
        pinned (it may hold it), else ended now."""
        k = self._keepers.pop(node)
        self._generation += 1
        old = self._retiring.pop(node, None)
        if old is not None:
            _kill(old)
        if self.pinned is not None:
            self._retiring[node] = k
        else:
            _kill(k)

    def _release(self) -> None:
        """The restore's source is no longer needed: the keepers it kept aside go."""
        self.pinned = None
        for k in self._retiring.values():
            _kill(k)
        self._retiring = {}

    def refit(self, nodes_of_ranks: list[str], copy_bytes: list[int]) -> None:
        """The copies' measured sizes (by rank): when they no longer fit the level, keep
        fewer steps at once (a copy's buddy is chosen at the next placement)."""
        level = self.fit(nodes_of_ranks, copy_bytes, _node_ram())
        if LEVELS.index(level) <= LEVELS.index(self.level):
            return
        self._set_level(level)
        for f in self.fits:
            if f["node"] in self._keepers:
                self._keepers[f["node"]].handle.configure.remote(level.steps, f["budget"])

    def _set_level(self, level: PeerLevel) -> None:
        """Take `level`; say so when it changes (and at the first placement)."""
        if level == self.level and self._said:
            return
        self._said = True
        self.level = level
        # The node whose budget set the level (else the busiest one).
        f = max(self.fits, key=lambda f: (f["fits"], f["own"] + f["buddy"]))
        ram = f" of {human_bytes(f['ram'])} RAM" if f["ram"] else ""
        budget = (
            f"its budget of {human_bytes(f['budget'])}{ram}"
            if f["budget"] is not None
            else "an unknown budget"
        )
        full = LEVELS[0].need(f["own"], f["buddy"])
        head = (
            f"peer memory: node {f['node'][:12]}'s keeper holds up to {human_bytes(full)} "
            f"(two steps of {human_bytes(f['own'])} own and {human_bytes(f['buddy'])} buddy "
            "copies, and one arriving through Ray's object store)"
        )
        if level == LEVELS[0]:
            self.changes.append(f"{head}, within {budget} (recovery.peer_memory)")
            return
        self.changes.append(
            f"{head}, over {budget} (recovery.peer_memory): {level.describe()}"
            + (f", {human_bytes(level.need(f['own'], f['buddy']))}" if level.steps else "")
            + ("; a lost node's ranks restore from storage" if not level.buddy else "")
            + ". Raise recovery.peer_memory, or spread the ranks over more nodes"
        )

    def take_changes(self) -> list[str]:
        out, self.changes = self.changes, []
        return out

    def _all(self) -> dict[str, _Keeper]:
        """Every keeper to ask, by a key of its own: the current ones by node, and the
        ones kept aside for a restore's source."""
        return {**self._keepers, **{f"{n}:retiring": k for n, k in self._retiring.items()}}

    def _ask(self, method: str, args: dict[str, tuple]) -> dict[str, Any]:
        """Call `method` on the keepers named in `args` (by node, or `_all`'s keys) with
        each one's args, at once; per keeper its answer, or the exception it raised, or
        None when it gave none within ASK_TIMEOUT_S (busy, or not placed)."""
        import ray

        every = self._all()
        asks = {
            getattr(every[n].handle, method).remote(*a): n for n, a in args.items() if n in every
        }
        if not asks:
            return {}
        ready, _ = ray.wait(list(asks), num_returns=len(asks), timeout=ASK_TIMEOUT_S)
        out: dict[str, Any] = dict.fromkeys(asks.values())
        for ref in ready:
            try:
                out[asks[ref]] = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - the caller tells dead from refused
                out[asks[ref]] = e
        return out

    def _ask_all(self, method: str, *args: Any) -> dict[str, Any]:
        return self._ask(method, dict.fromkeys(self._all(), args))

    def _gone(self, key: str) -> None:
        """The keeper asked as `key` died: forgotten (its copies went with it)."""
        if key.endswith(":retiring"):
            self._retiring.pop(key.removesuffix(":retiring"), None)
        else:
            self._keepers.pop(key, None)

    def held(self, leaving: set[str] = frozenset()) -> list[tuple[str, PeerCopy]]:
        """(keeper, copy) for every copy the live keepers hold, all asked at once. A
        keeper that died (its node is gone) holds nothing and is forgotten; one that
        does not answer in time is left out of this answer and kept. The keepers of
        `leaving` nodes (a preemption notice dooms them) are not asked: a restore must
        not read from a node that may vanish under it."""
        return self._parse(self._holdings(leaving))

    def _holdings(self, leaving: set[str]) -> list[tuple[str, str, Any]]:
        """(key, keeper name, answer) of every keeper not on a `leaving` node, asked at
        once: its copies' descriptions, the exception it raised, or None (no answer)."""
        every = self._all()
        asked = {key: () for key in every if key.split(":")[0] not in leaving}
        got = self._ask("holdings", asked)
        return [
            (key, getattr(every[key], "name", None) or keeper_name(self.spec.name, key), a)
            for key, a in got.items()
        ]

    def _parse(self, answers: list[tuple[str, str, Any]]) -> list[tuple[str, PeerCopy]]:
        """The copies in the keepers' answers; a dead keeper is forgotten, a silent one
        said once and kept."""
        out: list[tuple[str, PeerCopy]] = []
        for key, name, got in answers:
            node = key.split(":")[0]
            if got is None:
                if node not in self._quiet:
                    self._quiet.add(node)
                    log.warning(
                        "state keeper on node %s did not answer within %.0fs (busy receiving "
                        "copies?); its copies are left out of this restore, and it is kept",
                        node[:12],
                        ASK_TIMEOUT_S,
                    )
                continue
            if isinstance(got, Exception):  # dead: so are its copies; else kept
                if _dead(got):
                    log.info("state keeper on node %s is gone (%s)", node[:12], type(got).__name__)
                    self._gone(key)
                continue
            self._quiet.discard(node)
            out += [(name, PeerCopy.from_dict(c)) for c in got]
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
        keepers of nodes that are not `leaving`. The keepers are asked with automatic
        collection on; it waits while their answers are folded: thousands of ranks'
        holdings are a burst of containers (`spotline.heap`)."""
        answers = self._holdings(leaving)
        with collection_held():
            held = self._parse(answers)
            return newest_complete(self.spec, held, attempt, world, partition, at)

    def hold(self, attempt: str, step: int) -> None:
        """Step `step` of group `attempt` is offered for the next restore: every keeper
        pins it (no placement, level or retention drops it before the restore read it)
        and drops that group's other steps, which no restore reads."""
        self.pinned = (attempt, step)
        self._ask_all("hold", attempt, step)

    def settle(self, attempt: str, step: int) -> None:
        """Every rank of `attempt` has `step` in all its keepers: they drop older steps
        and other groups' copies (without waiting for them), a restore's source
        included once the group that restored from it settles a step."""
        for k in self._all().values():
            with contextlib.suppress(Exception):  # a lost keeper holds nothing to drop
                k.handle.settle.remote(attempt, step)
        if self.pinned is not None and self.pinned[0] != attempt:
            self._release()

    def forget(self, nodes: set[str]) -> None:
        """The keepers of `nodes` are gone with them (a node loss the controller saw):
        never asked again, so no restore waits on a dead actor to answer."""
        for node in nodes:
            self._keepers.pop(node, None)
            self._retiring.pop(node, None)

    def retain(self, attempts: list[str]) -> None:
        """The group restored: keep only the copies of `attempts` (the group that runs,
        and the one it restored from until it has its own): no later restore may read
        another's. A keeper kept aside for the restore goes now: beside its node's new
        keeper it would take the node over its budget (the new one may use all of it),
        so on that node the source's copies go once the restore has read them."""
        for k in self._retiring.values():
            _kill(k)
        self._retiring = {}
        if self.pinned is not None and self.pinned[0] not in attempts:
            self._release()
        self._ask_all("retain", list(attempts))

    def nbytes(self) -> dict[str, int]:
        """What each keeper that answered holds now, by node (figures, tests)."""
        got = self._ask_all("nbytes")
        return {n: b for n, b in got.items() if isinstance(b, int)}

    def memory(self) -> dict[str, dict[str, Any]]:
        """Each keeper's own account (`StateKeeper.memory`: bytes held, its peak, budget,
        reservation, resident memory), by node (a kept-aside one as `node:retiring`)."""
        got = self._ask_all("memory")
        return {n: m for n, m in got.items() if isinstance(m, dict)}

    def close(self) -> None:
        for k in self._all().values():
            _kill(k)
        self._keepers, self._retiring = {}, {}


def _reserves(reserved: int, need: int) -> bool:
    """A keeper that reserved `reserved` bytes from Ray fits a share of `need`: enough,
    and not twice as much as it holds (the reservation follows the group's size)."""
    return need <= reserved and (reserved <= 2 * need or reserved - need < 1024**2)


def _kill(k: _Keeper) -> None:
    import ray

    with contextlib.suppress(Exception):  # already gone
        ray.kill(k.handle, no_restart=True)


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
        returns what happened: bytes, seconds, and how many keepers took it of how many.
        The files are mapped, not read into this process: one copy into the object
        store serves both keepers."""
        import ray

        t0 = time.perf_counter()
        copy, blobs = peer_copy(
            self.attempt, self.rank, self.world_size, step, local, written, batch, losses
        )
        nbytes = copy.nbytes
        payload = ray.put(blobs)
        del blobs  # the maps: the object store holds the bytes now
        refs = {
            _keeper(self._handles, name).put.remote(copy.to_dict(), payload): name
            for name in self.keepers
        }
        ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=ASK_TIMEOUT_S)
        for ref in late:  # never left queued behind a slow keeper, holding its bytes
            with contextlib.suppress(Exception):
                ray.cancel(ref)
        took, why, refused = 0, [], []
        for ref in ready:
            try:
                ray.get(ref)
                took += 1
            except Exception as e:  # noqa: BLE001 - the other copy may still land
                cause = getattr(e, "cause", None) or e
                if isinstance(cause, KeeperFull):
                    refused.append({"node": _node_of(refs[ref]), "why": str(cause)})
                why.append(f"{_node_of(refs[ref])}: {_short(e)}")
        why += [f"{_node_of(refs[r])}: no answer in {ASK_TIMEOUT_S:.0f}s" for r in late]
        if why:
            log.warning(
                "rank %d: peer copy of step %d not kept by %s", self.rank, step, "; ".join(why)
            )
        del payload
        return {
            "step": step,
            "nbytes": nbytes,
            "send_s": time.perf_counter() - t0,
            "kept_by": took,
            "keepers": len(self.keepers),
            # Why a keeper did not take it: the controller says it (once), and at a
            # later loss tells no copies kept from a rank and its buddy lost together.
            **({"not_kept": why[:2]} if why else {}),
            **({"refused": refused[0]} if refused else {}),
        }


def _node_of(name: str) -> str:
    """The node of keeper `name`, as the messages print it."""
    return name.split(":keeper:")[-1][:12]


def _short(e: BaseException) -> str:
    """A keeper's error in one line: its own message when it refused (KeeperFull)."""
    cause = getattr(e, "cause", None) or e
    if isinstance(cause, KeeperFull):
        return str(cause)
    return type(cause).__name__


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
                # In pieces of READ_PIECE: what a keeper has on its way out at once
                # stays within what its budget counts for a restore.
                keeper = _keeper(self._handles, name)
                pieces = [
                    keeper.read.remote(self.attempt, step, path, at, min(READ_PIECE, end - at))
                    for at, end in [
                        (a, start + length) for a in range(start, start + length, READ_PIECE)
                    ]
                ]
                data = b"".join(ray.get(pieces, timeout=ASK_TIMEOUT_S)) if pieces else b""
            except Exception as e:  # noqa: BLE001 - the next holder, else the commit
                why = f"{_node_of(name)}: {type(e).__name__}"
                continue
            return data
        raise CorruptCheckpointError(
            step, path, f"the peer copy cannot be read ({why})", uri=self.uri
        )


__all__ = ["PeerMemory", "PeerReader", "PeerSender"]
