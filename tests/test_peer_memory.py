"""Peer memory without Ray: a rank's peer copy is exactly its checkpoint's files, a
keeper holds and serves them within its level and budget (which counts what the node
holds), the newest step every rank left complete is found (and never a step mixed
from two groups), and the step a restore reads stays until it is read, through two
losses in a row at the tightest budget the plan fits. The controller's side: k, and
what it says, is `test_peer_recovery.py`."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch

from spotline import constants
from spotline.checkpoint.layout import FORMAT, RankSnapshot, write_rank
from spotline.checkpoint.peer import PEER_KEY, PeerCopy, newest_complete, peer_copy
from spotline.checkpoint.reshard import Plan
from spotline.config import load_spec
from spotline.runtime.keeper import KeeperFull, StateKeeper

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _no_keeper_heap(monkeypatch):
    """The figures here are bytes of copies alone; `test_the_keepers_heap_is_counted`
    puts the keeper process's working heap back."""
    monkeypatch.setattr(constants, "SPOTLINE_KEEPER_HEAP_BYTES", 0)


FULL = {
    "fp32": torch.arange(8, dtype=torch.float32) / 7,
    "exp_avg": torch.linspace(-1, 1, 8),
    "exp_avg_sq": torch.linspace(0, 2, 8) ** 2,
}


def _spec(**recovery):
    return load_spec({"name": "peer", "recovery": recovery})


def _snap(rank: int, step: int) -> RankSnapshot:
    """Rank `rank` of 2 owns half of one parameter's fp32 master and Adam moments."""
    lo = 4 * rank
    tensors, entries = {}, []
    for kind, full in FULL.items():
        key = f"w/{kind}/{lo}"
        tensors[key] = full[lo : lo + 4].clone()
        entries.append(
            {"key": key, "param": "w", "kind": kind, "start": lo, "numel": 4, "shape": [8],
             "dtype": "float32", "rank": rank}
        )  # fmt: skip
    return RankSnapshot(tensors, entries, {"format": FORMAT, "step": step})


def _rank_files(tmp: Path, rank: int, step: int):
    out = tmp / f"s{step}" / f"r{rank}"
    return out, write_rank(_snap(rank, step), out, root=out)


def _keep(keeper: StateKeeper, tmp: Path, attempt: str, rank: int, step: int, world: int = 2):
    local, written = _rank_files(tmp, rank, step)
    losses = [(s, 3.0 - s / 10) for s in range(1, step + 2)] if rank == 0 else []
    copy, blobs = peer_copy(attempt, rank, world, step, local, written, None, losses)
    keeper.put(copy.to_dict(), blobs)
    return local, written


def _held(*keepers: tuple[str, StateKeeper]) -> list[tuple[str, PeerCopy]]:
    return [(name, PeerCopy.from_dict(c)) for name, k in keepers for c in k.holdings()]


def test_a_peer_copy_reads_back_bit_exact_through_the_checkpoint_reads(tmp_path: Path):
    a, b = StateKeeper(), StateKeeper()
    for rank, own, buddy in ((0, a, b), (1, b, a)):
        local, written = _rank_files(tmp_path, rank, 6)
        copy, blobs = peer_copy("g1", rank, 2, 6, local, written)
        for keeper in (own, buddy):
            keeper.put(copy.to_dict(), blobs)
        # The copy is the files the save wrote, byte for byte, mapped (not read).
        assert {p: bytes(b) for p, b in blobs.items()} == {
            f"a-g1/rank_{rank:05d}/{rel}": (local / rel).read_bytes() for rel in written.files
        }
    offer = newest_complete(_spec(), _held(("A", a), ("B", b)), "g1", 2)
    assert offer is not None and offer.step == 6 and offer.attempt == "g1"
    assert offer.manifest.extra[PEER_KEY]["holders"] == {
        "a-g1/rank_00000": ["A", "B"],
        "a-g1/rank_00001": ["A", "B"],
    }
    assert {f.path for f in offer.manifest.files} == {
        f"a-g1/rank_{r:05d}/{n}" for r in (0, 1) for n in ("state.safetensors", "meta.json")
    }

    # The reshard planner reads it from the keeper (every chunk sha256-verified) and
    # assembles each full tensor exactly: here with rank 0's keeper lost.
    def read(entry: dict, start: int, length: int) -> bytes:
        return b.read("g1", 6, entry["file"], entry["offset"] + start, length)

    plan = Plan(offer.manifest.extra["index"])
    plan.param("w", (8,))
    for kind in FULL:
        plan.need("w", kind, 0, 8)
    got = plan.read(read)
    for kind, full in FULL.items():
        assert torch.equal(got.all("w", kind), full)


def test_a_changed_byte_in_a_peer_copy_is_refused_by_the_verified_read(tmp_path: Path):
    from spotline.checkpoint.layout import CheckpointFormatError

    keeper = StateKeeper()
    for rank in (0, 1):
        _keep(keeper, tmp_path, "g1", rank, 4)
    offer = newest_complete(_spec(), _held(("A", keeper)), "g1", 2)
    entry = offer.manifest.extra["index"][0]
    held = keeper._copies[("g1", 0, 4)]  # a bit flipped in the keeper's memory
    at = held.spans[entry["file"]][0] + entry["offset"]
    held.region[at] ^= 0xFF

    plan = Plan(offer.manifest.extra["index"])
    plan.param("w", (8,))
    plan.need("w", "fp32", 0, 8)
    with pytest.raises(CheckpointFormatError, match="sha256"):
        plan.read(lambda e, s, n: keeper.read("g1", 4, e["file"], e["offset"] + s, n))


def test_only_a_step_every_rank_of_one_group_left_is_offered(tmp_path: Path):
    a, b = StateKeeper(), StateKeeper()
    _keep(a, tmp_path, "g1", 0, 4)
    _keep(b, tmp_path, "g1", 1, 4)
    _keep(a, tmp_path, "g1", 0, 8)  # rank 1's copy of step 8 never arrived
    _keep(b, tmp_path, "g2", 1, 12)  # another group's: never mixed in
    _keep(b, tmp_path, "g1", 1, 12, world=4)  # another world size: never counted
    spec = _spec()
    offer = newest_complete(spec, _held(("A", a), ("B", b)), "g1", 2)
    assert offer.step == 4
    # Rank 0's losses up to the step travel with it (a later step's never).
    assert offer.losses == [(s, 3.0 - s / 10) for s in range(1, 5)]
    assert newest_complete(spec, _held(("A", a)), "g1", 2) is None  # B's node is gone
    assert newest_complete(spec, _held(("A", a), ("B", b)), "g2", 2) is None
    assert newest_complete(spec, _held(("A", a), ("B", b)), "g1", 2, at=8) is None
    assert newest_complete(spec, _held(("A", a), ("B", b)), "g1", 2, at=4).step == 4


def _steps(keeper: StateKeeper) -> list[tuple[str, int, int]]:
    return sorted((c["attempt"], c["rank"], c["step"]) for c in keeper.holdings())


def test_a_keeper_holds_the_settled_step_and_the_one_arriving(tmp_path: Path):
    keeper = StateKeeper()
    for step in (2, 4, 6):
        _keep(keeper, tmp_path, "g1", 0, step)
    # Nothing settled yet: the newest copy stands in for the complete one.
    assert _steps(keeper) == [("g1", 0, 4), ("g1", 0, 6)]
    keeper.settle("g1", 4)  # every rank has step 4 in all its keepers
    assert _steps(keeper) == [("g1", 0, 4), ("g1", 0, 6)]
    _keep(keeper, tmp_path, "g1", 0, 8)  # 6 never settled: the settled 4 stays beside it
    assert _steps(keeper) == [("g1", 0, 4), ("g1", 0, 8)]
    one = keeper.nbytes() // 2
    # Never three rooms at once: the unsettled 6 went before step 8 took its room; the
    # third copy counted is step 8's bytes in the object store while they arrived.
    assert keeper.peak_nbytes() == 3 * one
    # A new group's copies beside the old one's, until the new one settles a step.
    _keep(keeper, tmp_path, "g2", 1, 2)
    assert _steps(keeper)[-1] == ("g2", 1, 2)
    assert keeper.settle("g2", 2) == one  # every older group's copies go
    assert _steps(keeper) == [("g2", 1, 2)]
    with pytest.raises(KeyError):
        keeper.read("g1", 8, "a-g1/rank_00000/meta.json", 0, 1)
    assert keeper.retain(["g3"]) == 0 and keeper.holdings() == []
    # A high-water mark (dropping keeps it): g1's two copies beside g2's first one and
    # its transit.
    assert keeper.peak_nbytes() == 4 * one
    local, written = _rank_files(tmp_path, 1, 8)
    copy, blobs = peer_copy("g2", 1, 2, 8, local, written)
    blobs.pop(next(iter(blobs)))
    with pytest.raises(ValueError, match="names other files"):
        keeper.put(copy.to_dict(), blobs)


def test_a_keeper_at_one_step_holds_one_copy_and_refuses_one_over_its_budget(tmp_path: Path):
    keeper = StateKeeper()
    _keep(keeper, tmp_path, "g1", 0, 2)
    _keep(keeper, tmp_path, "g1", 0, 4)
    one = keeper.nbytes() // 2
    # The budget is short: one kept step (and its successor's transit). What no longer
    # fits goes at once.
    assert keeper.configure(1, 2 * one) == one and _steps(keeper) == [("g1", 0, 4)]
    _keep(keeper, tmp_path, "g1", 0, 6)  # replaces it: never two at one step
    assert _steps(keeper) == [("g1", 0, 6)] and keeper.nbytes() == one
    # Another rank's copy would take it over the budget: refused, nothing dropped.
    with pytest.raises(KeeperFull, match=r"budget is .*\(recovery\.peer_memory\)"):
        _keep(keeper, tmp_path, "g1", 1, 6)
    assert _steps(keeper) == [("g1", 0, 6)]
    read = keeper.read("g1", 6, "a-g1/rank_00000/meta.json", 0, 5)
    assert read == (tmp_path / "s6" / "r0" / "meta.json").read_bytes()[:5]


def test_a_peer_only_copy_is_written_and_handed_over_but_never_uploaded(tmp_path: Path):
    from spotline.checkpoint import CheckpointStore
    from spotline.checkpoint.transfer import Uploader

    spec = load_spec({"name": "peer", "checkpoint": {"uri": f"file://{tmp_path}/ckpt"}})
    store = CheckpointStore(spec.resolved_checkpoint_uri())
    up = Uploader(store, spec, 0, 2, "g1")
    got: list = []
    gate = threading.Event()

    def peer(step, local, written, batch, losses):
        got.append((step, sorted(written.files), (local / "meta.json").exists(), losses))
        gate.wait(10)
        return {"step": step, "nbytes": 1}

    def write(out: Path):
        return write_rank(_snap(0, 5), out, root=out)

    assert not up.submit_peer(5, tmp_path / "p5", write, None)  # no keepers: no copy
    up.peer = peer
    assert up.submit_peer(5, tmp_path / "p5", write, None, [(4, 2.5), (5, 2.4)])
    assert not up.submit_peer(6, tmp_path / "p6", write, None)  # busy: skipped, not queued
    gate.set()
    assert up.wait(10)
    assert got == [(5, ["meta.json", "state.safetensors"], True, [(4, 2.5), (5, 2.4)])]
    (report,) = up.take_peer_done()
    assert report["step"] == 5 and report["with_save"] is False and report["total_s"] >= 0
    assert up.take_done() == [] and store.uncommitted_steps() == []
    assert not (tmp_path / "p5").exists()  # staging holds nothing once handed over


def test_a_rank_leaving_its_group_drops_the_saves_still_queued(tmp_path: Path):
    """`Uploader.close`: the save in hand finishes, the queued ones never upload (they
    are the old group's steps), and the uploader reports itself idle."""
    from spotline.checkpoint import CheckpointStore
    from spotline.checkpoint.transfer import Uploader

    spec = load_spec({"name": "leave", "checkpoint": {"uri": f"file://{tmp_path}/ckpt"}})
    store = CheckpointStore(spec.resolved_checkpoint_uri())
    up = Uploader(store, spec, 0, 1, "g1")
    gate, entered = threading.Event(), threading.Event()
    wrote: list[int] = []

    def write(step):
        def w(out: Path):
            entered.set()
            gate.wait(10)
            wrote.append(step)
            return write_rank(_snap(0, step), out, root=out)

        return w

    for step in (5, 6, 7):
        up.submit(step, tmp_path / f"s{step}", write(step))
    assert entered.wait(10)  # step 5 is in hand
    up.close()
    gate.set()
    assert up.wait(10)
    up._thread.join(10)
    assert not up._thread.is_alive()
    assert wrote == [5]  # the one in hand when the rank left
    assert [r.step for r in up.take_done()] == [5]


def test_surviving_replicas_take_the_first_indices_and_the_rest_end(monkeypatch):
    """`adopt`: survivors fill replica 0, 1, ... in the order they come; one past the
    new size, one that ran on another device kind, or one on an avoided node ends."""
    from spotline.runtime import survivors
    from spotline.runtime.survivors import Survivor, Survivors, adopt

    ended: list[tuple[list, list]] = []  # what `end` was given (it kills with Ray)
    monkeypatch.setattr(survivors, "end", lambda actors, pgs: ended.append((actors, pgs)))

    def replica(node: str, device: str = "cpu") -> Survivor:
        infos = [{"node_id": node, "device": device, "pid": 1}] * 2
        return Survivor(actors=[object(), object()], pg=None, infos=infos)

    a, b, c, gpu, cordoned = (
        replica("a"),
        replica("b"),
        replica("c"),
        replica("d", "gpu"),
        replica("e"),
    )
    held = Survivors([gpu, a, cordoned, b, c])
    assert held.devices() == 10
    got = adopt(held, replicas=2, device="cpu", avoid={"e"})
    assert got == {0: a, 1: b}
    rest = [gpu, cordoned, c]
    assert ended == [([x for sv in rest for x in sv.actors], [sv.pg for sv in rest])]
    assert adopt(Survivors([a]), replicas=3, device="gpu", avoid=set()) == {}
    assert ended[-1] == (a.actors, [a.pg])


def test_leaving_a_process_group_forgets_deepspeeds_groups():
    """A re-formed rank joins a new world in the same process: DeepSpeed's cached
    groups and its backend handle must not carry the old one's over."""
    import deepspeed.comm.comm as dcomm
    from deepspeed.utils import groups

    from spotline.train.process import leave_distributed

    groups._DATA_PARALLEL_GROUP = object()  # the old world's groups and backend
    groups._EXPERT_PARALLEL_GROUP = {"e": object()}
    dcomm.cdb = object()
    leave_distributed()
    assert groups._DATA_PARALLEL_GROUP is None and groups._EXPERT_PARALLEL_GROUP == {}
    assert dcomm.cdb is None
    assert isinstance(groups._DEVICE_MESH_SPLIT_UNSUPPORTED, str)  # a constant stays


# --- the budget: what a node's keeper holds, and the degrade order ----------------------


def test_levels_degrade_in_the_stated_order():
    from spotline.planning.peer_memory import LEVELS, fit_level

    own, buddy = 100, 80
    # Kept steps, and one copy more: the one arriving, in the object store.
    assert [lv.need(own, buddy) for lv in LEVELS] == [540, 360, 200, 0]
    assert [lv.held(own, buddy) for lv in LEVELS] == [360, 180, 100, 0]
    assert fit_level(own, buddy, None) == LEVELS[0]  # unknown budget: the fullest
    assert fit_level(own, buddy, 540) == LEVELS[0]
    assert fit_level(own, buddy, 539).describe() == "one kept step, on own and buddy nodes"
    assert fit_level(own, buddy, 359).describe() == "one kept step, on own node only"
    assert fit_level(own, buddy, 199).describe() == "no peer snapshots"
    # Around a restore: the source's step, its reads; with two steps the new group's
    # first copy (room and transit) beside it.
    assert LEVELS[0].restore(150, own, buddy) == 150 + 2 * 180
    assert LEVELS[1].restore(150, own, buddy) == 150 + 2 * 150


def test_a_nodes_keeper_holds_its_own_ranks_and_the_previous_nodes():
    from spotline.planning.checkpoint_time import checkpoint_bytes
    from spotline.planning.peer_memory import (
        PLAN_MARGIN,
        node_peer_memory,
        node_ranks,
        rank_copy_bytes,
    )

    # A replica's stages are packed together; nodes fill up in replica order.
    assert node_ranks(2, 4, 4) == [[0, 4, 1, 5], [2, 6, 3, 7]]
    spec = _spec(**{"peer_memory": "1GB"})
    spec = load_spec({"name": "peer", "parallel": {"pipeline_stages": 2},
                      "elastic": {"min_replicas": 4, "max_replicas": 4},
                      "recovery": {"peer_memory": "1GB"}})  # fmt: skip
    raw = rank_copy_bytes(spec, 4)
    # Every copy together is one checkpoint (plus each rank's meta file).
    assert 1.0 <= sum(raw) / checkpoint_bytes(spec) < 1.5
    # The plan rounds each predicted copy up a little: it never plans under a copy.
    per_rank = [math.ceil(b * (1 + PLAN_MARGIN)) for b in raw]
    one_node = node_peer_memory(spec, 4, ranks_per_node=8, node_ram=None)
    assert (one_node.own, one_node.buddy) == (sum(per_rank), 0)
    two = node_peer_memory(spec, 4, ranks_per_node=4, node_ram=None)
    halves = sorted(
        [sum(per_rank[r] for r in (0, 4, 1, 5)), sum(per_rank[r] for r in (2, 6, 3, 7))]
    )
    assert sorted([two.own, two.buddy]) == halves
    assert two.budget == 1_000_000_000 and two.level.steps == 2
    # A share of the node's RAM: 25% of 1 MB cannot hold them.
    tight = load_spec({"name": "peer", "recovery": {"peer_memory": 0.25}})
    assert node_peer_memory(tight, 2, 4, node_ram=10**6).level.describe() == "no peer snapshots"
    assert "does NOT fit" in node_peer_memory(tight, 2, 4, node_ram=10**6).render()


def test_the_placement_takes_the_level_the_tightest_node_allows():
    """`PeerMemory.fit` (no Ray): every node's keeper within its own budget, and the
    level said once with the busiest node's figures and the field to change."""
    from spotline.runtime.peers import PeerMemory

    peers = PeerMemory(load_spec({"name": "peer", "recovery": {"peer_memory": 0.5}}))
    nodes = ["a", "a", "b", "b", "c"]
    sizes = [100, 100, 100, 100, 300]
    # c holds its own 300 and b's 200 (its buddy): two steps and one arriving, 1500.
    ram = {"a": 10_000, "b": 10_000, "c": 3_000}
    assert peers.fit(nodes, sizes, ram).describe() == "two kept steps, on own and buddy nodes"
    # What each keeper reserves from Ray: its two steps (the transit is the store's).
    assert {f["node"]: f["reserve"] for f in peers.fits} == {"a": 1000, "b": 800, "c": 1000}
    ram["c"] = 2_000  # a budget of 1000: one kept step
    level = peers.fit(nodes, sizes, ram)
    assert level.describe() == "one kept step, on own and buddy nodes"
    peers._set_level(level)
    (said,) = peers.take_changes()
    assert said.startswith("peer memory: node c's keeper holds up to 1.5 kB (two steps of 300 B")
    assert "over its budget of 1.0 kB of 2.0 kB RAM (recovery.peer_memory)" in said
    peers._set_level(level)
    assert peers.take_changes() == []  # said once
    ram["c"] = 1_200  # 600: only its own ranks' copies, one step
    assert peers.fit(nodes, sizes, ram).describe() == "one kept step, on own node only"
    assert {f["node"]: f["need"] for f in peers.fits} == {"a": 400, "b": 400, "c": 600}


# --- after a restore: the offered step, the source, and the budget ---------------------


def _put(keeper: StateKeeper, attempt: str, rank: int, step: int, size: int, world: int):
    path = f"a-{attempt}/rank_{rank:05d}/state.safetensors"
    copy = {"attempt": attempt, "step": step, "rank": rank, "world_size": world,
            "files": [[path, size, "0" * 64]], "index": []}  # fmt: skip
    return keeper.put(copy, {path: bytes([rank + 1]) * size})


def _complete(keepers: dict, attempt: str, world: int) -> int | None:
    """The newest step of `attempt` whose every rank's copy some live keeper holds."""
    have: dict[int, set[int]] = {}
    for k in keepers.values():
        for c in k.holdings():
            if c["attempt"] == attempt:
                have.setdefault(c["step"], set()).add(c["rank"])
    return max((s for s, ranks in have.items() if len(ranks) == world), default=None)


def test_two_losses_in_a_row_restore_from_peers_at_the_tightest_budget_the_plan_fits():
    """Three one-rank nodes, then two, then one (the ZeRO share of each rank grows as
    the group shrinks), at the budget `spotline plan` says fits: every copy is taken,
    a complete step of the line stands at every moment, and both losses find one."""
    from spotline.planning.peer_memory import LEVELS, NodePeerMemory

    size = {3: 3000, 2: 4500, 1: 9000}  # one rank's copy at each replica count
    shapes = {3: (3000, 3000), 2: (4500, 4500), 1: (9000, 0)}
    plan = NodePeerMemory(3000, 3000, None, None, LEVELS[0], shapes)
    budget = plan.full
    assert budget == 27_000 and plan.restore_peak <= budget  # 3 x (4500 + 4500)
    keepers = {n: StateKeeper(budget, 2, node=n) for n in "xyz"}
    source: tuple[str, int] | None = None  # the step the group restored from

    def train(attempt: str, nodes: list[str], steps: range, partial: int | None = None):
        """Copies of `steps` (each rank to its node's keeper and the next one's), each
        step settled once all are in; `partial`: a last step only rank 0 sent."""
        world = len(nodes)
        for step in steps:
            for rank, node in enumerate(nodes):
                for n in {node, nodes[(rank + 1) % world]}:
                    _put(keepers[n], attempt, rank, step, size[world], world)
                    # A loss now would find a step of this line complete in memory.
                    assert _complete(keepers, attempt, world) or source or step == steps[0]
            for k in keepers.values():
                k.settle(attempt, step)
        if partial is not None:
            _put(keepers[nodes[0]], attempt, 0, partial, size[world], world)

    def lose_and_restore(lost: str, old: str, world: int, new: str) -> int:
        nonlocal source
        del keepers[lost]
        step = _complete(keepers, old, world) or (source[1] if source else None)
        assert step is not None, "no step of the line is complete in live memory"
        at = old if _complete(keepers, old, world) else source[0]
        for k in keepers.values():  # pinned at the offer, before the placement
            k.hold(at, step)
            k.configure(2, budget)
        # The restore reads every rank's copy; then the new group's keepers keep only
        # its own copies and the source.
        for rank in range(world):
            path = f"a-{at}/rank_{rank:05d}/state.safetensors"
            holder = next(k for k in keepers.values() if any(
                c["rank"] == rank and c["attempt"] == at for c in k.holdings()))  # fmt: skip
            assert holder.read(at, step, path, 0, 4) == bytes([rank + 1]) * 4
        for k in keepers.values():
            k.retain([new, at])
        source = (at, step)
        return step

    train("g1", ["x", "y", "z"], range(10, 60, 10), partial=60)
    assert lose_and_restore("z", "g1", 3, "g2") == 50
    train("g2", ["x", "y"], range(60, 90, 10))
    # The source went once g2 settled a step of its own: only g2's copies are held.
    assert {c["attempt"] for k in keepers.values() for c in k.holdings()} == {"g2"}
    assert lose_and_restore("y", "g2", 2, "g3") == 80
    train("g3", ["x"], range(90, 120, 10))
    assert max(k.peak_nbytes() for k in keepers.values()) <= budget


def test_the_offered_step_is_never_pruned_before_the_restore_reads_it():
    keeper = StateKeeper(None, 2, node="x")
    for step in (10, 20):
        for rank in (0, 1):
            _put(keeper, "g1", rank, step, 100, 2)
    keeper.settle("g1", 20)
    _put(keeper, "g1", 0, 30, 100, 2)  # rank 1's copy of 30 never came: 20 is offered
    keeper.hold("g1", 20)  # the steps no restore reads go at once
    assert _steps(keeper) == [("g1", 0, 20), ("g1", 1, 20)]
    # The placement of the new group keeps one step: the pinned one stays.
    keeper.configure(1, 10_000)
    keeper.retain(["g2", "g1"])
    assert _steps(keeper) == [("g1", 0, 20), ("g1", 1, 20)]
    # The new group's first copy arrives while the source stands in; a second one
    # replaces it (the source is still the line's complete step) ...
    keeper.configure(2, 10_000)
    _put(keeper, "g2", 0, 21, 200, 1)
    _put(keeper, "g2", 0, 22, 200, 1)
    assert _steps(keeper) == [("g1", 0, 20), ("g1", 1, 20), ("g2", 0, 22)]
    # ... and a settle of the copy it replaced leaves the source standing.
    keeper.settle("g2", 21)
    assert ("g1", 0, 20) in _steps(keeper)
    keeper.settle("g2", 22)
    assert _steps(keeper) == [("g2", 0, 22)]


def test_a_short_budget_lets_the_source_go_before_it_refuses_the_new_groups_copy():
    keeper = StateKeeper(600, 2, node="x" * 20)
    for rank in (0, 1):
        _put(keeper, "g1", rank, 10, 100, 2)
    keeper.hold("g1", 10)
    keeper.retain(["g2", "g1"])
    # 200 held and 2 x 300 arriving is over 600: the source the group read goes.
    assert _put(keeper, "g2", 0, 11, 300, 1) == 300 and _steps(keeper) == [("g2", 0, 11)]
    with pytest.raises(KeeperFull) as e:  # nothing left to let go: refused, named
        _put(keeper, "g2", 1, 11, 300, 2)
    assert str(e.value).startswith("node xxxxxxxxxxxx's state keeper cannot take rank 1's")
    assert "budget is 600 B (recovery.peer_memory)" in str(e.value)


def test_a_read_copies_its_bytes_out_without_the_keepers_lock():
    keeper = StateKeeper()
    _put(keeper, "g1", 0, 10, 1000, 1)
    held = keeper._copies[("g1", 0, 10)]
    inside, go = threading.Event(), threading.Event()

    class Slow:  # the region, copying out until told to go on
        def __init__(self, region):
            self.region = region

        def __getitem__(self, key):
            inside.set()
            assert go.wait(30)
            return self.region[key]

        def close(self):
            self.region.close()

    held.region = Slow(held.region)
    out: list[bytes] = []
    reader = threading.Thread(
        target=lambda: out.append(keeper.read("g1", 10, "a-g1/rank_00000/state.safetensors", 0, 8))
    )
    reader.start()
    assert inside.wait(30)
    # While it copies: questions answer, and the copy is dropped without closing its map.
    assert len(keeper.holdings()) == 1 and keeper.retain([]) == 0
    assert held.region is not None
    go.set()
    reader.join(30)
    assert out == [b"\x01" * 8] and held.region is None  # closed once the read was out


def test_the_keepers_heap_is_counted_beside_its_copies(monkeypatch):
    from spotline.planning.peer_memory import LEVELS

    monkeypatch.setattr(constants, "SPOTLINE_KEEPER_HEAP_BYTES", 1000)
    assert [lv.need(100, 80) for lv in LEVELS] == [1540, 1360, 1200, 0]
    keeper = StateKeeper(1000 + 3 * 100, 2)
    _put(keeper, "g1", 0, 1, 100, 1)
    _put(keeper, "g1", 0, 2, 100, 1)
    assert keeper.peak_nbytes() == 1000 + 3 * 100
    with pytest.raises(KeeperFull):  # a third room and its transit: over by 100
        _put(keeper, "g1", 1, 2, 100, 2)
