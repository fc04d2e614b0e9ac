"""A node's upload receipts written as one object by its lowest rank, so that a commit
from storage reads one object a node: real Uploaders and CommitCoordinator on file://,
each rank's receipt signed with the job's key. No Ray, no processes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from spotline.checkpoint import CheckpointStore
from spotline.checkpoint.coordinator import CommitCoordinator
from spotline.checkpoint.layout import RankFiles
from spotline.checkpoint.node_receipts import NodeReceipts
from spotline.checkpoint.transfer import Uploader
from spotline.config import load_spec

pytestmark = pytest.mark.unit

KEY_ENV = "SPOTLINE_TEST_NODE_RECEIPT_KEY"


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(KEY_ENV, "n" * 32)
    spec = load_spec(
        {
            "name": "nodes",
            "model": {"n_layers": 2},
            "train": {"steps": 100, "global_batch_size": 4},
            "checkpoint": {
                "uri": f"file://{tmp_path}/ckpt",
                "interval_steps": 10,
                "staging_dir": str(tmp_path / "stage"),
                "signing_key_env": KEY_ENV,
            },
        }
    )
    return spec, CheckpointStore(spec.checkpoint.uri, signing_key_env=KEY_ENV)


class Reads:
    """The store's filesystem, recording each object read and each receipts' listing."""

    def __init__(self, fs):
        self.fs, self.paths, self.listed = fs, [], []

    def cat_file(self, path, *a, **k):
        self.paths.append(str(path))
        return self.fs.cat_file(path, *a, **k)

    def find(self, path, *a, **k):
        if "/_receipts/" in str(path):
            self.listed.append(k.get("prefix", ""))
        return self.fs.find(path, *a, **k)

    def __getattr__(self, name):
        return getattr(self.fs, name)


def _write(d: Path) -> RankFiles:
    (d / "state.safetensors").write_bytes(b"s" * 64)
    return RankFiles(entries=[], files={})


def _until(ok, timeout_s: float = 60.0) -> None:
    """Wait for `ok()`; a guard against a hang, not a measure of time."""
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            pytest.fail(f"still waiting for {ok} after {timeout_s:.0f}s")
        time.sleep(0.05)


def _save(tmp_path: Path, job, step: int, nodes: list[list[int]]) -> Path:
    """Every rank of `nodes` (ranks by node, each node its own staging folder) saves
    `step` in group g0; returns the step's receipts folder once every node has written
    its object."""
    spec, store = job
    world = sum(len(n) for n in nodes)
    ups = []
    for i, ranks in enumerate(nodes):
        for r in ranks:
            node = NodeReceipts(tmp_path / f"node{i}", r)
            assert node.join()
            ups.append(Uploader(store, spec, r, world, "g0", node=node))
    for up in reversed(ups):  # the leaders last: they wait for no one
        up.submit(step, tmp_path / "stage" / f"r{up.rank}", _write)
    for up in ups:
        assert up.wait(60)
        assert all(r.error is None for r in up.take_done())
    folder = tmp_path / "ckpt" / f"step_{step:08d}" / "_receipts" / "g0"
    for ranks in nodes:
        _until((folder / f"node_{min(ranks):05d}.json").exists)
    for up in ups:
        up.close()
    return folder


def test_a_nodes_lowest_rank_writes_its_receipts_as_one_object_read_alone_at_commit(
    tmp_path: Path, job
) -> None:
    spec, store = job
    folder = _save(tmp_path, job, 10, [[0, 1, 2], [3]])
    held = json.loads((folder / "node_00000.json").read_bytes())["receipts"]
    assert [json.loads(b)["rank"] for b in held] == [0, 1, 2]
    # Each as its rank wrote it, signature and all.
    assert held == [(folder / f"rank_{r:05d}.json").read_text() for r in range(3)]
    # A node of one rank writes its own: a commit then lists nothing but nodes' objects.
    assert json.loads((folder / "node_00003.json").read_bytes())["receipts"] == [
        (folder / "rank_00003.json").read_text()
    ]
    assert not list((tmp_path / "node0").glob("step_*"))  # the leader cleaned up
    log: list[str] = []
    coord = CommitCoordinator(spec, store, lambda msg, *a, **k: log.append(msg))
    reads = Reads(store.fs)
    store._fs = reads
    (done,) = coord.commit_from_storage()
    assert done.step == 10 and len(done.manifest.files) == 4, log
    assert sorted(Path(p).name for p in reads.paths) == ["node_00000.json", "node_00003.json"]
    assert reads.listed == ["node_"]  # the group's nodes' objects alone, not every rank's


def test_a_receipt_in_a_nodes_object_is_checked_as_its_own_and_a_bad_one_is_read_from_the_rank(
    tmp_path: Path, job
) -> None:
    spec, store = job
    folder = _save(tmp_path, job, 10, [[0, 1]])
    # Someone without the key swaps rank 1's receipt in the node's object for one of
    # their own; another step's node object is not a node object at all.
    doc = json.loads((folder / "node_00000.json").read_bytes())
    forged = json.loads(doc["receipts"][1])
    forged.pop("signature")
    doc["receipts"][1] = json.dumps(forged)
    (folder / "node_00000.json").write_text(json.dumps(doc))
    other = _save(tmp_path, job, 20, [[0, 1]])
    (other / "node_00000.json").write_text("[1, 2]")
    log: list[str] = []
    coord = CommitCoordinator(spec, store, lambda msg, *a, **k: log.append(msg))
    reads = Reads(store.fs)
    store._fs = reads
    done = coord.commit_from_storage()
    # Each step's group listed in full, and just the rank its node's object lacked read.
    assert reads.listed == ["node_", "", "node_", ""]
    assert sorted(Path(p).name for p in reads.paths if "/_receipts/" in p) == [
        "node_00000.json",
        "node_00000.json",
        "rank_00000.json",
        "rank_00001.json",
        "rank_00001.json",
    ]
    # Both commit from the ranks' own receipts where the node's could not be used.
    assert [d.step for d in done] == [10, 20] == store.committed_steps(), log
    (said,) = [m for m in log if "step 10" in m and "not used" in m]
    assert "node_00000.json#1" in said and "not signed" in said, said
    assert "each of their ranks' own receipts was read instead" in said, said
    (said,) = [m for m in log if "step 20" in m and "not used" in m]
    assert "node_00000.json: it is not a spotline-node-receipts/1 document" in said, said
    assert not [m for m in log if "is not committed" in m], log


def test_a_leader_gives_up_on_a_rank_that_never_leaves_its_receipt(tmp_path: Path) -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    ranks = [NodeReceipts(tmp_path, r, clock=lambda: now[0], sleep=sleep) for r in (4, 5, 6)]
    assert all(r.join() for r in ranks)
    assert [r.leads() for r in ranks] == [True, False, False]
    assert ranks[0].drop(9, b"old") and ranks[1].drop(9, b"old")  # a save given up on
    assert ranks[0].drop(10, b"r4") and ranks[1].drop(10, b"r5")  # rank 6 never does
    assert ranks[0].gather(10, 30.0, stop=lambda: False) == [b"r4", b"r5"]
    assert now[0] >= 30.0  # it waited the whole bound, no more than a poll beyond
    assert now[0] < 30.0 + 2 * max(slept)
    assert not list(tmp_path.glob("step_*"))  # the step's folder, and older ones, gone
    # The rank's next save waits: it goes on at once.
    assert ranks[0].drop(20, b"r4")
    slept.clear()
    assert ranks[0].gather(20, 30.0, stop=lambda: True) == [b"r4"] and not slept
