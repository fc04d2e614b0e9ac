"""Peer memory within its budget, on real Ray clusters: the plan's per-node figure
against what the keepers hold, the degrade order at a short budget, a slow keeper
never forgotten, a rank's host memory bounded when uploads fall behind saves, and two
node losses in a row restored from peers at the tightest budget the plan says fits."""

from __future__ import annotations

import contextlib
import io
import threading
import time
from collections import defaultdict

import psutil
import pytest

from conftest import init_local_ray, tiny_spec
from spotline.testing import SpotCluster, SpotClusterConfig, wait_for


def _events(run, **wait) -> tuple[object, list[str]]:
    """Wait for the job; its result and every event it said."""
    out = io.StringIO()
    result = run.wait(verbose=True, out=out, **wait)
    prefix = f"[spotline {run.spec.name}] "
    return result, [line.removeprefix(prefix) for line in out.getvalue().splitlines()]


def _held_by_step(job: str) -> dict[tuple[str, int], dict[int, int]]:
    """(attempt, step) -> {rank: bytes} of what this node's keeper holds."""
    import ray

    from spotline.runtime.keeper import keeper_name

    node = ray.get_runtime_context().get_node_id()  # one node: the driver's
    keeper = ray.get_actor(keeper_name(job, node))
    out: dict[tuple[str, int], dict[int, int]] = defaultdict(dict)
    for c in ray.get(keeper.holdings.remote()):
        out[(c["attempt"], c["step"])][c["rank"]] = sum(size for _, size, _ in c["files"])
    return out


@pytest.mark.ray
def test_the_plans_keeper_bytes_per_node_match_what_the_keeper_holds(ray_session, tmp_path):
    import spotline
    from spotline.planning.peer_memory import node_peer_memory

    spec = tiny_spec(
        tmp_path,
        "peer-plan",
        **{"train.steps": 400, "recovery.peer_interval_steps": 3, "checkpoint.interval_steps": 100},
    )
    run = spotline.Job(spec).start()
    try:
        wait_for(
            run,
            lambda st: ((st.get("peer_memory") or {}).get("copies") or 0) >= 3,
            "3 peer copies",
            240,
        )
        held = _held_by_step(spec.name)
    finally:
        run.stop()
    # Every rank's copy of a step is there, and at most two steps of each rank: the
    # settled one and the one arriving.
    complete = [by_rank for by_rank in held.values() if len(by_rank) == 4]
    assert complete, held
    per_rank = defaultdict(int)
    for (_, _), by_rank in held.items():
        for rank in by_rank:
            per_rank[rank] += 1
    assert max(per_rank.values()) <= 2, held
    # The plan: all four ranks on this one node, no buddy node.
    plan = node_peer_memory(spec, 2, ranks_per_node=4, node_ram=None)
    measured = sum(complete[-1].values())
    assert plan.buddy == 0 and abs(measured - plan.own) <= 0.1 * plan.own, (measured, plan)


@pytest.mark.ray
@pytest.mark.parametrize(
    ("copies", "level"),
    [(2.5, "one kept step, on own and buddy nodes"), (1.5, "no peer snapshots")],
)
def test_a_short_budget_degrades_in_order_and_the_job_trains_on(
    ray_session, tmp_path, copies, level
):
    """A budget of `copies` copies of the node's state (and the keeper's heap): two and
    a half hold one kept step and the next arriving, one and a half hold none."""
    import spotline
    from spotline import constants
    from spotline.planning.peer_memory import node_peer_memory

    base = tiny_spec(tmp_path, "peer-short")
    one = node_peer_memory(base, 2, ranks_per_node=4, node_ram=None).own
    budget = int(one * copies) + constants.SPOTLINE_KEEPER_HEAP_BYTES
    spec = tiny_spec(
        tmp_path,
        "peer-short",
        **{
            "train.steps": 40,
            "recovery.peer_interval_steps": 2,
            "recovery.peer_memory": str(budget),
        },
    )
    result, events = _events(spotline.Job(spec).start())
    assert result.state == "finished" and result.steps == 40
    said = [e for e in events if e.startswith("peer memory:")]
    assert len(said) == 1 and level in said[0] and "recovery.peer_memory" in said[0], said
    assert result.peer_memory["level"] == level
    if level == "no peer snapshots":
        assert result.peer_memory["copies"] == 0
    else:
        assert result.peer_memory["copies"] >= 5 and not result.peer_memory["errors"]


@pytest.mark.ray
def test_a_slow_keeper_is_never_forgotten_and_its_copies_go_with_the_job(
    ray_session, tmp_path, monkeypatch
):
    import ray

    from spotline.runtime import peers as peer_memory
    from spotline.runtime.keeper import StateKeeper
    from spotline.runtime.peers import PeerMemory

    gate = tmp_path / "slow"
    gate.touch()

    class SlowKeeper(StateKeeper):  # busy receiving a copy while the gate file exists
        def put(self, copy, blobs):
            while gate.exists():
                time.sleep(0.05)
            return super().put(copy, blobs)

        def holdings(self):
            if (gate.parent / "mute").exists():
                time.sleep(3.0)  # a question that takes longer than it may
            return super().holdings()

    spec = tiny_spec(tmp_path, "slow-keeper")
    peers = PeerMemory(spec, keeper_cls=SlowKeeper)
    node = ray.get_runtime_context().get_node_id()
    try:
        (own, buddy), _ = peers.place([node, node], replicas=1)  # 2 stages, 1 replica
        assert buddy is None
        handle = ray.get_actor(own)
        copy = {"attempt": "g1", "step": 3, "rank": 0, "world_size": 1,
                "files": [["a-g1/rank_00000/f", 4, "0" * 64]], "index": []}  # fmt: skip
        put = handle.put.remote(copy, {"a-g1/rank_00000/f": b"abcd"})
        # The keeper answers while the copy arrives (its own thread), holding nothing
        # complete yet, and stays known.
        assert peers.held() == [] and node in peers._keepers
        monkeypatch.setattr(peer_memory, "ASK_TIMEOUT_S", 1.0)
        (gate.parent / "mute").touch()
        assert peers.held() == [] and node in peers._keepers  # no answer: left out, kept
        (gate.parent / "mute").unlink()
        gate.unlink()
        assert ray.get(put) == 4
        assert [c.step for _, c in peers.held()] == [3]
    finally:
        peers.close()
    # The job's end ends it, and its memory with it. A kill takes effect a moment after
    # it is sent: a question sent at once may still be answered, later ones are not.
    deadline = time.monotonic() + 30
    with pytest.raises(ray.exceptions.RayActorError):
        while time.monotonic() < deadline:
            ray.get(handle.nbytes.remote(), timeout=30)
            time.sleep(0.2)


@pytest.mark.ray
def test_uploads_slower_than_saves_skip_checkpoints_and_hold_host_memory(ray_session, tmp_path):
    """Saves every 2 steps, uploads at 5 MB/s: without a bound each rank would queue a
    host snapshot per save; with it, a periodic save while one uploads is skipped on
    every rank, said once, and the final checkpoint still commits."""
    import spotline

    spec = tiny_spec(
        tmp_path,
        "slow-upload",
        **{
            "model.d_model": 512,
            "train.steps": 60,
            "checkpoint.interval_steps": 2,
            "checkpoint.upload_max_mb_per_s": 5,
            "recovery.peer_snapshots": False,
        },
    )
    run = spotline.Job(spec).start()
    rss: dict[int, list[int]] = defaultdict(list)
    done = threading.Event()

    def sample() -> None:  # every rank's resident memory once its optimizer state exists
        while not done.is_set():
            st = run.status()
            for w in st.get("workers") or [] if st["step"] >= 4 else []:
                with contextlib.suppress(psutil.Error):  # it ended meanwhile
                    rss[w["pid"]].append(psutil.Process(w["pid"]).memory_info().rss)
            time.sleep(0.25)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result, events = _events(run)
    finally:
        done.set()
        sampler.join()
    assert result.state == "finished", result.error
    assert result.committed_steps[-1] == 60
    skipped = result.skipped_saves
    assert skipped and all(s % 2 == 0 and s < 60 for s in skipped)
    said = [e for e in events if "skipped: a rank was still uploading" in e]
    assert len(said) == 1 and "checkpoint.interval_steps" in said[0]
    # One snapshot of a rank is about 12 bytes a parameter over its replicas' share; the
    # growth of its resident memory over the run stays within a few of them.
    from spotline.planning.peer_memory import rank_copy_bytes

    snap = max(rank_copy_bytes(spec, 2))
    grew = [max(xs) - xs[0] for xs in rss.values() if len(xs) > 4]
    assert grew and max(grew) < 6 * snap + 64e6, (grew, snap)


# --- two losses in a row at the tightest budget -------------------------------------------


@pytest.fixture
def three_nodes():
    """Three one-slot spot nodes (`spotline.testing`), off the suite's local cluster,
    which is put back after."""
    import ray

    had = ray.is_initialized()
    ray.shutdown()
    cluster = SpotCluster(SpotClusterConfig(nodes=3, slots=1, cpus=1.0))
    try:
        yield cluster
    finally:
        cluster.close()
        if had:
            init_local_ray()


def _keepers(st: dict) -> dict:
    """Each live keeper's own account (`StateKeeper.memory`), by node."""
    import ray

    out = {}
    for f in (st.get("peer_memory") or {}).get("nodes") or []:
        with contextlib.suppress(Exception):  # a lost node's keeper is gone
            out[f["node"]] = ray.get(ray.get_actor(f["keeper"]).memory.remote(), timeout=10)
    return out


@pytest.mark.chaos
def test_two_losses_in_a_row_restore_from_peers_at_the_tightest_budget_the_plan_fits(
    three_nodes, tmp_path
):
    """One rank a node on three nodes, no commit to fall back to, recovery.peer_memory at
    what `spotline plan` says a node needs: a node goes, the two left restore from peer
    memory and keep copies of their own; another goes, and the last one restores from
    peer memory again. No keeper refused a copy, none held more than its budget, and
    their processes' measured memory stayed within it."""
    from spotline.planning.plan import make_plan

    over = {
        "model.d_model": 128,
        "parallel.pipeline_stages": 1,
        "resources.stages": [{"resources": {"spot_gpu": 1}}],
        "resources.ranks_per_node": 1,
        "elastic.min_replicas": 1,
        "elastic.max_replicas": 3,
        "elastic.wait_for_capacity_s": 60,
        "train.global_batch_size": 12,
        "train.steps": 100_000,
        "checkpoint.interval_steps": 100_000,
        "recovery.peer_interval_steps": 4,
    }
    plan = make_plan(tiny_spec(tmp_path, "peer-twice", **over), node=(1, None)).peer_memory
    budget = plan.full  # the tightest that fits: two steps, buddies, every shape
    spec = tiny_spec(tmp_path, "peer-twice", **over, **{"recovery.peer_memory": str(budget)})
    run = three_nodes.run(spec, adapt=False)
    try:
        for replicas in (3, 2, 1):

            def copies(st, replicas=replicas):
                """This group restored from peers (after a loss), and copies of 8 steps
                past where it started went out."""
                pm = st.get("peer_memory") or {}
                restores = pm.get("restores") or []
                start = restores[-1]["step"] if restores else 0
                return (
                    st["replicas"] == replicas
                    and len(restores) == 3 - replicas
                    and (pm.get("newest_step") or 0) >= start + 8
                )

            st = wait_for(run, copies, f"peer copies at {replicas} replica(s)", 240)
            if replicas == 1:
                break
            node = next(w["node_id"] for w in st["workers"] if w["rank"] == replicas - 1)
            three_nodes.lose(three_nodes.cluster.number(node))
        held = _keepers(st)
        result = run.stop()
    finally:
        with contextlib.suppress(Exception):
            run.stop()
    ran = [a for a in result.attempts if a["device"]]  # a group lost while it started: none
    assert len(ran) == 3, result.attempts
    second, third = ran[1], ran[2]
    print("peer-twice", budget, plan.render(), result.peer_memory, held, sep="\n")
    for a in (second, third):
        assert a["restored_via"] == "peer memory" and a["restored_bytes"] > 0, a
    assert third["restored_attempt"] == second["attempt"]
    assert [r["step"] for r in result.peer_memory["restores"]] == [
        second["restored_from"],
        third["restored_from"],
    ]
    assert not result.peer_memory["errors"], result.peer_memory
    assert held and all(m["peak"] <= budget and m["budget"] == budget for m in held.values())
    for m in held.values():
        # Its process measured: the copies' maps and the object store's pages it mapped
        # (both shared memory), and its own heap's growth, within what it counted.
        start, peak = m["rss_start"], m["rss_peak"]
        assert peak["anon"] - start["anon"] <= m["heap"], m
        assert peak["anon_shmem"] - start["anon"] - start["shmem"] <= m["peak"] <= budget, m
