"""Step time with the uniform and the balanced stage partition, on a deliberately
unequal CPU pipeline, in one run.

The pipeline: 2 stages x 1 replica (torch.multiprocessing, spawn, gloo), the same
`Trainer` Spotline's workers use. The model is a GPT of 6 blocks, 64 wide, whose head
over a 4096-token vocabulary costs several blocks: its layers are unequal. The stages'
thread budgets (`resources.stages[].cpus`, `--threads`) are 1 and 2 on a host with 3
or more cores; on fewer, 1 and 1, as 3 threads on 2 cores oversubscribe the host and
the 2-thread stage stalls at its thread pool's barriers whenever another process runs. The uniform partition splits the blocks
evenly, so the head's cost lands on the last stage; the balanced one is what a
`parallel.partition: balanced` job runs: each worker's matmul probe and each stage's
per-layer forward + backward times (`spotline.train.profile.probe`, one rank at a
time), cut by `spotline.planning.choice.choose_partition`.

Every repeat probes, builds one engine at each partition, warms each up for W steps,
then runs N timed steps of each, taking turns step by step so that both see the same
load on the host. Step time is rank 0's median seconds per step over the N steps, up
to the end of the per-step agreement of all ranks (where a worker's next step starts). Stage imbalance is each stage's compute seconds
over the N steps (the StepRecorder's forward, backward, micro-batch load and optimizer
instructions), max / mean - 1. The table shows medians with [min-max] over repeats.

    python benchmarks/partition.py --json /tmp/partition.json     # about 1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ranks import BenchmarkError, exit_now, free_port, redirect_output, spawn_ranks

STAGES = 2


def bench_spec(workdir: Path, threads: list[int]) -> Any:
    from spotline.config import load_spec

    return load_spec(
        {
            "name": "partition-bench",
            "model": {
                "n_layers": 6,
                "d_model": 64,
                "n_heads": 2,
                "seq_len": 32,
                "vocab_size": 4096,
            },
            "data": {"max_bytes": 300_000},
            "parallel": {"pipeline_stages": STAGES, "micro_batches": 8, "partition": "balanced"},
            "elastic": {"min_replicas": 1, "max_replicas": 1},
            "train": {"steps": 1000, "global_batch_size": 32, "warmup_steps": 5},
            "checkpoint": {
                "uri": f"file://{workdir}/ckpt",
                "staging_dir": str(workdir / "staging"),
            },
            "resources": {"device": "cpu", "stages": [{"cpus": t} for t in threads]},
        }
    )


def _rank(
    rank: int,
    spec_json: str,
    port: int,
    repeats: int,
    warmup: int,
    steps: int,
    workdir: str,
    results: Any,
) -> None:
    redirect_output(Path(workdir) / f"rank_{rank}.log")
    import torch.distributed as dist

    from spotline.config.schema import JobSpec
    from spotline.models import model_def
    from spotline.planning.choice import choose_partition
    from spotline.planning.partition import imbalance, stage_bounds
    from spotline.train.process import Topology, init_distributed
    from spotline.train.profile import probe
    from spotline.train.trainer import Trainer

    spec = JobSpec.model_validate_json(spec_json)
    topo = Topology(STAGES, 1, rank)
    threads = max(1, int(spec.resources.stage(topo.stage).cpus))
    init_distributed(topo, "127.0.0.1", port)
    uniform = stage_bounds(model_def(spec), STAGES)
    out: list[dict[str, Any]] = []
    try:
        for _ in range(repeats):
            # One rank at a time, as a CPU group probes: the ranks share the host's cores.
            mine = None
            for r in range(STAGES):
                if r == rank:
                    mine = probe(spec, rank, threads, layers=True, replicas=1)
                dist.barrier()
            probes: list[Any] = [None] * STAGES
            dist.all_gather_object(probes, mine)
            chosen = choose_partition(spec, 1, probes)
            row: dict[str, Any] = {"balanced_bounds": chosen["bounds"], "uniform_bounds": uniform}
            row["predicted_imbalance_before"] = chosen["predicted_uniform_imbalance"]
            row["predicted_imbalance_after"] = chosen["predicted_imbalance"]
            arms = {"uniform": uniform, "balanced": chosen["bounds"]}
            trainers = {
                arm: Trainer(spec, topo, threads=threads, bounds=b) for arm, b in arms.items()
            }
            for tr in trainers.values():
                for _ in range(warmup):
                    tr.train_step()
                tr.recorder.take_totals()
            # The arms take turns step by step, so that both see the same load on the host.
            times: dict[str, list[float]] = {arm: [] for arm in arms}
            for _ in range(steps):
                for arm, tr in trainers.items():
                    t0 = time.perf_counter()
                    tr.train_step()
                    # The per-step agreement, as a worker runs it: it waits for the slowest
                    # stage, so the step ends for every rank together.
                    tr.agree(0, 0)
                    times[arm].append(time.perf_counter() - t0)
            for arm, tr in trainers.items():
                compute = tr.recorder.take_totals()["compute_s"]
                stage_compute: list[Any] = [None] * STAGES
                dist.all_gather_object(stage_compute, compute)
                row[f"{arm}_step_s"] = statistics.median(times[arm])
                row[f"{arm}_stage_compute_s"] = [c / steps for c in stage_compute]
                row[f"imbalance_{'before' if arm == 'uniform' else 'after'}"] = imbalance(
                    stage_compute
                )
            del trainers
            dist.barrier()
            out.append(row)
        if rank == 0:
            results.put({"repeats": out})
    finally:
        dist.destroy_process_group()
    exit_now()


def summarize(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("uniform_step_s", "balanced_step_s", "imbalance_before", "imbalance_after"):
        vals = [r[key] for r in repeats]
        out[key] = statistics.median(vals)
        out[f"{key}_min"], out[f"{key}_max"] = min(vals), max(vals)
    out["speedup"] = out["uniform_step_s"] / out["balanced_step_s"]
    ratios = [r["uniform_step_s"] / r["balanced_step_s"] for r in repeats]
    out["speedup_min"], out["speedup_max"] = min(ratios), max(ratios)
    out["repeats"] = repeats
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--threads",
        default="1,2" if (os.cpu_count() or 1) >= 3 else "1,1",
        help="torch threads of stage 0 and stage 1 (default 1,2; 1,1 below 3 cores)",
    )
    ap.add_argument("--warmup", type=int, default=3, help="warm-up steps per arm (untimed)")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per arm")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    from spotline.planning.partition import sizes_from_bounds

    workdir = Path(tempfile.mkdtemp(prefix="spotline-partition-"))
    threads = [int(t) for t in args.threads.split(",")]
    if len(threads) != STAGES or min(threads) < 1:
        ap.error(f"--threads takes {STAGES} thread counts >= 1, e.g. 1,2")
    spec = bench_spec(workdir, threads)
    try:
        got = spawn_ranks(
            _rank,
            (
                spec.model_dump_json(),
                free_port(),
                args.repeats,
                args.warmup,
                args.steps,
                str(workdir),
            ),
            STAGES,
            workdir,
            args.timeout,
            "partition benchmark",
        )
    except BenchmarkError as e:
        print(e, file=sys.stderr)
        return 1
    res = summarize(got["repeats"])

    def fig(key: str, fmt: str) -> str:
        return f"{res[key]:{fmt}} [{res[key + '_min']:{fmt}}-{res[key + '_max']:{fmt}}]"

    print(
        f"2 stages ({threads[0]} and {threads[1]} threads), GPT 6 x 64, vocab 4096; "
        f"{args.repeats} repeats of {args.steps} steps"
    )
    print(f"  layers per stage, uniform: {sizes_from_bounds(res['repeats'][0]['uniform_bounds'])}")
    for i, r in enumerate(res["repeats"]):
        print(
            f"  layers per stage, balanced (repeat {i + 1}): {sizes_from_bounds(r['balanced_bounds'])}"
        )
    print(
        f"  step s     uniform {fig('uniform_step_s', '.4f')}   balanced {fig('balanced_step_s', '.4f')}"
    )
    print(
        f"  imbalance  before  {fig('imbalance_before', '.3f')}   after    {fig('imbalance_after', '.3f')}"
    )
    print(
        f"  speedup (uniform / balanced median step time): {res['speedup']:.2f}x "
        f"[per repeat {res['speedup_min']:.2f}-{res['speedup_max']:.2f}]"
    )
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
