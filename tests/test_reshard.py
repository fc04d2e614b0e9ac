"""Resharding a checkpoint across replica counts, bit for bit (real DeepSpeed on gloo).

Ranks run as torch.multiprocessing processes with the same `Trainer` the Ray
workers host: this checks the state arithmetic itself, without Ray in the way.
D=2 -> D=1 -> D=2 on a 2-stage pipeline with ZeRO-1: after each load, the
gathered fp32 weights and Adam moments equal the saved ones exactly.
"""

from __future__ import annotations

import shutil
import socket
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.ray

STEPS = 3


def _spec(replicas: int):
    from spotline.config import load_spec

    return load_spec(
        None,
        {
            "model.n_layers": 2,
            "model.d_model": 32,
            "model.n_heads": 2,
            "model.seq_len": 32,
            "data.max_bytes": 200_000,
            "parallel.pipeline_stages": 2,
            "parallel.micro_batches": 2,
            "elastic.min_replicas": replicas,
            "elastic.max_replicas": replicas,
            "train.global_batch_size": 8,
        },
    )


def _rank_main(rank, replicas, port, load_from, load_step, save_to, queue):
    try:
        from spotline.workers import portable
        from spotline.workers.trainer import Topology, Trainer, init_distributed

        topo = Topology(2, replicas, rank)
        init_distributed(topo, "127.0.0.1", port)
        trainer = Trainer(_spec(replicas), topo, threads=1)
        report = {"rank": rank}
        if load_from is not None:
            trainer.load(Path(load_from), load_step)
            now = portable.gather(trainer.engine)
            files = sorted(
                (Path(load_from) / f"global_step{load_step}" / "spotline").glob(
                    "stage_*.safetensors"
                )
            )
            saved = portable.load_files(files)
            report["exact"] = all(
                torch.equal(now["params"][name][k], saved["params"][name][k])
                for name in now["params"]
                for k in ("param", "exp_avg", "exp_avg_sq")
            )
            report["adam_step"] = float(now["adam_step"])
            report["names"] = sorted(now["params"])
        report["losses"] = [trainer.train_step() for _ in range(STEPS)]
        trainer.save(Path(save_to) / f"rank_{rank}")
        report["step"] = trainer.step
        queue.put(report)
    except Exception:  # noqa: BLE001 - shipped to the test
        queue.put({"rank": rank, "error": traceback.format_exc()})


def _launch(replicas, load_from, load_step, save_to):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank_main, args=(r, replicas, port, load_from, load_step, save_to, queue)
        )
        for r in range(2 * replicas)
    ]
    for p in procs:
        p.start()
    reports = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    errors = [r["error"] for r in reports if "error" in r]
    assert not errors, errors[0]
    # Merge every rank's files into one checkpoint directory, as the store does.
    merged = Path(save_to) / "merged"
    for rank_dir in Path(save_to).glob("rank_*"):
        shutil.copytree(rank_dir, merged, dirs_exist_ok=True)
    return sorted(reports, key=lambda r: r["rank"]), merged


def test_reshard_2_to_1_to_2_is_exact(tmp_path):
    first, ckpt_a = _launch(2, None, None, tmp_path / "a")
    assert first[0]["step"] == STEPS
    shrunk, ckpt_b = _launch(1, ckpt_a, STEPS, tmp_path / "b")
    assert all(r["exact"] for r in shrunk), "state changed when going from 2 to 1 replicas"
    assert {r["adam_step"] for r in shrunk} == {float(STEPS)}
    assert shrunk[0]["names"] and all(n.split(".")[0].isdigit() for n in shrunk[0]["names"])
    # Same weights and the same global batch: the first step's loss barely moves
    # (only the order of the data-parallel sum differs).
    grown, _ = _launch(2, ckpt_b, 2 * STEPS, tmp_path / "c")
    assert all(r["exact"] for r in grown), "state changed when going from 1 to 2 replicas"
    assert {r["adam_step"] for r in grown} == {float(2 * STEPS)}
    assert grown[0]["losses"][0] < first[0]["losses"][0]
