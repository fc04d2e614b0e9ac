"""What a restart's new processes cost, against re-forming the ranks that survive.

After a rank is lost, Spotline today starts a new worker group: new processes, their
imports, the rendezvous and the engine build, then the restore. This measures the same
start two ways on the same tiny GPT (ZeRO-1, pp=1, gloo, CPU), in W torch.multiprocessing
ranks that train a few steps before rank W-1 exits:

  fresh     a new process's `import torch, deepspeed` and Spotline's trainer, then
            joining a W-rank process group and building the rank's engine (the first
            build in a process, as a restarted rank pays it)
  reform    in a rank that survives: drop its engine and process group, reset
            DeepSpeed's process-wide state (its communication backend and its groups),
            join a (W-1)-rank process group and build the engine again

It also checks that a re-formed rank trains: its first losses at W-1 ranks equal those
the W ranks trained from the same seed (the global batch is the same, so the math is).
The table gives medians with [min-max] over the surviving ranks of every repeat.

    python benchmarks/reform.py --repeats 3 --json /tmp/reform.json   # about 1 minute a repeat
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))

STEPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spec(world: int):
    from spotline.config import load_spec

    return load_spec(
        None,
        {
            "model.n_layers": 4,
            "model.d_model": 32,
            "model.n_heads": 2,
            "model.seq_len": 32,
            "data.max_bytes": 200_000,
            "parallel.pipeline_stages": 1,
            "parallel.micro_batches": 2,
            "parallel.zero_stage": 1,
            "elastic.min_replicas": 1,
            "elastic.max_replicas": world,
            "train.global_batch_size": 2 * world * (world - 1),  # divides at W and W-1
        },
    )


def _rank(rank: int, world: int, ports: tuple[int, int], q: Any) -> None:
    try:
        t = time.perf_counter()
        import torch

        from spotline.train.process import Topology, init_distributed, leave_distributed
        from spotline.train.trainer import Trainer

        imports_s = time.perf_counter() - t
        torch.set_num_threads(1)
        spec = _spec(world)
        t = time.perf_counter()
        init_distributed(Topology(1, world, rank), "127.0.0.1", ports[0])
        trainer = Trainer(spec, Topology(1, world, rank), threads=1)
        build_s = time.perf_counter() - t
        before = [trainer.train_step() for _ in range(STEPS)]
        torch.distributed.barrier()
        if rank == world - 1:
            os._exit(0)  # the lost rank
        t = time.perf_counter()
        trainer.close()
        del trainer
        leave_distributed()
        init_distributed(Topology(1, world - 1, rank), "127.0.0.1", ports[1])
        trainer = Trainer(spec, Topology(1, world - 1, rank), threads=1)
        reform_s = time.perf_counter() - t
        after = [trainer.train_step() for _ in range(STEPS)]
        trainer.close()
        q.put((rank, {"imports_s": imports_s, "build_s": build_s, "reform_s": reform_s,
                      "same_losses": bool(torch.allclose(torch.tensor(after),
                                                         torch.tensor(before), rtol=1e-5))}))  # fmt: skip
    except BaseException:  # noqa: BLE001 - reported by the parent
        q.put((rank, {"error": traceback.format_exc()}))


def _once(world: int) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ports = (_free_port(), _free_port())
    procs = [ctx.Process(target=_rank, args=(r, world, ports, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = [q.get(timeout=600) for _ in range(world - 1)]
    for p in procs:
        p.join(timeout=60)
    for rank, r in got:
        if "error" in r:
            raise SystemExit(f"rank {rank} failed:\n{r['error']}")
    return [r for _, r in got]


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):6.2f} s [{min(xs):.2f}-{max(xs):.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=3, help="ranks before the loss (>= 2)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for i in range(args.repeats):
        rows += _once(args.world)
        print(f"[reform] repeat {i + 1}/{args.repeats} done", flush=True)
    fresh = [r["imports_s"] + r["build_s"] for r in rows]
    reform = [r["reform_s"] for r in rows]
    ratio = [f / r for f, r in zip(fresh, reform, strict=True)]
    print(f"\n{args.world} -> {args.world - 1} ranks, {len(rows)} surviving ranks measured")
    print(f"  fresh process (imports + first build)  {_fmt(fresh)}")
    print(f"    of which imports                     {_fmt([r['imports_s'] for r in rows])}")
    print(f"  re-formed in place                     {_fmt(reform)}")
    print(f"  fresh / re-formed                      {statistics.median(ratio):6.1f}x "
          f"[{min(ratio):.1f}-{max(ratio):.1f}]")  # fmt: skip
    print(f"  same losses after re-forming           {all(r['same_losses'] for r in rows)}")
    if args.json:
        args.json.write_text(json.dumps({"world": args.world, "ranks": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
