"""What keeps the controller, the commit and recovery linear in the ranks, and the scale
harness (`benchmarks/scale.py`) that measures them, run here at a small size so that it
cannot rot. Behaviour only: the figures are the benchmark's."""

from __future__ import annotations

import gc
import sys
import threading
import time
from pathlib import Path

import pytest

from spotline.checkpoint import CheckpointStore
from spotline.checkpoint.coordinator import CommitCoordinator
from spotline.storage.backends import READ_THREADS

pytestmark = pytest.mark.unit

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import scale  # noqa: E402
import scale_sim  # noqa: E402


class SlowFs:
    """A filesystem whose reads take a while, counting how many are in flight."""

    def __init__(self, fs, delay_s: float = 0.02):
        self.fs, self.delay_s = fs, delay_s
        self.lock = threading.Lock()
        self.now = self.most = self.reads = 0
        self.paths: list[str] = []

    def cat_file(self, path, *a, **k):
        with self.lock:
            self.now += 1
            self.reads += 1
            self.most = max(self.most, self.now)
            self.paths.append(str(path))
        try:
            time.sleep(self.delay_s)
            return self.fs.cat_file(path, *a, **k)
        finally:
            with self.lock:
                self.now -= 1

    def __getattr__(self, name):
        return getattr(self.fs, name)


def _slow(store: CheckpointStore) -> SlowFs:
    slow = SlowFs(store.fs)
    store._fs = slow
    return slow


@pytest.fixture(scope="module")
def job():
    """A 64-rank job of the harness (pp=8 x dp=8) and its stages' parameters."""
    spec = scale_sim.sim_spec(64, "file:///unused")
    return spec, scale_sim.stage_params(spec)


def _store(spec, uri: str) -> CheckpointStore:
    return CheckpointStore(uri, signing_key_env=spec.checkpoint.signing_key_env)


@pytest.mark.parametrize(
    ("bundled", "reads"),
    [
        ("every node", {"node": 8}),
        ("no node", {"rank": 64}),
        ("one node missing", {"node": 7, "rank": 8}),
    ],
)
def test_a_commit_from_storage_reads_a_receipt_a_node_at_once_through_a_bounded_pool(
    tmp_path, job, bundled, reads
):
    spec, stages = job
    uri = f"file://{tmp_path}/ckpt"
    spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"uri": uri})})
    store = _store(spec, uri)
    scale_sim.write_step(spec, store, stages, 8, 40, "g0", bundle=bundled != "no node")
    if bundled == "one node missing":  # its leader gave up waiting, or died
        (tmp_path / "ckpt/step_00000040/_receipts/g0/node_00008.json").unlink()
    coordinator = CommitCoordinator(spec, _store(spec, uri), lambda *a, **k: None)
    slow = _slow(coordinator.store)
    done = coordinator.commit_from_storage()
    assert [d.step for d in done] == [40] and len(done[0].manifest.files) == 2 * 64
    # Every receipt read once, many at a time, never more than the pool holds; a node's
    # receipts in one read, a rank's own only where no node's holds it.
    receipts = [p for p in slow.paths if "/_receipts/" in p]
    assert len(receipts) == len(set(receipts))
    kinds = {k: sum(f"/{k}_" in p for p in receipts) for k in ("node", "rank")}
    assert {k: n for k, n in kinds.items() if n} == reads
    if bundled == "one node missing":
        assert sorted(int(p[-10:-5]) for p in receipts if "/rank_" in p) == list(range(8, 16))
    assert 1 < slow.most <= READ_THREADS


def test_a_commit_reads_no_receipt_and_records_the_ranks_meta(tmp_path, job):
    spec, stages = job
    uri = f"file://{tmp_path}/ckpt"
    spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"uri": uri})})
    coordinator = CommitCoordinator(spec, _store(spec, uri), lambda *a, **k: None)
    results = scale_sim.write_step(spec, coordinator.store, stages, 8, 10, "g0")
    scale_sim.write_step(spec, coordinator.store, stages, 8, 10, "dead")  # a re-save that died
    slow = _slow(coordinator.store)
    coordinator.expect(10, "g0", 64)
    (done,) = coordinator.receive(results)
    # The sweep of the dead group's files lists the groups; it reads none of 128 receipts.
    assert not [p for p in slow.paths if "/_receipts/" in p]
    assert not (tmp_path / "ckpt" / "step_00000010" / "a-dead").exists()
    assert (tmp_path / "ckpt" / "step_00000010" / "a-g0").exists()
    meta = done.manifest.extra["meta"]
    assert meta["topology"] == {"pipeline_stages": 8, "replicas": 8, "zero_stage": 1}
    assert meta["global_steps"] == 10


def _committed(tmp_path, job):
    """Step 10 of the 64-rank job, committed at tmp_path/ckpt by a coordinator:
    (spec, stages, coordinator, the commit)."""
    spec, stages = job
    uri = f"file://{tmp_path}/ckpt"
    spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"uri": uri})})
    coordinator = CommitCoordinator(spec, _store(spec, uri), lambda *a, **k: None)
    coordinator.expect(10, "g0", 64)
    (done,) = coordinator.receive(
        scale_sim.write_step(spec, coordinator.store, stages, 8, 10, "g0")
    )
    return spec, stages, coordinator, done


def test_a_written_manifest_is_not_read_back_and_is_the_one_storage_holds(tmp_path, job):
    """The controller that commits a step keeps its manifest: the listing and the load
    that follow read no manifest back, and what they return equals a reader's parse of
    the stored bytes; a manifest rewritten since is read afresh."""
    from spotline.checkpoint.manifest import Manifest

    _, _, coordinator, _ = _committed(tmp_path, job)
    store = coordinator.store
    slow = _slow(store)
    assert store.list_steps().committed == [10]
    kept = store.load_manifest(10)
    assert not [p for p in slow.paths if p.endswith("manifest.json")]
    path = tmp_path / "ckpt" / "step_00000010" / "manifest.json"
    raw = path.read_bytes()
    assert kept == Manifest.from_json(raw, store.signing_key())
    path.write_bytes(raw.replace(b'"step": 10,', b'"step": 11,'))  # no longer verifies
    assert store.list_steps().damaged.keys() == {10}


def test_a_restore_lists_the_steps_once_unless_receipts_commit_a_step(tmp_path, job):
    spec, stages, coordinator, _ = _committed(tmp_path, job)
    listings = []
    real = coordinator.store.list_steps
    coordinator.store.list_steps = lambda: listings.append(1) or real()
    group = scale._Restoring(stages, 8, coordinator.store)
    assert coordinator.restore(group, lambda s: None)[0] == 10 and len(listings) == 1
    # Step 20's every rank left its receipt, and no completion report reached anyone.
    scale_sim.write_step(spec, coordinator.store, stages, 8, 20, "g1")
    assert coordinator.restore(group, lambda s: None)[0] == 20 and len(listings) == 3


def test_a_restoring_rank_reads_its_own_meta_file_only(tmp_path, job):
    from spotline.checkpoint.reshard import checkpoint_meta

    spec, _, _, done = _committed(tmp_path, job)
    store = _store(spec, spec.checkpoint.uri)
    slow = _slow(store)
    meta, mine = checkpoint_meta(done.manifest, store, 5)
    assert len(slow.paths) == 1 and slow.paths[0].endswith("rank_00005/meta.json")
    assert mine["topology"]["rank"] == 5 and meta["global_steps"] == 10
    # At another shape no rank's own meta is wanted: nothing is read.
    assert checkpoint_meta(done.manifest, store, None)[1] is None and len(slow.paths) == 1
    # A manifest without the combined meta (an older Spotline's): every rank's meta file,
    # at once through the bounded pool.
    del done.manifest.extra["meta"]
    meta, mine = checkpoint_meta(done.manifest, store, 5)
    assert len(slow.paths) == 1 + 64 and 1 < slow.most <= READ_THREADS
    assert mine["topology"]["rank"] == 5 and meta["global_steps"] == 10


def test_the_harness_fake_group_publishes_every_rank_and_the_loop_commits(tmp_path):
    figures = scale.measure_loop(16, tmp_path)
    for name in ("poll_cpu_ms", "loop_step_cpu_ms", "status_ms", "controller_rss_mb"):
        assert figures[name] > 0
    assert figures["loop_commit_file_s"] is not None  # a checkpoint committed in the loop
    assert figures["demand_bundles"] == 16  # a bundle per rank of max_replicas


def test_the_harness_fake_group_is_what_the_controller_folds(tmp_path, job):
    spec, stages = job
    store = _store(spec, f"file://{tmp_path}/ckpt")
    clock = scale_sim.SimClock()
    group = scale_sim.SimGroup(spec, 8, store, clock, stages, scale_sim.node_names(8))
    group.run(100)
    progress = group.poll(scale_sim.STEP_S)
    assert [b.rank for b in progress.ranks] == list(range(64))
    assert {b.node for b in progress.ranks} == set(scale_sim.node_names(8))
    assert progress.steps and len(progress.bubbles) == 64
    # Only the first replicas of each stage send their timelines (what the trace draws).
    drawn = {(b["stage"], b["replica"]) for b in progress.bubbles if "steps_timeline" in b}
    assert drawn == {(s, r) for s in range(8) for r in range(4)}


def test_the_harness_storage_and_peer_paths_at_a_small_size(tmp_path):
    figures = scale.measure_storage(16, f"file://{tmp_path}/paths", None, "file")
    for name in ("commit_file_s", "commit_from_storage_file_s", "restore_plan_file_s",
                 "reshard_plan_file_s", "manifest_bytes_file"):  # fmt: skip
        assert figures[name] > 0
    assert scale.measure_peer(16)["peer_offer_s"] > 0


def test_each_size_on_s3_runs_in_a_bucket_of_its_own_that_it_deletes(s3_bucket):
    """moto lists a bucket by walking all its keys: a size's run must not pay for the
    keys an earlier size left."""
    before = {b["Name"] for b in s3_bucket.client.list_buckets()["Buckets"]}
    with scale._own_bucket(s3_bucket.endpoint_url, "spotline-scale-16-1"):
        figures = scale.measure_storage(
            16, "s3://spotline-scale-16-1/job", s3_bucket.endpoint_url, "s3"
        )
        listed = s3_bucket.client.list_objects_v2(Bucket="spotline-scale-16-1")
        assert listed["KeyCount"] > 0
    assert figures["restore_plan_s3_s"] > 0 and figures["manifest_bytes_s3"] > 0
    assert {b["Name"] for b in s3_bucket.client.list_buckets()["Buckets"]} == before


def test_the_bursts_of_thousands_of_ranks_run_with_collection_held(tmp_path, monkeypatch):
    """The poll's snapshot, a manifest's JSON both ways and the peer offer build
    thousands of containers at size; a collection in the middle of them scans the whole
    heap."""
    import spotline.checkpoint.manifest as manifest_mod
    import spotline.runtime.peers as peers_mod

    held: dict[str, list[bool]] = {"poll": [], "write": [], "read": [], "offer": []}

    def recording(name, real, mine=lambda *a: True):  # `mine`: a manifest's, not a receipt's
        def call(*a, **k):
            if mine(*a):
                held[name].append(not gc.isenabled())
            return real(*a, **k)

        return call

    # The poll's snapshot, built from its reports (its wait runs with collection on:
    # tests/test_heap.py watches for that).
    monkeypatch.setattr(
        scale_sim.SimGroup, "_progress", recording("poll", scale_sim.SimGroup._progress)
    )
    for name, fn in (("write", "_dump_signed"), ("read", "_load_signed")):
        real = getattr(manifest_mod, fn)
        mine = (lambda raw, *a: "data_position" in raw) if name == "write" else (
            lambda s, key, what, *a: what == "manifest")  # fmt: skip
        monkeypatch.setattr(manifest_mod, fn, recording(name, real, mine))
    monkeypatch.setattr(peers_mod, "newest_complete", recording("offer", peers_mod.newest_complete))
    gc.enable()
    scale.measure_loop(16, tmp_path)
    scale.measure_storage(16, f"file://{tmp_path}/paths", None, "file")
    scale.measure_peer(16)
    assert {name: set(calls) for name, calls in held.items()} == dict.fromkeys(held, {True})
    assert gc.isenabled()  # and back on after each


def test_the_growth_exponent_is_the_log_log_slope():
    assert scale.exponent([8, 64, 512], [1.0, 8.0, 64.0]) == pytest.approx(1.0)
    assert scale.exponent([8, 64, 512], [2.0, 2.0, 2.0]) == pytest.approx(0.0)
    assert scale.exponent([8, 64], [1.0, None]) is None
