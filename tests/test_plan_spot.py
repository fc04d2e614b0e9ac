"""`spotline plan` for a large spot job, on paper and with nothing to read: the tokenizer's
vocabulary assumed (and said so) when it cannot be read, a just-in-time save against
each cloud's notice at a stated bandwidth per node, peer snapshots against the node's
memory, and a restore from peer memory and from storage."""

from __future__ import annotations

from pathlib import Path

import pytest

import spotline.data
from spotline.cli import main
from spotline.job import Job

pytestmark = pytest.mark.unit

SPOT = Path(__file__).resolve().parents[1] / "configs" / "llama-1b-spot.yaml"


def _job(tmp_path, *overrides: str) -> Job:
    return Job.from_yaml(
        SPOT,
        [f"checkpoint.uri=file://{tmp_path}/c", f"checkpoint.staging_dir={tmp_path}/s",
         f"data.cache_dir={tmp_path}/d", *overrides],
    )  # fmt: skip


def _big(tmp_path, *overrides: str) -> Job:
    """The 8B preset at pp=4 x dp=64 on 8-GPU nodes."""
    return _job(
        tmp_path, "model.preset=llama-8b", "parallel.pipeline_stages=4",
        "parallel.micro_batches=8", "elastic.min_replicas=64", "elastic.max_replicas=64",
        "train.global_batch_size=512", "resources.ranks_per_node=8",
        "resources.device_memory_gb=80", "resources.node_memory_gb=2048", *overrides,
    )  # fmt: skip


def test_a_plan_needs_no_credentials_and_says_what_it_assumed(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("SPOTLINE_SIGNING_KEY", raising=False)
    plan = _job(tmp_path).plan(peak_tflops=100, local_cluster=False)
    (tok,) = [u for u in plan.unchecked if u.startswith("tokenizer.path")]
    assert "could not be read" in tok and "128,256 (the llama-1b preset's)" in tok
    assert [u for u in plan.unchecked if "signing key" in u]
    assert plan.step.step_s and plan.stages and plan.checkpoint_bytes > 0
    assert "unchecked: tokenizer.path" in plan.render()


def test_offline_reads_nothing_and_model_vocab_size_wins(tmp_path, monkeypatch) -> None:
    def never(*a, **k):
        raise AssertionError("the tokenizer was read")

    monkeypatch.setattr(spotline.data, "job_tokenizer", never)
    plan = _job(tmp_path, "model.vocab_size=32000").plan(
        peak_tflops=100, local_cluster=False, offline=True
    )
    (tok,) = [u for u in plan.unchecked if u.startswith("tokenizer.path")]
    assert "(--offline)" in tok and "32,000 (model.vocab_size)" in tok


def test_validate_offline_passes_without_credentials(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("SPOTLINE_SIGNING_KEY", raising=False)
    args = ["validate", str(SPOT), "--offline", "--set", f"checkpoint.uri=file://{tmp_path}/c",
            "--set", f"checkpoint.staging_dir={tmp_path}/s"]  # fmt: skip
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "unchecked: tokenizer.path" in err and "(--offline)" in err


def test_spot_recovery_of_a_large_shape_against_each_cloud(tmp_path) -> None:
    fast = _big(tmp_path).plan(peak_tflops=400, local_cluster=False, offline=True,
                               storage_gbps_per_node=25)  # fmt: skip
    spot = fast.spot
    assert spot.ranks_per_node == 8 and [n.source for n in spot.notices] == ["AWS", "GCP", "Azure"]
    assert all(n.fits for n in spot.notices)
    # The node's link is shared by its ranks: the save is the busiest node's bytes at it.
    assert spot.save_s == pytest.approx(spot.node_bytes / (25e9 / 8) + 1.0, rel=0.01)
    assert spot.peer is not None and spot.peer.level.steps == 2 and spot.peer.level.buddy
    assert spot.restore_peer_s < spot.restore_storage_s
    # A tenth of the bandwidth misses the 30 s notices, not AWS's 120 s.
    slow = _big(tmp_path).plan(peak_tflops=400, local_cluster=False, offline=True,
                               storage_gbps_per_node=2.5).spot  # fmt: skip
    assert [n.fits for n in slow.notices] == [True, False, False]
    assert [n for n in _big(tmp_path).plan(
        peak_tflops=400, local_cluster=False, offline=True, storage_gbps_per_node=2.5
    ).warnings if "just-in-time" in n and "at 2.5 Gbit/s a node" in n]  # fmt: skip
    # Nodes with a tenth of the memory hold fewer peer snapshots, and say so.
    small = _big(tmp_path, "resources.node_memory_gb=64").plan(
        peak_tflops=400, local_cluster=False, offline=True, storage_gbps_per_node=25
    )
    assert small.spot.peer.level.steps < 2 or not small.spot.peer.level.buddy
    assert "does NOT fit" in small.render()
