"""The check for a first GPU: MFU of a ~1B Llama, the pipeline bubble from CUDA events,
and backfill on a GPU, in one invocation that writes every figure to --json.

Arms (each in its own processes; an arm that fails is recorded with its error and the
others still run):

mfu       one rank trains the `llama-1b` preset (seq 2048, bf16 by default on a GPU) for
          --steps steps, eager, then again with every block compiled
          (parallel.compile): tokens/s (wall-clock over the timed steps), MFU against
          the device's peak at the precision in force, peak device memory, and the
          losses (they must fall). The compiled/eager ratio decides whether compiled
          blocks become the GPU default.
pipeline  two ranks, a 2-stage 1F1B pipeline on the same device: the bubble Spotline's
          recorder measured (CUDA events on a GPU) against (p-1)/(m+p-1). NCCL refuses
          two ranks on one GPU; the arm then runs the pipeline's process group on gloo
          and says so.
backfill  the bubbles benchmark's 2x4 arm (benchmarks/bubbles.py: a Ray job with
          backfill off, then on): fill, overrun and training's slowdown. It places one
          worker per device, so on a GPU it needs two of them; with one it is skipped,
          saying so.
keeper    (inside the mfu arm's eager run) the rank's peer copy of the trained 1B
          model, put in a state keeper: the bytes it holds against the plan's figure
          for that rank, and the plan's keeper bytes per node for the preset on an
          8-GPU node.
abort     one rank on one GPU: its NCCL communicators (two groups) aborted through
          Spotline's abort under its watchdog (`spotline.train.comms`), then a new
          group in the same process and an all-reduce there: the abort's seconds,
          whether its watchdog fired, torch's error-handling mode in force, and the
          seconds to destroy a healthy group under the destroy's watchdog.
inplace   with two or more GPUs: a Spotline job of up to 3 replicas (pp=1, NCCL) on a
          local Ray cluster, one rank's process killed at step 30: the survivors must
          keep their PIDs and re-form in place; the seconds from the kill to training
          again, and any abort that hung (with the node it cordoned). With one GPU it
          is skipped, saying so.

    python benchmarks/gpu_check.py [--device gpu|cpu] [--tiny] [--steps N]
                                   [--arms mfu,pipeline,backfill,abort,inplace] [--json PATH]

On this project's CPU machines: `--device cpu --tiny` runs every arm end to end on a
tiny Llama (the figures then only show that the script works).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "platform"))

WARMUP_STEPS = 3  # not timed: allocator warm-up, compilation, the first p2p set-up


def job_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The checked job: the llama-1b preset at seq 2048 (tiny: a 2-layer Llama)."""
    if args.tiny:
        model = {"kind": "llama", "n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2}
        model.update(seq_len=64, vocab_size=256)
    else:
        model = {"kind": "llama", "preset": "llama-1b", "seq_len": 2048, "vocab_size": 128256}
    return {
        "name": "gpu-check",
        "model": model,
        "tokenizer": {"kind": "byte"},
        "data": {"max_bytes": 4_000_000},
        "parallel": {"micro_batches": args.micro_batches, "zero_stage": 1},
        "elastic": {"min_replicas": 1, "max_replicas": 1},
        "train": {
            "steps": args.steps + WARMUP_STEPS,
            "global_batch_size": args.micro_batches * args.micro_batch_size,
            "warmup_steps": 2,
            "lr": 3e-4,
        },
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- in the rank processes ---------------------------------------------------------


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, arm: str, q) -> None:
    try:
        q.put((rank, _train(rank, world, port, args, arm)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which records it
        q.put((rank, {"error": traceback.format_exc(limit=8)}))


def _train(rank: int, world: int, port: int, args, arm: str) -> dict[str, Any]:
    import torch

    from spotline.config import load_spec
    from spotline.metrics.mfu import device_peak
    from spotline.train.process import Topology, init_distributed
    from spotline.train.trainer import Trainer

    gpu = args.device == "gpu"
    over = job_overrides(args)
    over["parallel"]["compile"] = arm == "compiled"
    over["parallel"]["pipeline_stages"] = world
    spec = load_spec(None, over)
    topo = Topology(world, 1, rank)
    backend_device = args.device
    if world > 1 and gpu and args.pipeline_backend == "gloo":
        backend_device = "cpu"  # the process group on gloo; the layers still on cuda:0
    threads = None if gpu else max(1, (os.cpu_count() or 2) // world)
    backend = init_distributed(topo, "127.0.0.1", port, backend_device, 0)
    trainer = Trainer(spec, topo, threads=threads)
    spec = trainer.spec  # the precision in force here
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    losses = [trainer.train_step() for _ in range(WARMUP_STEPS)]
    if trainer.recorder is not None:
        trainer.recorder.take_totals()  # the warm-up's steps are not counted
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    sync()
    t0 = time.perf_counter()
    losses += [trainer.train_step() for _ in range(args.steps)]
    sync()
    wall = time.perf_counter() - t0
    tokens = spec.global_batch(1) * spec.model.seq_len * args.steps
    name, peak = device_peak(spec.parallel.precision, threads)
    out: dict[str, Any] = {
        "backend": backend,
        "device": name,
        "precision": spec.parallel.precision,
        "peak_flops": peak,
        "losses": losses,
        "timed_steps": args.steps,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "peak_device_bytes": torch.cuda.max_memory_allocated() if gpu else None,
    }
    if peak:
        out["mfu"] = trainer.model_def.flops_per_token * out["tokens_per_s"] / (peak * world)
    if trainer.recorder is not None:
        t = trainer.recorder.take_totals()
        out["recorder"] = t
        out["bubble_fraction"] = t["wait_s"] / t["step_s"] if t["step_s"] else None
    if arm == "eager" and world == 1:
        out["keeper"] = keeper_bytes(trainer, spec)
    trainer.prefetch.close()
    return out


def keeper_bytes(trainer: Any, spec: Any) -> dict[str, Any]:
    """The rank's peer copy, as a save writes it, put in a state keeper (in this
    process): what the keeper holds against the plan's figure for the rank."""
    from spotline.checkpoint.peer import peer_copy
    from spotline.planning.peer_memory import node_peer_memory, rank_copy_bytes
    from spotline.runtime.keeper import StateKeeper

    with tempfile.TemporaryDirectory(prefix="spotline-gpu-keeper-") as d:
        written = trainer.write(trainer.snapshot(), Path(d))
        copy, blobs = peer_copy("check", 0, 1, trainer.step, Path(d), written)
        keeper = StateKeeper()
        held = keeper.put(copy.to_dict(), blobs)
    planned = rank_copy_bytes(spec, 1)[0]
    node = node_peer_memory(spec, 8, ranks_per_node=8, node_ram=None)
    return {
        "measured_bytes": held,
        "planned_bytes": planned,
        "measured_over_planned": held / planned,
        "plan_per_node_8_gpus_dp8": node.full,
    }


def _abort_rank(device: str, q) -> None:
    try:
        q.put((0, _abort_and_reform(device)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which records it
        q.put((0, {"error": traceback.format_exc(limit=8)}))


def _abort_and_reform(device: str) -> dict[str, Any]:
    """One rank: a group (and a second one) that all-reduce, aborted as a failing rank
    aborts them; then a new group in the same process, as a survivor re-forms."""
    import torch
    import torch.distributed as dist

    from spotline.train.comms import comms_for
    from spotline.train.process import Topology, backend_for, init_distributed, leave_distributed

    topo, gpu = Topology(1, 1, 0), device == "gpu"
    where = torch.device("cuda", 0) if gpu else torch.device("cpu")
    comms = comms_for(backend_for(device), 0, "local")
    comms.begin()
    backend = init_distributed(topo, "127.0.0.1", _free_port(), device, 0)
    side = dist.new_group([0])
    t = torch.ones(1 << 20, device=where)
    dist.all_reduce(t)
    dist.all_reduce(t, group=side)
    if gpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    cut = comms.abort()
    abort_s = time.perf_counter() - t0
    out: dict[str, Any] = {
        "backend": backend,
        "error_handling": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"),
        "abort_s": abort_s,
        "cut": cut.n,
        "hung": str(cut.hung) if cut.hung else None,
    }
    leave_distributed(0, "local")  # after an NCCL abort: nothing left to destroy
    init_distributed(topo, "127.0.0.1", _free_port(), device, 0)  # re-formed
    t = torch.ones(4, device=where)
    dist.all_reduce(t)
    out["all_reduce_after"] = t.tolist() == [1.0] * 4
    t0 = time.perf_counter()
    leave_distributed(0, "local")  # a healthy group, destroyed under its watchdog
    out["destroy_s"] = time.perf_counter() - t0
    return out


def run_ranks(world: int, args: argparse.Namespace, arm: str) -> dict[str, Any]:
    """`world` rank processes of one arm; rank 0's figures (or the first error)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, arm, q)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    try:
        for _ in procs:
            rank, r = q.get(timeout=args.arm_timeout_s)
            results[rank] = r
    except Exception:  # noqa: BLE001 - a rank that hung: the arm failed
        results.setdefault(-1, {"error": f"no result within {args.arm_timeout_s} s"})
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [r["error"] for r in results.values() if "error" in r]
    if errors:
        return {"error": errors[0]}
    if world > 1:  # every stage's bubble; the step is the same on every rank
        return {
            **results[0],
            "bubble_per_stage": [results[r].get("bubble_fraction") for r in sorted(results)],
        }
    return results[0]


# --- arms ------------------------------------------------------------------------------


def arm_mfu(args: argparse.Namespace) -> dict[str, Any]:
    eager = run_ranks(1, args, "eager")
    compiled = run_ranks(1, args, "compiled")
    out = {"eager": eager, "compiled": compiled}
    if "error" not in eager:
        losses = eager["losses"]
        out["loss_falls"] = losses[-1] < losses[0]
        if "error" not in compiled:
            out["compiled_over_eager_tokens_per_s"] = (
                compiled["tokens_per_s"] / eager["tokens_per_s"]
            )
    return out


def arm_pipeline(args: argparse.Namespace) -> dict[str, Any]:
    p, m = 2, args.micro_batches
    out: dict[str, Any] = {"stages": p, "micro_batches": m, "theory": (p - 1) / (m + p - 1)}
    args.pipeline_backend = "nccl" if args.device == "gpu" else "gloo"
    got = run_ranks(p, args, "pipeline")
    if "error" in got and args.device == "gpu":
        out["nccl_error"] = got["error"].strip().splitlines()[-1]
        out["note"] = "NCCL refused two ranks on one GPU: the process group ran on gloo"
        args.pipeline_backend = "gloo"
        got = run_ranks(p, args, "pipeline")
    out.update(got)
    if got.get("bubble_fraction") is not None:
        out["measured_over_theory"] = got["bubble_fraction"] / out["theory"]
    return out


def arm_backfill(args: argparse.Namespace) -> dict[str, Any]:
    if args.device == "gpu":
        import torch

        if torch.cuda.device_count() < 2:
            return {
                "skipped": "a 2-stage pipeline places one worker per GPU and this machine "
                "has one; run `python benchmarks/bubbles.py --shapes 2x4` on a node "
                "with two GPUs"
            }
    import bubbles

    steps = 200 if args.tiny else 300
    ns = argparse.Namespace(steps=steps, interval=20, spec_steps=0)
    os.environ["SPOTLINE_PIN_CORES"] = "1" if args.device == "cpu" else "0"
    with tempfile.TemporaryDirectory(prefix="spotline-gpu-check-") as tmp:
        got = bubbles.measure(2, 4, ns, Path(tmp))
    keys = (
        "bubble_theory",
        "bubble_measured",
        "fill",
        "overrun_fraction",
        "slowdown",
        "steps_with_backfill_on",
        "tasks_done",
    )
    return {k: got[k] for k in keys} | {"steps": steps}


def arm_abort(args: argparse.Namespace) -> dict[str, Any]:
    """The abort and a re-form in one process, in a process of its own."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_abort_rank, args=(args.device, q))
    p.start()
    try:
        return q.get(timeout=args.arm_timeout_s)[1]
    except Exception:  # noqa: BLE001 - the rank hung: the arm failed
        return {"error": f"no result within {args.arm_timeout_s} s"}
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()


def arm_inplace(args: argparse.Namespace) -> dict[str, Any]:
    """Survivors keep their processes on NCCL (gloo with --device cpu)."""
    import signal

    import ray

    import spotline
    from spotline.config import load_spec

    if args.device == "gpu":
        import torch

        devices = torch.cuda.device_count()
        if devices < 2:
            return {"skipped": "in-place re-forming on NCCL needs two GPUs; this machine has one"}
    else:
        devices = 3
    replicas, kill_at = min(3, devices), 30
    over = job_overrides(args)
    over["name"] = "gpu-check-inplace"
    over["model"] = {"n_layers": 2, "d_model": 256, "n_heads": 4, "seq_len": 128}
    over["elastic"] = {"min_replicas": 1, "max_replicas": replicas}
    over["train"] |= {"steps": 400, "global_batch_size": 2 * replicas * 2}
    over["resources"] = {"device": args.device, "cpus_per_worker": 0.5}
    over["recovery"] = {"peer_interval_steps": 5}
    over["parallel"] = {"micro_batches": 2, "zero_stage": 1}
    with tempfile.TemporaryDirectory(prefix="spotline-gpu-inplace-") as tmp:
        over["checkpoint"] = {"uri": f"file://{tmp}/ckpt", "staging_dir": f"{tmp}/staging"}
        spec = load_spec(None, over)
        gpus = {"num_gpus": devices} if args.device == "gpu" else {}
        ray.init(address="local", include_dashboard=False, log_to_driver=False, **gpus)
        try:
            run = spotline.Job(spec).start()
            while run.status()["step"] < kill_at:
                time.sleep(0.05)
            workers = run.status()["workers"]
            victim = workers[-1]
            before = {w["pid"] for w in workers[:-1]}
            t0 = time.time()
            os.kill(victim["pid"], signal.SIGKILL)
            events: list[str] = []
            while True:
                st = run.status()
                events += [str(e) for e in st.get("events") or []]
                if st["step"] > kill_at + 2 and st["replicas"] and st["workers"]:
                    pids = {w["pid"] for w in st["workers"]}
                    if victim["pid"] not in pids:
                        break
                if time.time() - t0 > args.arm_timeout_s:
                    return {"error": f"not training again within {args.arm_timeout_s:.0f}s"}
                time.sleep(0.05)
            back_s = time.time() - t0
            result = run.stop()
        finally:
            ray.shutdown()
    return {
        "backend": "nccl" if args.device == "gpu" else "gloo",
        "ranks": replicas,
        "survivors_kept_pids": before <= pids,
        "kill_to_training_s": back_s,
        "kept": [a.get("kept", 0) for a in result.attempts[1:]],
        "recoveries": result.recoveries,
        "abort_hung": [e for e in events if "did not return within" in e],
        "cordoned": (getattr(result, "health", None) or {}).get("cordoned") or {},
    }


ARMS = {
    "mfu": arm_mfu,
    "pipeline": arm_pipeline,
    "backfill": arm_backfill,
    "abort": arm_abort,
    "inplace": arm_inplace,
}


def render(report: dict[str, Any]) -> str:
    lines = [f"Spotline GPU check on {report['device_name']} ({report['device']})"]
    mfu = report.get("mfu", {})
    for mode in ("eager", "compiled"):
        r = mfu.get(mode)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"  mfu {mode:9s} failed: {r['error'].strip().splitlines()[-1]}")
            continue
        lines.append(
            f"  mfu {mode:9s} {r['tokens_per_s']:,.0f} tokens/s, MFU "
            + (f"{r['mfu']:.1%}" if r.get("mfu") is not None else "n/a")
            + f" ({r['precision']}), loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}"
            + (
                f", peak {r['peak_device_bytes'] / 2**30:.1f} GiB"
                if r.get("peak_device_bytes")
                else ""
            )
        )
    if "compiled_over_eager_tokens_per_s" in mfu:
        lines.append(f"  compiled / eager  {mfu['compiled_over_eager_tokens_per_s']:.2f}x")
    keeper = (mfu.get("eager") or {}).get("keeper")
    if keeper:
        lines.append(
            f"  keeper            {keeper['measured_bytes'] / 1e9:.2f} GB held for the rank, "
            f"{keeper['measured_over_planned']:.3f}x the plan; plan per 8-GPU node (dp=8): "
            f"{keeper['plan_per_node_8_gpus_dp8'] / 1e9:.1f} GB"
        )
    pipe = report.get("pipeline", {})
    if pipe:
        if "error" in pipe:
            lines.append(f"  pipeline failed: {pipe['error'].strip().splitlines()[-1]}")
        elif pipe.get("bubble_fraction") is not None:
            lines.append(
                f"  pipeline 2x{pipe['micro_batches']} bubble {pipe['bubble_fraction']:.1%} "
                f"(theory {pipe['theory']:.1%}), backend {pipe['backend']}"
            )
    fill = report.get("backfill", {})
    if "skipped" in fill:
        lines.append(f"  backfill skipped: {fill['skipped']}")
    elif "error" in fill:
        lines.append(f"  backfill failed: {fill['error'].strip().splitlines()[-1]}")
    elif fill:
        lines.append(
            f"  backfill 2x4 fill {fill['fill']:.1%}, overrun {fill['overrun_fraction']:.1%}"
            f" of a step, slowdown {fill['slowdown']:.3f}x"
        )
    abort = report.get("abort", {})
    if "error" in abort:
        lines.append(f"  abort failed: {abort['error'].strip().splitlines()[-1]}")
    elif abort:
        lines.append(
            f"  abort    {abort['backend']} ({abort['error_handling'] or 'mode unset'}): "
            f"{abort['cut']} cut in {abort['abort_s']:.2f}s"
            + (f", HUNG: {abort['hung']}" if abort["hung"] else "")
            + f"; re-formed and all-reduced: {abort['all_reduce_after']}; destroy "
            f"{abort['destroy_s']:.2f}s"
        )
    inplace = report.get("inplace", {})
    if "skipped" in inplace:
        lines.append(f"  inplace skipped: {inplace['skipped']}")
    elif "error" in inplace:
        lines.append(f"  inplace failed: {inplace['error'].strip().splitlines()[-1]}")
    elif inplace:
        lines.append(
            f"  inplace {inplace['ranks']} ranks ({inplace['backend']}): survivors kept their "
            f"PIDs: {inplace['survivors_kept_pids']}; kill -> training "
            f"{inplace['kill_to_training_s']:.1f}s"
            + (f"; aborts that hung: {inplace['abort_hung']}" if inplace["abort_hung"] else "")
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer Llama (checks the script)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per run")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=None)
    ap.add_argument("--arms", default="mfu,pipeline,backfill,abort,inplace")
    ap.add_argument("--arm-timeout-s", type=float, default=400.0)
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    if args.steps is None:
        args.steps = 4 if args.tiny else 30
    if args.micro_batch_size is None:
        args.micro_batch_size = 2
    args.pipeline_backend = "gloo"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.device == "gpu" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; use --device cpu --tiny to check the script")
        return 2
    report: dict[str, Any] = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name(0) if args.device == "gpu" else "cpu",
        "tiny": args.tiny,
        "argv": sys.argv[1:],
    }
    for name in args.arms.split(","):
        t0 = time.perf_counter()
        try:
            report[name] = ARMS[name](args)
        except Exception:  # noqa: BLE001 - one arm's failure is recorded; the others run
            report[name] = {"error": traceback.format_exc(limit=8)}
        report[name]["arm_s"] = time.perf_counter() - t0
        if args.json:  # written after every arm: a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
