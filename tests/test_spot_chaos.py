"""Spot capacity on a real multi-node Ray cluster (`ray.cluster_utils.Cluster`).

Two "spot" nodes hold one 2-stage replica apiece; the head holds none, like an
on-demand head. Each spot node offers two units of the custom resource `spot_gpu`,
which every worker asks for, as a GPU worker asks for a GPU: placement, draining and
node loss behave as on a GPU cluster, while the workers train on CPU with gloo
(`resources.device: cpu`; a `gpu` worker needs a torch that can use CUDA).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import spotline
from cluster_fixture import drain_node
from conftest import CLUSTER_ENV, init_local_ray, inject_faults, tiny_spec
from spotline.chaos.cluster import NODE_DEATH_CONFIG
from spotline.checkpoint import CheckpointStore
from spotline.compat.ray import draining_nodes, head_with_system_config
from spotline.testing import wait_for

pytestmark = pytest.mark.chaos

SPOT_NODE = {"num_cpus": 2, "resources": {"spot_gpu": 2}, "env_vars": CLUSTER_ENV}


def _free_port() -> int:
    """A port nothing listens on now (the dashboard binds it right after)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SpotCluster:
    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(
            initialize_head=True,
            # The dashboard serves Ray's state API (what is alive after a failure);
            # it listens on 127.0.0.1, on a port of its own: another Ray cluster on this
            # machine may hold the default one.
            # A removed node is declared dead in about 6 s, not 16: `reset` waits for
            # that before the next test.
            head_node_args=head_with_system_config(
                {
                    "num_cpus": 2,
                    "num_gpus": 0,
                    "include_dashboard": True,
                    "dashboard_port": _free_port(),
                    "env_vars": CLUSTER_ENV,
                },
                NODE_DEATH_CONFIG,
            ),
        )
        self.spot: list[Any] = []

    def node(self, node_id: str) -> Any:
        return next(n for n in self.spot if n.node_id == node_id)

    def reset(self, n_spot: int = 2, tries: int = 3) -> None:
        """Exactly `n_spot` healthy spot nodes: drop dead or draining ones, add fresh ones.

        A node whose raylet dies while the cluster waits for it to register (the GCS
        then never counts it) is dropped and replaced, up to `tries` times, each said on
        stderr: the nodes a test starts on are set-up, not what it tests."""
        import ray

        for attempt in range(1, tries + 1):
            alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            draining = set(draining_nodes(timeout_s=10))
            for n in list(self.spot):
                if n.node_id not in alive or n.node_id in draining or n.dead_processes():
                    self.remove(n)
            while len(self.spot) > n_spot:
                self.remove(self.spot[-1])
            while len(self.spot) < n_spot:
                self.spot.append(self.cluster.add_node(**SPOT_NODE))
            try:
                self.cluster.wait_for_nodes()
                return
            except TimeoutError:
                if attempt == tries:
                    raise
                dead = [n.node_id for n in self.spot if n.dead_processes()]
                print(f"spot node(s) {dead} died while registering; replacing", file=sys.stderr)

    def remove(self, node: Any) -> None:
        self.spot.remove(node)
        # A drained node may have exited by itself already.
        with contextlib.suppress(Exception):
            self.cluster.remove_node(node, allow_graceful=False)


@pytest.fixture(scope="module")
def spot_cluster():
    import ray

    had_local = ray.is_initialized()
    ray.shutdown()
    c = None
    try:
        c = SpotCluster()
        ray.init(
            address=c.cluster.address,
            log_to_driver=False,
            logging_level="WARNING",
        )
        yield c
    finally:
        # Even when this cluster failed to start: the session's own is started again,
        # or every later `ray` test would run on a bare cluster Ray starts by itself.
        ray.shutdown()
        if c is not None:
            c.cluster.shutdown()
        if had_local:
            init_local_ray()


@pytest.fixture
def cluster(spot_cluster: SpotCluster) -> SpotCluster:
    spot_cluster.reset(2)
    return spot_cluster


def _spot_spec(tmp_path: Path, name: str, **over: Any):
    base = {
        "resources.device": "cpu",
        "resources.stages": [{"resources": {"spot_gpu": 1}}] * 2,  # one per stage
        "elastic.min_replicas": 1,
        "elastic.max_replicas": 2,
        "elastic.wait_for_capacity_s": 120,
        "checkpoint.keep_last": 100,
    }
    return tiny_spec(tmp_path, name, **{**base, **over})


def _brief(st: dict[str, Any]) -> dict[str, Any]:
    return {k: st.get(k) for k in ("state", "step", "replicas", "committed_steps", "error")} | {
        "events": st.get("events", [])[-25:]
    }


def _result(run: spotline.JobRun) -> dict[str, Any]:
    import ray

    return ray.get(run.controller.result.remote())


def _stop(run: spotline.JobRun) -> None:
    assert run.stop().state == "stopped"


def _copy_step(src_uri: str, dst: Path, step: int) -> str:
    """A new checkpoint location holding just committed step `step` of `src_uri`."""
    src = Path(src_uri.removeprefix("file://")) / f"step_{step:08d}"
    dst.mkdir(parents=True)
    shutil.copytree(src, dst / src.name)
    return f"file://{dst}"


def _run_until(spec, step: int) -> dict[str, Any]:
    run = spotline.Job(spec).start()
    wait_for(run, lambda s: s["step"] >= step, f"reference run to reach step {step}")
    res = _result(run)
    _stop(run)
    return res


def test_every_node_of_the_test_cluster_listens_on_loopback(cluster: SpotCluster) -> None:
    """The head and each spot node (one raylet each) bind to 127.0.0.1, not the
    machine's routable address: no test traffic leaves loopback."""
    import ray

    nodes = [n for n in ray.nodes() if n["Alive"]]
    assert len(nodes) == 3
    assert {n["NodeManagerAddress"] for n in nodes} == {"127.0.0.1"}
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")


def test_grow_then_notice_shrink_matches_an_uninterrupted_run(
    spot_cluster: SpotCluster, tmp_path: Path
) -> None:
    spot_cluster.reset(1)  # one replica's worth of devices to start with
    over = {
        "train.steps": 20_000,  # long enough that growing pays for its restart; stopped early
        "preemption.sources": [{"kind": "ray-drain", "poll_interval_s": 0.2}],
    }
    spec = _spot_spec(tmp_path / "elastic", "elastic", **over)
    run = spotline.Job(spec).start()
    st = wait_for(run, lambda s: s["replicas"] == 1 and s["step"] >= 5, "1 replica training")
    pids = {w["pid"] for w in st["workers"]}

    # Capacity comes back: the job grows to 2 replicas at a checkpoint boundary.
    spot_cluster.spot.append(spot_cluster.cluster.add_node(**SPOT_NODE))
    st = wait_for(
        run,
        lambda s: s["replicas"] == 2 and s["state"] == "running" and s["step"] > 0,
        "growing to 2 replicas",
    )
    grow = _result(run)["resizes"][0]["step"]
    st = wait_for(run, lambda s: s["step"] >= grow + 3, "training at 2 replicas")
    # The replica that ran goes on in its own processes; the new one's were started
    # ahead, on the joined node, while the job trained on.
    assert pids < {w["pid"] for w in st["workers"]}, (pids, st["workers"])

    # A spot notice for the node of rank 1: JIT checkpoint, then on with 1 replica.
    victim = next(w["node_id"] for w in st["workers"] if w["rank"] == 1)
    grown = st["workers"]
    drain_node(victim, seconds=120)
    st = wait_for(
        run,
        lambda s: s["replicas"] == 1 and s["state"] == "running" and s["step"] > 0,
        "the job to go on with 1 replica",
    )
    assert victim not in {w["node_id"] for w in st["workers"]}
    # The replica on the node that stays keeps its processes through the notice too.
    stayed = {w["pid"] for w in grown if w["node_id"] != victim}
    assert {w["pid"] for w in st["workers"]} == stayed, (grown, st["workers"])
    spot_cluster.remove(spot_cluster.node(victim))  # the preempted node goes
    res = _result(run)
    (notice,) = res["notices"]
    jit = notice["committed_step"]
    assert jit is not None, (notice, _brief(run.status()))
    wait_for(run, lambda s: any(c > jit for c in s["committed_steps"]), "a commit after the JIT")
    res = _result(run)
    _stop(run)

    # The notice became a just-in-time checkpoint well before the deadline, with no
    # committed step lost: the next group started from exactly that step.
    assert notice["source"] == "ray-drain" and notice["node_id"] == victim
    assert notice["outcome"] == "just-in-time checkpoint committed"
    assert notice["notice_to_commit_s"] is not None and notice["before_deadline_s"] > 60
    assert res["failures"] == 0
    first, second, third = res["attempts"][:3]
    assert (first["replicas"], second["replicas"], third["replicas"]) == (1, 2, 1)
    assert (second["kept"], third["kept"]) == (2, 2)  # recovery.in_place
    assert (second["ahead"], third["ahead"]) == (2, 0)
    assert second["restored_from"] == grow
    assert second["losses"][-1][0] == jit  # training stopped at the JIT step
    assert third["restored_from"] == jit and third["start_step"] == jit
    # The grown group's new ranks and the group after the notice read their state from
    # live peers' memory (the final saves were copied there too), not from storage.
    assert second["restored_via"] == third["restored_via"] == "peer memory"
    # The noticed node's keeper is never asked after the notice: the JIT step was whole
    # in the memory of the node that stays, so its ranks' state had moved there before
    # the deadline.
    assert third["restored_bytes"] > 0 and third["restored_attempt"] == second["attempt"]
    assert [r["why"] for r in res["resizes"][:2]] == ["grow", "preemption"]
    store = CheckpointStore(res["checkpoint_uri"])
    assert store.load_manifest(grow).topology["replicas"] == 1
    assert store.load_manifest(jit).topology["replicas"] == 2
    assert store.load_manifest(jit).extra["batch"]["global_batch_size"] == 8
    after = min(c for c in store.committed_steps() if c > jit)
    assert store.load_manifest(after).topology["replicas"] == 1

    # The same job, uninterrupted at the final size (1 replica) from the checkpoint
    # before the grow, trains to the same losses through the 2-replica stretch: the
    # constant global batch makes the math independent of the replica count.
    ref_spec = _spot_spec(
        tmp_path / "ref",
        "elastic",  # the job that owns the copied checkpoint
        **{
            **over,
            "preemption.sources": [],
            "checkpoint.uri": _copy_step(res["checkpoint_uri"], tmp_path / "ref-ckpt", grow),
        },
    )
    assert ref_spec.spec_hash() == spec.spec_hash()
    ref = _run_until(ref_spec, after)
    assert ref["attempts"][0]["restored_from"] == grow and ref["attempts"][0]["replicas"] == 1
    elastic = {s: v for a in res["attempts"] for s, v in a["losses"]}
    steps = list(range(grow + 1, after + 1))
    got = [elastic[s] for s in steps]
    want = [ref["losses"][s] for s in steps]
    assert got == pytest.approx(want, rel=1e-4), list(zip(steps, got, want, strict=True))


def test_node_lost_mid_upload_resumes_from_the_latest_commit(
    cluster: SpotCluster, tmp_path: Path
) -> None:
    spec = _spot_spec(
        tmp_path,
        "lost",
        # The restore from storage itself (peer memory would hold a newer step).
        **{
            "train.steps": 40,
            "checkpoint.upload_max_mb_per_s": 0.1,
            "recovery.peer_snapshots": False,
        },
    )
    store = CheckpointStore(spec.resolved_checkpoint_uri())
    run = spotline.Job(spec).start()

    def ranks_in(step: int) -> set[int]:
        return {r.rank for rs in store.read_receipts(step).receipts.values() for r in rs}

    def complete_steps() -> list[int]:
        return [
            c for c in store.uncommitted_steps() + store.committed_steps() if len(ranks_in(c)) == 4
        ]

    # Every rank uploads its own share of the state; rank 2 is on the second node.
    uploader = 2

    def mid_upload(s: dict[str, Any]) -> bool:
        # Some step >= 10 safely stored, and a later one under way without the uploader's part.
        if not s["workers"] or not any(c >= 10 for c in complete_steps()):
            return False
        return any(uploader not in ranks_in(c) for c in store.uncommitted_steps() if c > 10)

    st = wait_for(run, mid_upload, f"rank {uploader} to be uploading a checkpoint")
    victim = next(w["node_id"] for w in st["workers"] if w["rank"] == uploader)
    # No notice: the node and every process on it vanish at once. (Removing a simulated
    # node kills its raylet; its worker processes would linger a moment and could
    # finish an upload that a real node loss never finishes.)
    for w in st["workers"]:
        if w["node_id"] == victim:
            os.kill(w["pid"], signal.SIGKILL)
    cluster.remove(cluster.node(victim))
    latest = max(complete_steps())  # what was safely in storage when the node went
    partial = [c for c in store.uncommitted_steps() if c > latest]

    result = run.wait(verbose=False)
    assert partial, "the node went after every upload had finished"
    assert result.state == "finished"
    assert result.failures == 0 and result.node_losses == 1
    first, second = result.attempts[:2]
    assert first["ended_by"] == "node lost"
    # The resume came from the latest complete checkpoint; the half-uploaded one was
    # never loaded (it committed later only once the new group had saved it again).
    assert second["restored_from"] == latest and second["replicas"] == 1
    final = CheckpointStore(result.checkpoint_uri)
    for c in partial:
        if c in final.committed_steps():
            assert final.load_manifest(c).topology["replicas"] == 1
    assert sorted(result.losses) == list(range(1, 41))


def test_sigterm_to_a_worker_commits_a_jit_checkpoint_and_moves_off_its_node(
    cluster: SpotCluster, tmp_path: Path
) -> None:
    spec = _spot_spec(
        tmp_path,
        "sigterm",
        **{"train.steps": 40, "preemption.sources": [{"kind": "sigterm"}]},
    )
    run = spotline.Job(spec).start()
    st = wait_for(run, lambda s: s["replicas"] == 2 and s["step"] >= 5, "2 replicas training")
    rank1 = next(w for w in st["workers"] if w["rank"] == 1)
    os.kill(rank1["pid"], signal.SIGTERM)  # what Kubernetes sends a pod it will stop

    result = run.wait(verbose=False)
    assert result.state == "finished", result.error
    first, second = result.attempts[:2]
    jit = first["losses"][-1][0]
    assert second["restored_from"] == jit and second["replicas"] == 1
    assert result.failures == 0
    (notice,) = result.notices
    assert notice["source"] == "sigterm" and notice["node_id"] == rank1["node_id"]
    assert notice["committed_step"] == jit
    # Every step was trained exactly once: nothing was lost or redone.
    steps = [s for a in result.attempts for s, _ in a["losses"]]
    assert steps == list(range(1, 41))
    assert CheckpointStore(result.checkpoint_uri).load_manifest(jit).topology["replicas"] == 2


def test_below_min_waits_then_fails_with_a_clear_message(
    cluster: SpotCluster, tmp_path: Path
) -> None:
    spec = _spot_spec(
        tmp_path,
        "toobig",
        **{
            "elastic.min_replicas": 3,
            "elastic.max_replicas": 3,
            "parallel.micro_batches": 2,
            "train.global_batch_size": 12,
            "elastic.wait_for_capacity_s": 4,
        },
    )
    run = spotline.Job(spec).start()
    st = wait_for(run, lambda s: s["state"] == "waiting", "the job to wait for capacity", 60)
    assert "can hold 2 replica(s) now; elastic.min_replicas is 3" in st["waiting"]
    with pytest.raises(spotline.JobFailed) as ei:
        run.wait(verbose=False)
    msg = str(ei.value)
    assert "Gave up after waiting 4s (elastic.wait_for_capacity_s)" in msg
    assert "lower elastic.min_replicas" in msg
    assert ei.value.result.attempts == []  # no worker ever started


def _phases_now(root: Path, staging: Path, attempt: str, world: int) -> set[str]:
    """Where the checkpoints of group `attempt` stand right now (file:// storage):
    "save" (a rank writing a step in its staging dir, none of it in storage yet),
    "upload" (a rank's files going up, or some ranks' receipts but not all), "commit"
    (every receipt, no manifest yet)."""
    from spotline.checkpoint.store import MANIFEST_NAME, RECEIPTS_DIR
    from spotline.checkpoint.transfer import attempt_dir

    found: set[str] = set()
    for local in staging.glob(f"{attempt}/rank_*/step_*"):
        if not (root / local.name / attempt_dir(attempt) / local.parent.name).exists():
            found.add("save")
    for step_dir in root.glob("step_*"):
        if (step_dir / MANIFEST_NAME).exists():
            continue
        got = len(list((step_dir / RECEIPTS_DIR / attempt).glob("rank_*.json")))
        if got == world:
            found.add("commit")
        elif got or (step_dir / attempt_dir(attempt)).exists():
            found.add("upload")
    return found


def test_chaos_loop_never_loses_a_commit_nor_loads_a_partial_or_mixed_one(
    cluster: SpotCluster, tmp_path: Path
) -> None:
    """A 4-rank job (2 stages x 2 replicas) SIGKILLed at random ranks and at random
    points of its checkpoint path, over and over; then it finishes. Every restore must
    start from the newest commit there was at the kill (or a newer one), only ever from
    a complete checkpoint of one group, and train exactly as an uninterrupted run."""
    import random

    from spotline.checkpoint.transfer import attempt_dir

    rng = random.Random(13)
    # Until each phase of the checkpoint path was hit and at least `kills_least` kills,
    # at most `kills_most`.
    kills_least, kills_most, deadline = 4, 8, time.monotonic() + 480
    over = {
        "train.steps": 160,
        "checkpoint.interval_steps": 2,
        "checkpoint.upload_max_mb_per_s": 1.0,  # uploads that take long enough to hit
        "failure.max_failures": -1,
    }
    spec = _spot_spec(tmp_path / "chaos", "chaos", **over)
    root = Path(spec.resolved_checkpoint_uri().removeprefix("file://"))
    staging = Path(spec.checkpoint.staging_dir) / spec.name
    store = CheckpointStore(spec.resolved_checkpoint_uri())
    run = spotline.Job(spec).start()

    kills: list[dict[str, Any]] = []

    def enough() -> bool:
        phases = {k["phase"] for k in kills}
        return len(kills) >= kills_most or (
            len(kills) >= kills_least and {"save", "upload", "commit"} <= phases
        )

    while not enough() and time.monotonic() < deadline:
        want = rng.choice(["save", "upload", "commit"])
        # The group that is up now, trained at least one step past its restore.
        st = wait_for(
            run,
            lambda s: s["state"] == "running" and len(s["workers"]) == 4,
            f"a running group before kill {len(kills) + 1}",
        )
        attempt = _result(run)["attempts"][-1]
        started = attempt["start_step"]
        wait_for(run, lambda s, a=started: s["step"] > a, "a step past the restore")
        hit, until = None, time.monotonic() + 20
        while hit is None and time.monotonic() < until:
            if want in _phases_now(root, staging, attempt["attempt"], 4):
                hit = want
            if hit is None:
                time.sleep(0.01)
        st = run.status()
        if st["state"] != "running" or len(st["workers"]) != 4:
            continue  # the group changed under us: pick again
        victim = rng.choice(st["workers"])
        committed = set(store.committed_steps())
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim["pid"], signal.SIGKILL)
        kills.append(
            {
                "phase": hit or "training",
                "rank": victim["rank"],
                "attempt": attempt["attempt"],
                "committed": committed,
            }
        )
        wait_for(
            run,
            lambda s, a=attempt["attempt"]: _result(run)["attempts"][-1]["attempt"] != a,
            f"a new group after kill {len(kills)}",
        )

    result = run.wait(verbose=False)
    phases = [k["phase"] for k in kills]
    assert len(kills) >= kills_least, phases
    assert {"save", "upload", "commit"} <= set(phases), phases
    assert result.state == "finished", result.error
    assert result.failures == len(kills)

    final = set(CheckpointStore(result.checkpoint_uri).committed_steps())
    by_attempt = {a["attempt"]: a for a in result.attempts}
    for i, kill in enumerate(kills):
        # 0 committed steps lost: each was still there at the end, and the next group
        # started from the newest of them (or from one committed as it went down).
        assert kill["committed"] <= final, (i, kill["committed"] - final)
        nxt = result.attempts[list(by_attempt).index(kill["attempt"]) + 1]
        assert (nxt["restored_from"] or 0) >= max(kill["committed"], default=0), (i, kill, nxt)

    for a in result.attempts[1:]:
        # 0 partial or mixed loads: what each group loaded was a complete checkpoint of
        # one earlier group, every byte as its manifest says (or, from peer memory, every
        # rank's copy of one step of one earlier group, verified the same way).
        step = a["restored_from"]
        if step is None:  # the group before it was killed before its first commit
            assert a["start_step"] == 0, a
            continue
        if a["restored_via"] == "peer memory":
            assert a["restored_attempt"] in by_attempt and a["restored_attempt"] != a["attempt"]
            continue
        assert step in final
        m = store.load_manifest(step)
        group = m.extra["attempt"]
        assert group in by_attempt and group != a["attempt"]
        assert {f.path.split("/")[0] for f in m.files} == {attempt_dir(group)}, m.files
        ranks = {f.path.split("/")[1] for f in m.files}
        assert ranks == {f"rank_{r:05d}" for r in range(4)}, ranks
        store.verify_remote(m)

    # Training went on as if nothing had happened: every step's loss (from the group
    # that trained it last) is that of one uninterrupted run.
    ref = spotline.Job(
        _spot_spec(tmp_path / "ref", "chaos-ref", **{**over, "failure.max_failures": 3})
    ).run(verbose=False)
    assert sorted(result.losses) == list(range(1, 161))
    steps = sorted(result.losses)
    assert [result.losses[s] for s in steps] == pytest.approx(
        [ref.losses[s] for s in steps], rel=1e-5
    )
    print(f"chaos loop: {len(kills)} kills by phase {sorted(set(phases))}: {phases}")


def test_an_unexpected_controller_error_fails_the_job_and_leaves_no_actor_behind(
    cluster: SpotCluster, tmp_path: Path
) -> None:
    """A bug in the controller's loop, while training with backfill executors and node
    watchers up: the job ends `failed` with the error, and Ray's state API shows no
    worker, executor, watcher or placement group of the job left alive."""
    import ray
    from ray.util.state import list_actors, list_placement_groups

    from spotline.controller.actor import ControllerActor, controller_name
    from spotline.job import JobRun
    from spotline.runtime.sealed import SealedJob

    spec = _spot_spec(
        tmp_path,
        "fault",
        **{
            "train.steps": 400,
            "preemption.sources": [{"kind": "ray-drain", "poll_interval_s": 0.2}],
            "backfill": {"enabled": True},
        },
    )

    class Buggy(ControllerActor):
        """The real controller actor, with a bug in its running state from step 40 on."""

        def __init__(self, job: SealedJob) -> None:
            super().__init__(job)
            c = self.controller
            running = c._running

            def buggy(state):
                if c.step_count >= 40:
                    raise KeyError("a bug")
                return running(state)

            c._running = buggy

    # The state API of this cluster: without an address it looks for one by itself, and
    # fails when another Ray cluster runs on the machine.
    here = ray.get_runtime_context().gcs_address

    def alive() -> list[str]:
        mine = f"spotline:{spec.name}:"
        return sorted(
            a.name
            for a in list_actors(here, filters=[("state", "=", "ALIVE")], limit=1000)
            if (a.name or "").startswith(mine) and a.name != controller_name(spec.name)
        )

    controller = (
        ray.remote(Buggy)
        .options(name=controller_name(spec.name), num_cpus=0, max_concurrency=4)
        .remote(SealedJob(spec, CheckpointStore(spec.resolved_checkpoint_uri())))
    )
    run = JobRun(spec, controller)
    wait_for(run, lambda s: s["step"] >= 3 and s["state"] == "running", "training")
    up = alive()
    assert any(":backfill:" in n for n in up) and any(":watcher:" in n for n in up), up
    assert len([n for n in up if ":backfill:" not in n and ":watcher:" not in n]) >= 4, up
    with pytest.raises(spotline.JobFailed) as ei:
        run.wait(verbose=False)
    msg = str(ei.value)
    assert "internal error in the controller while running: KeyError: 'a bug'" in msg, msg
    assert ei.value.result.state == "failed"

    # Killed actors take a moment to show as DEAD in the state API.
    deadline = time.monotonic() + 30
    while alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert alive() == []
    groups = list_placement_groups(here, filters=[("state", "!=", "REMOVED")], limit=1000)
    assert [g.name for g in groups if (g.name or "").startswith(f"spotline:{spec.name}:")] == []


def test_a_notice_on_one_of_three_nodes_always_restarts_at_2_replicas(
    spot_cluster: SpotCluster, tmp_path: Path
) -> None:
    """Sized from the capacity that is really there once the old group's devices are
    back: never from a first reading taken while they were still held."""
    spot_cluster.reset(3)
    spec = _spot_spec(
        tmp_path,
        "three",
        **{
            "elastic.max_replicas": 3,
            "parallel.micro_batches": 2,
            "train.global_batch_size": 12,
            "train.steps": 20_000,  # stopped early
            "preemption.sources": [{"kind": "ray-drain", "poll_interval_s": 0.2}],
        },
    )
    run = spotline.Job(spec).start()
    victims = []
    # Once: growing back to 3 would need the cost rule to pay, and on shared cores
    # 3 replicas measure no faster than 2.
    rank = 0
    st = wait_for(
        run,
        lambda s: s["replicas"] == 3 and s["state"] == "running" and s["step"] > 0,
        "3 replicas training",
    )
    victim = next(w["node_id"] for w in st["workers"] if w["rank"] == rank)
    victims.append(victim)
    drain_node(victim, seconds=20)  # short: the JIT checkpoint comes within seconds
    st = wait_for(
        run,
        lambda s, v=victim: (
            s["state"] == "running"
            and s["workers"]
            and v not in {w["node_id"] for w in s["workers"]}
        ),
        "the job to go on without the doomed node",
    )
    assert st["replicas"] == 2, _brief(st)
    spot_cluster.remove(spot_cluster.node(victim))
    spot_cluster.spot.append(spot_cluster.cluster.add_node(**SPOT_NODE))
    res = _result(run)
    _stop(run)
    after_notice = [
        b
        for a, b in zip(res["attempts"], res["attempts"][1:], strict=False)
        if a["ended_by"] == "preemption notice"
    ]
    assert [a["replicas"] for a in after_notice] == [2], res["attempts"]
    assert [n["node_id"] for n in res["notices"]] == victims


def test_a_straggling_node_is_cordoned_and_the_job_moves_to_a_spare(
    cluster: SpotCluster, tmp_path: Path
) -> None:
    """Every rank on one spot node computes 3x slower; once a spare node joins, the
    node is cordoned and the job leaves it at the next checkpoint boundary."""
    slow = cluster.spot[0].node_id
    spec = _spot_spec(
        tmp_path,
        "straggling-node",
        # Without a spare the job needs the node (min 2): it is cordoned once one joined.
        **{
            "train.steps": 2000,
            "failure.straggler_window_steps": 10,
            "elastic.min_replicas": 2,
            "failure.test_faults": True,
        },
    )
    inject_faults(spec, [{"kind": "slow", "node": slow, "factor": 3.0}])
    run = spotline.Job(spec).start()
    st = wait_for(run, lambda s: s["replicas"] == 2 and s["step"] >= 5, "2 replicas training")
    assert slow in {w["node_id"] for w in st["workers"]}
    spare = cluster.cluster.add_node(**SPOT_NODE)
    cluster.spot.append(spare)
    st = wait_for(
        run,
        lambda s: (
            s["health"]["cordoned"]
            and s["state"] == "running"
            and len(s["workers"]) == 4
            and len(_result(run)["attempts"]) >= 2
        ),
        "the next group without the straggling node",
    )
    assert list(st["health"]["cordoned"]) == [slow]
    assert "slower than its peers" in st["health"]["cordoned"][slow]
    nodes = {w["node_id"] for w in st["workers"]}
    assert slow not in nodes and spare.node_id in nodes and st["replicas"] == 2, st["workers"]
    first = _result(run)["attempts"][0]
    assert first["ended_by"] == "cordon"
    # Left at a checkpoint boundary: nothing trained was lost.
    assert _result(run)["attempts"][1]["restored_from"] == first["losses"][-1][0]
    assert first["losses"][-1][0] % spec.checkpoint.interval_steps == 0
    _stop(run)


# --- recovery from peer memory --------------------------------------------------------

_PEER = {"train.steps": 30, "recovery.peer_interval_steps": 3}


@pytest.fixture(scope="module")
def peer_reference(spot_cluster: SpotCluster, tmp_path_factory) -> Any:
    """The same job uninterrupted at 2 replicas: the losses a recovered job must keep."""
    spot_cluster.reset(2)
    tmp = tmp_path_factory.mktemp("peer-ref")
    spec = _spot_spec(tmp, "peer-ref", **_PEER, **{"recovery.peer_snapshots": False})
    return spotline.Job(spec).run(verbose=False)


def _lose_node(cluster: SpotCluster, st: dict[str, Any], rank: int) -> str:
    """The node of `rank` vanishes without notice: its processes (the ranks and the
    job's state keeper there; a removed simulated node's processes would linger and
    answer a moment) and its raylet."""
    import ray

    from spotline.runtime.keeper import keeper_name

    victim = next(w["node_id"] for w in st["workers"] if w["rank"] == rank)
    for w in st["workers"]:
        if w["node_id"] == victim:
            os.kill(w["pid"], signal.SIGKILL)
    ray.kill(ray.get_actor(keeper_name(st["name"], victim)))
    cluster.remove(cluster.node(victim))
    return victim


def test_a_node_lost_without_notice_resumes_from_peer_memory_not_storage(
    cluster: SpotCluster, peer_reference: Any, tmp_path: Path
) -> None:
    """No commit exists yet when the node goes (checkpoint.interval_steps is past the
    kill), so a restore from storage would start over at step 0: the next group starts
    from the newest step both replicas left in the keepers' memory (the lost node's
    ranks' copies from their buddy on the surviving node), loses at most k steps plus
    those trained while that copy was in flight, and trains on as the uninterrupted run."""
    k = _PEER["recovery.peer_interval_steps"]
    spec = _spot_spec(tmp_path, "peer-lost", **_PEER, **{"checkpoint.interval_steps": 25})
    store = CheckpointStore(spec.resolved_checkpoint_uri())
    run = spotline.Job(spec).start()
    st = wait_for(
        run,
        lambda s: ((s.get("peer_memory") or {}).get("newest_step") or 0) >= 2 * k,
        "peer copies of two steps",
    )
    st = run.status()
    assert store.committed_steps() == []
    victim = _lose_node(cluster, st, rank=2)  # its ranks' copies live on in the other node's keeper
    trained = st["step"]
    # The replica on the node that stays goes on in its own processes (recovery.in_place).
    stayed = {w["rank"]: w["pid"] for w in st["workers"] if w["node_id"] != victim}
    after = wait_for(
        run,
        lambda s: s["workers"] and all(w["node_id"] != victim for w in s["workers"]),
        "the group after the loss",
    )
    assert sorted(w["pid"] for w in after["workers"]) == sorted(stayed.values()), (stayed, after)

    result = run.wait(verbose=False)
    assert result.state == "finished", result.error
    assert result.failures == 0 and result.node_losses == 1
    first, second = result.attempts[:2]
    assert second["replicas"] == 1 and second["restored_via"] == "peer memory"
    assert second["restored_attempt"] == first["attempt"] and second["restored_bytes"] > 0
    assert second["kept"] == 2  # both stages of the replica that stayed
    lost = first["losses"][-1][0] - second["restored_from"]
    assert second["restored_from"] >= 2 * k and second["restored_from"] % k == 0
    assert 0 <= lost <= k + (first["losses"][-1][0] - trained) + 2, (lost, trained, first)
    assert result.peer_memory["restores"][0]["step"] == second["restored_from"]
    # At the new shape (1 replica, the same global batch), as the uninterrupted run.
    steps = sorted(result.losses)
    assert steps == list(range(1, 31))
    assert [result.losses[s] for s in steps] == pytest.approx(
        [peer_reference.losses[s] for s in steps], rel=1e-4
    )
    print(f"peer recovery: step {second['restored_from']}, lost {lost}, {result.peer_memory}")


def test_a_rank_and_its_buddy_lost_together_fall_back_to_the_newest_commit(
    cluster: SpotCluster, peer_reference: Any, tmp_path: Path
) -> None:
    """Replica 1's node goes, and with it the copies its buddy (the other node's keeper)
    held: no step is complete in live memory, so the job restores the newest commit from
    storage, says why, and trains on exactly."""
    import ray

    from spotline.runtime.keeper import keeper_name

    spec = _spot_spec(tmp_path, "peer-both", **_PEER, **{"checkpoint.interval_steps": 5})
    store = CheckpointStore(spec.resolved_checkpoint_uri())
    run = spotline.Job(spec).start()
    st = wait_for(
        run,
        lambda s: any(c >= 5 for c in s["committed_steps"]) and s["step"] >= 7,
        "a commit, and steps past it",
    )
    victim = next(w["node_id"] for w in st["workers"] if w["rank"] == 2)
    survivor = next(w["node_id"] for w in st["workers"] if w["node_id"] != victim)
    ray.kill(ray.get_actor(keeper_name(spec.name, survivor)))  # the buddy's copies go
    _lose_node(cluster, run.status(), rank=2)
    committed = max(store.committed_steps())

    result = run.wait(verbose=False)
    assert result.state == "finished", result.error
    second = result.attempts[1]
    assert second["restored_via"] == "storage" and second["restored_from"] >= committed
    assert second["restored_from"] in CheckpointStore(result.checkpoint_uri).committed_steps()
    steps = sorted(result.losses)
    assert steps == list(range(1, 31))
    assert [result.losses[s] for s in steps] == pytest.approx(
        [peer_reference.losses[s] for s in steps], rel=1e-4
    )
