"""Spotline's overhead against plain DeepSpeed: the same model, data and config, run twice.

direct    one process per rank (torch.multiprocessing, spawn), each building the
          same `Trainer` Spotline's Ray actors use, with no Ray anywhere. After the
          timed steps it also times a fully synchronous save + upload: the cost a
          training loop pays when nothing uploads in the background.
spotline  `spotline.Job(spec).run()` on a local Ray cluster this script starts.

Both train warm-up + timed steps (W + N). Direct steps/s counts the N timed steps
only. Spotline's `steps_per_s` is the controller's wall time of every training
chunk (start-up, restore, checkpoint saves and the final evaluation excluded), so
it includes the first W steps too; the table therefore also shows direct steps/s
over all W + N steps, the same accounting. Blocked fraction = mean seconds a
Spotline checkpoint blocks training / mean seconds of the synchronous save + upload.

    python benchmarks/overhead.py [CONFIG] [--set KEY=VALUE ...] [--repeats R] [--json PATH]

This script only measures: it never changes a spec field other than train.steps and
checkpoint.{uri,interval_steps,staging_dir}, which it owns (see --steps, --warmup,
--interval, --uri).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "quickstart.yaml"
# Spec fields this benchmark sets itself, and the flag to use instead of --set.
OWNED_FIELDS = {
    "train.steps": "--warmup/--steps",
    "checkpoint.interval_steps": "--interval",
    "checkpoint.uri": "--uri",
    "checkpoint.staging_dir": "(a temp directory)",
}
LOG_TAIL_LINES = 40


class BenchmarkError(RuntimeError):
    """A run failed; the message carries the failing rank's traceback or the job's error."""


@dataclass
class DirectResult:
    steps_per_s: float  # N timed steps / their wall time on rank 0
    all_steps_per_s: float  # W + N steps / their wall time (Spotline's accounting)
    first_step_s: float
    cpu_s_per_step: float  # CPU seconds of all ranks together, per timed step
    sync_save_upload_s: list[float]  # max over ranks, one per save
    torch_threads: int
    interop_threads: int
    omp_num_threads: str | None


@dataclass
class SpotlineResult:
    steps_per_s: float
    checkpoint_blocked_s: list[float]
    checkpoint_upload_s: list[float]
    steps: int
    replicas: int
    wall_s: float


@dataclass
class Repeat:
    direct: DirectResult
    spotline: SpotlineResult
    derived: dict[str, float] = field(default_factory=dict)


# --- the direct run (no Ray) -------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _redirect_output(path: Path) -> None:
    # DeepSpeed prints from every rank; keep it out of the table, in a per-rank log.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _direct_rank(
    rank: int,
    spec_json: str,
    replicas: int,
    port: int,
    warmup: int,
    steps: int,
    saves: int,
    workdir: str,
    results: Any,
) -> None:
    """One rank of the direct run; rank 0 puts the figures on `results`."""
    _redirect_output(Path(workdir) / f"rank_{rank}.log")
    import torch
    import torch.distributed as dist

    from spotline.config.schema import JobSpec
    from spotline.preflight import open_store
    from spotline.workers.trainer import Topology, Trainer, init_distributed

    spec = JobSpec.model_validate_json(spec_json)
    topo = Topology(spec.parallel.pipeline_stages, replicas, rank)
    init_distributed(topo, "127.0.0.1", port)
    try:
        trainer = Trainer(spec, topo, threads=max(1, int(spec.resources.cpus_per_worker)))
        dist.barrier()
        t_all = time.perf_counter()
        trainer.train_step()
        first_step_s = time.perf_counter() - t_all
        for _ in range(warmup - 1):
            trainer.train_step()
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            trainer.train_step()
        dist.barrier()
        t1 = time.perf_counter()
        cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
        dist.all_reduce(cpu)

        store = open_store(spec)
        sync: list[float] = []
        for i in range(saves):
            local = Path(workdir) / "staging" / f"rank_{rank:05d}" / f"save_{i}"
            dist.barrier()
            s0 = time.perf_counter()
            trainer.save(local)
            store.upload_dir(local, trainer.step)
            worst = torch.tensor([time.perf_counter() - s0], dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            sync.append(float(worst.item()))
            shutil.rmtree(local, ignore_errors=True)

        if rank == 0:
            results.put(
                asdict(
                    DirectResult(
                        steps_per_s=steps / (t1 - t0),
                        all_steps_per_s=(warmup + steps) / (t1 - t_all),
                        first_step_s=first_step_s,
                        cpu_s_per_step=float(cpu.item()) / steps,
                        sync_save_upload_s=sync,
                        torch_threads=torch.get_num_threads(),
                        interop_threads=torch.get_num_interop_threads(),
                        omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
                    )
                )
            )
    finally:
        dist.destroy_process_group()


def _log_tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-LOG_TAIL_LINES:]) or "(empty log)"


def run_direct(
    spec: Any, replicas: int, warmup: int, steps: int, saves: int, workdir: Path, timeout_s: float
) -> DirectResult:
    import torch.multiprocessing as mp

    world = spec.parallel.pipeline_stages * replicas
    workdir.mkdir(parents=True, exist_ok=True)
    results = mp.get_context("spawn").SimpleQueue()
    args = (
        spec.model_dump_json(),
        replicas,
        _free_port(),
        warmup,
        steps,
        saves,
        str(workdir),
        results,
    )
    ctx = mp.start_processes(
        _direct_rank, args=args, nprocs=world, join=False, start_method="spawn"
    )
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            while not results.empty():
                got.append(results.get())
            if time.monotonic() > deadline:
                raise BenchmarkError(
                    f"direct run did not finish within {timeout_s:.0f}s (--timeout); "
                    f"rank 0 log tail:\n{_log_tail(workdir / 'rank_0.log')}"
                )
    except mp.ProcessRaisedException as e:
        raise BenchmarkError(
            f"direct run: rank {e.error_index} raised:\n{e.msg.strip()}\n"
            f"--- rank {e.error_index} log tail ---\n{_log_tail(workdir / f'rank_{e.error_index}.log')}"
        ) from None
    except mp.ProcessExitedException as e:
        raise BenchmarkError(
            f"direct run: rank {e.error_index} exited with code {e.exit_code}"
            + (f" (signal {e.signal_name})" if e.signal_name else "")
            + f"\n--- rank {e.error_index} log tail ---\n"
            + _log_tail(workdir / f"rank_{e.error_index}.log")
        ) from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    while not results.empty():
        got.append(results.get())
    if len(got) != 1:
        raise BenchmarkError(f"direct run: rank 0 returned {len(got)} results, expected 1")
    return DirectResult(**got[0])


# --- the Spotline run -------------------------------------------------------------------


def run_spotline(spec: Any, replicas: int, num_cpus: int) -> SpotlineResult:
    import ray

    import spotline
    from spotline.job import JobFailed

    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="WARNING",
    )
    try:
        t0 = time.perf_counter()
        try:
            result = spotline.Job(spec).run(verbose=False)
        except JobFailed as e:
            raise BenchmarkError(f"spotline run failed: {e}\n{e.result.summary()}") from None
        wall = time.perf_counter() - t0
    finally:
        ray.shutdown()
    used = [a["replicas"] for a in result.attempts]
    if result.failures or used != [replicas]:
        raise BenchmarkError(
            f"spotline run is not comparable: attempts with replicas {used}, {result.failures} "
            f"failure(s); expected one attempt of {replicas} replica(s). Give Ray enough CPUs "
            "(--num-cpus) for elastic.max_replicas."
        )
    return SpotlineResult(
        steps_per_s=result.steps_per_s,
        checkpoint_blocked_s=list(result.checkpoint_blocked_s),
        checkpoint_upload_s=list(result.checkpoint_upload_s),
        steps=result.steps,
        replicas=replicas,
        wall_s=wall,
    )


# --- orchestration ------------------------------------------------------------------------


def _remove_prefix(spec: Any) -> None:
    """Delete what one run wrote under its own unique checkpoint prefix."""
    from spotline.preflight import open_store

    store = open_store(spec)
    path = store.uri.split("://", 1)[1]
    try:
        if store.fs.exists(path):
            store.fs.rm(path, recursive=True)
    except Exception as e:  # noqa: BLE001 - leftovers are reported, never fatal
        print(f"overhead.py: could not remove {store.uri}: {e}", file=sys.stderr)


def build_spec(args: argparse.Namespace) -> Any:
    from spotline.config import SpecError, load_spec

    for item in args.set:
        key = item.split("=", 1)[0].strip()
        if key in OWNED_FIELDS:
            raise SpecError(
                f"--set {key}=... is not allowed: the benchmark sets {key} itself "
                f"(use {OWNED_FIELDS[key]})"
            )
    return load_spec(args.config, args.set)


def with_run_fields(spec: Any, uri: str, staging: Path, total_steps: int, interval: int) -> Any:
    from spotline.job import Job

    return (
        Job(spec)
        .with_overrides(
            {
                "train.steps": total_steps,
                "checkpoint.interval_steps": interval,
                "checkpoint.uri": uri,
                "checkpoint.staging_dir": str(staging),
            }
        )
        .spec
    )


def derive(d: DirectResult, s: SpotlineResult) -> dict[str, float]:
    blocked = statistics.fmean(s.checkpoint_blocked_s) if s.checkpoint_blocked_s else math.nan
    sync = statistics.fmean(d.sync_save_upload_s)
    return {
        "direct_steps_per_s": d.steps_per_s,
        "direct_all_steps_per_s": d.all_steps_per_s,
        "spotline_steps_per_s": s.steps_per_s,
        "ratio": s.steps_per_s / d.steps_per_s,
        "ratio_same_accounting": s.steps_per_s / d.all_steps_per_s,
        "checkpoint_blocked_s": blocked,
        "sync_save_upload_s": sync,
        "checkpoint_blocked_fraction": blocked / sync,
        "direct_first_step_s": d.first_step_s,
        "direct_cpu_s_per_step": d.cpu_s_per_step,
    }


def machine_context() -> dict[str, Any]:
    from importlib.metadata import version

    # Versions from package metadata: importing deepspeed here would print its banner.
    return {
        "cores": os.cpu_count(),
        # Taken before the first run: other work on the machine makes the figures noisy.
        "load_avg_1min_at_start": round(os.getloadavg()[0], 2),
        "machine": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(),
        **{name: version(name) for name in ("torch", "deepspeed", "ray")},
    }


def render(
    med: dict[str, float], runs: list[Repeat], spec: Any, args: argparse.Namespace, ctx: dict
) -> str:
    last = runs[-1]
    n_blocked = len(last.spotline.checkpoint_blocked_s)
    n_sync = len(last.direct.sync_save_upload_s)
    rows = [
        ("steps/s (N timed steps)", med["direct_steps_per_s"], None),
        (
            "steps/s (all W+N steps)",
            med["direct_all_steps_per_s"],
            med["spotline_steps_per_s"],
        ),
        ("ratio spotline/direct (N timed)", None, med["ratio"]),
        ("ratio, same accounting (W+N)", None, med["ratio_same_accounting"]),
        (f"checkpoint blocked s/save (x{n_blocked})", None, med["checkpoint_blocked_s"]),
        (f"sync save+upload s/save (x{n_sync})", med["sync_save_upload_s"], None),
        ("checkpoint blocked fraction", None, med["checkpoint_blocked_fraction"]),
    ]
    width = max(len(r[0]) for r in rows)

    def cell(x: float | None) -> str:
        return f"{'-' if x is None else f'{x:.3f}':>10}"

    pp = spec.parallel.pipeline_stages
    reps = last.spotline.replicas
    head = (
        f"{spec.name}: {pp} stage(s) x {reps} replica(s), ZeRO-{spec.parallel.zero_stage}, "
        f"W={args.warmup} warm-up + N={args.steps} timed steps, checkpoint every "
        f"{args.interval}; {'median of ' + str(len(runs)) if len(runs) > 1 else '1 repeat'}"
    )
    lines = [head, f"{'':<{width}}  {'direct':>10}  {'spotline':>10}"]
    lines += [f"{label:<{width}}  {cell(d)}  {cell(s)}" for label, d, s in rows]
    lines.append(
        f"machine: {ctx['cores']} cores ({ctx['machine']}, load avg "
        f"{ctx['load_avg_1min_at_start']} at start), python {ctx['python']}, "
        f"torch {ctx['torch']}, deepspeed {ctx['deepspeed']}, ray {ctx['ray']}; "
        f"torch threads per rank {last.direct.torch_threads}, "
        f"checkpoints at {args.uri or 'a temp file:// dir'}"
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="overhead.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("config", nargs="?", default=str(DEFAULT_CONFIG), help="YAML job spec")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a spec field, as in `spotline run` (repeatable)",
    )
    p.add_argument("--warmup", type=int, default=10, help="W: untimed warm-up steps (direct)")
    p.add_argument("--steps", type=int, default=60, help="N: timed steps (direct)")
    p.add_argument(
        "--interval", type=int, default=20, help="Spotline checkpoint.interval_steps (K)"
    )
    p.add_argument(
        "--sync-saves", type=int, default=3, help="synchronous save+upload timings (direct)"
    )
    p.add_argument("--uri", help="checkpoint store root (default: a temp file:// directory)")
    p.add_argument("--repeats", type=int, default=1, help="alternate direct/spotline R times")
    p.add_argument("--num-cpus", type=int, help="CPUs for the local Ray cluster")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one direct run may take")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    for name, least in (
        ("warmup", 1),
        ("steps", 1),
        ("interval", 1),
        ("sync_saves", 2),
        ("repeats", 1),
    ):
        if getattr(args, name) < least:
            p.error(f"--{name.replace('_', '-')} must be >= {least} (got {getattr(args, name)})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from spotline.config import SpecError

    try:
        base = build_spec(args)
    except SpecError as e:
        print(f"overhead.py: {e}", file=sys.stderr)
        return 2
    replicas = base.elastic.max_replicas
    world = base.parallel.pipeline_stages * replicas
    num_cpus = args.num_cpus or max(
        os.cpu_count() or 1, math.ceil(world * base.resources.cpus_per_worker)
    )
    total = args.warmup + args.steps
    ctx = machine_context()
    tmp = Path(tempfile.mkdtemp(prefix="spotline-overhead-"))
    root = args.uri.rstrip("/") + f"/overhead-{uuid.uuid4().hex[:8]}" if args.uri else None
    runs: list[Repeat] = []
    try:
        for i in range(args.repeats):
            rep = tmp / f"repeat_{i}"
            store_root = root or f"file://{tmp}/store"
            direct_spec = with_run_fields(
                base, f"{store_root}/r{i}-direct", rep / "staging", total, args.interval
            )
            spot_spec = with_run_fields(
                base, f"{store_root}/r{i}-spotline", rep / "staging", total, args.interval
            )
            print(f"[{i + 1}/{args.repeats}] direct ...", file=sys.stderr, flush=True)
            try:
                d = run_direct(
                    direct_spec,
                    replicas,
                    args.warmup,
                    args.steps,
                    args.sync_saves,
                    rep / "direct",
                    args.timeout,
                )
            finally:
                _remove_prefix(direct_spec)
            print(f"[{i + 1}/{args.repeats}] spotline ...", file=sys.stderr, flush=True)
            try:
                s = run_spotline(spot_spec, replicas, num_cpus)
            finally:
                _remove_prefix(spot_spec)
            if s.steps != total:
                raise BenchmarkError(f"spotline trained {s.steps} steps, direct {total}")
            runs.append(Repeat(d, s, derive(d, s)))
            shutil.rmtree(rep, ignore_errors=True)
    except BenchmarkError as e:
        print(f"overhead.py: {e}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if root:
            _remove_prefix(with_run_fields(base, root, tmp, total, args.interval))

    med = {k: statistics.median(r.derived[k] for r in runs) for k in runs[0].derived}
    print(render(med, runs, base, args, ctx))
    if args.json:
        out = {
            **med,
            "repeats": [
                {"direct": asdict(r.direct), "spotline": asdict(r.spotline), **r.derived}
                for r in runs
            ],
            "config": {
                "spec": str(args.config),
                "set": args.set,
                "warmup_steps": args.warmup,
                "timed_steps": args.steps,
                "checkpoint_interval_steps": args.interval,
                "replicas": replicas,
                "pipeline_stages": base.parallel.pipeline_stages,
                "ray_num_cpus": num_cpus,
                "uri": args.uri or "temp file://",
            },
            "machine": ctx,
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
