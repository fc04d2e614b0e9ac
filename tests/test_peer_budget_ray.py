"""Peer memory within its budget, on a real local Ray cluster: the plan's per-node figure
against what the keepers hold, the degrade order at a short budget, a slow keeper
never forgotten, and a rank's host memory bounded when uploads fall behind saves."""

from __future__ import annotations

import contextlib
import io
import threading
import time
from collections import defaultdict

import psutil
import pytest

from conftest import tiny_spec
from spotline.testing import wait_for

pytestmark = pytest.mark.ray


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


@pytest.mark.parametrize(
    ("share_of_one_copy", "level"),
    [(1.5, "one kept step, on own and buddy nodes"), (0.5, "no peer snapshots")],
)
def test_a_short_budget_degrades_in_order_and_the_job_trains_on(
    ray_session, tmp_path, share_of_one_copy, level
):
    import spotline
    from spotline.planning.peer_memory import node_peer_memory

    base = tiny_spec(tmp_path, "peer-short")
    one = node_peer_memory(base, 2, ranks_per_node=4, node_ram=None).own
    spec = tiny_spec(
        tmp_path,
        "peer-short",
        **{
            "train.steps": 40,
            "recovery.peer_interval_steps": 2,
            "recovery.peer_memory": str(int(one * share_of_one_copy)),
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
