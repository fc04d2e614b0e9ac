"""Spotline's overhead against plain DeepSpeed: the same model, data and config.

Every repeat runs, in this order:

direct        one process per rank (torch.multiprocessing, spawn), each building the
              same `Trainer` Spotline's Ray actors use, with no Ray anywhere, and no
              checkpoint inside the timed loop: the strict reference. After the loop it
              times a fully synchronous save + upload (`Trainer.snapshot()`, then
              `Trainer.write()`, then `store.upload_dir()`): the cost a training loop
              pays when nothing uploads in the background.
direct+ckpt   the same, with that synchronous save + upload inside the loop after every
              K-th step (the cadence Spotline checkpoints at): what a hand-written loop
              that checkpoints pays. Skipped with --no-direct-ckpt.
spotline      `spotline.Job(spec).run()` on a local Ray cluster this script starts.

All three train the same W + N steps (train.steps = W + N), and steps/s is the same
wall clock on every side: W + N steps over the time from the start of the first step
to the end of the last one, on rank 0. For Spotline that is the result's
`steps_per_s`, so it includes everything between steps: checkpoint host copies, the
per-step agreement on when to save and stop, and whatever else happens while the
ranks train. Nothing is left out of the time between those two points; what lies
outside them (start-up before the first step; the final checkpoint commit, held-out
evaluation and teardown after the last) is reported separately as Spotline's
end-to-end wall (submission to result) and its start-up time (submission to the
first step done, as the driver sees it). The headline ratio is Spotline's steps/s
over the strict direct reference's.

Checkpoint blocked fraction = mean seconds a Spotline checkpoint blocks training /
mean seconds of the synchronous save + upload. The direct runs also report their
steps/s over the last N steps alone (after the W warm-up steps), as a diagnostic.

    python benchmarks/overhead.py [CONFIG] [--set KEY=VALUE ...] [--repeats R] [--json PATH]

With --repeats R the runs alternate R times; the table shows medians, with min-max
over the repeats, and --json keeps every repeat. This script only measures: it never
changes a spec field other than train.steps and checkpoint.{uri,interval_steps,
staging_dir}, which it owns (see --steps, --warmup, --interval, --uri).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ranks import BenchmarkError, exit_now, free_port, redirect_output, spawn_ranks

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "quickstart.yaml"
# Spec fields this benchmark sets itself, and the flag to use instead of --set.
OWNED_FIELDS = {
    "train.steps": "--warmup/--steps",
    "checkpoint.interval_steps": "--interval",
    "checkpoint.uri": "--uri",
    "checkpoint.staging_dir": "(a temp directory)",
}
STARTUP_POLL_S = 0.05  # how often the driver asks a starting job for its step


@dataclass
class DirectResult:
    steps_per_s: float  # W + N steps / first step's start -> last step's end, rank 0
    last_n_steps_per_s: float  # the last N steps alone (diagnostic)
    first_step_s: float
    startup_s: float  # launch of the processes -> first step done, rank 0
    cpu_s_per_step: float  # CPU seconds of all ranks together, per step (W + N)
    checkpoints_in_loop: int  # synchronous save + upload inside the timed loop
    in_loop_save_s: list[float]  # rank 0's seconds per in-loop save
    sync_save_upload_s: list[float]  # after the loop: max over ranks, one per save
    torch_threads: int
    interop_threads: int
    omp_num_threads: str | None


@dataclass
class SpotlineResult:
    steps_per_s: float  # the result's: W + N steps / first step's start -> last step's end
    span_s: float  # first step's start -> last step's end (steps / steps_per_s)
    wall_s: float  # submission -> result, in this driver
    startup_s: float  # submission -> first step done, as the driver sees it
    checkpoint_blocked_s: list[float]
    checkpoint_upload_s: list[float]
    steps: int
    replicas: int


@dataclass
class Repeat:
    direct: DirectResult
    direct_ckpt: DirectResult | None
    spotline: SpotlineResult
    derived: dict[str, float] = field(default_factory=dict)


# --- the direct run (no Ray) -------------------------------------------------------------


def _save_upload(trainer: Any, store: Any, local: Path, rank: int) -> None:
    """One synchronous save of this rank's share: host copy, serialization, upload."""
    shutil.rmtree(local, ignore_errors=True)
    snap = trainer.snapshot()
    trainer.write(snap, local)
    store.upload_dir(local, trainer.step, prefix=f"rank_{rank:05d}")
    shutil.rmtree(local, ignore_errors=True)


def _direct_rank(
    rank: int,
    spec_json: str,
    replicas: int,
    port: int,
    warmup: int,
    steps: int,
    interval: int,
    saves: int,
    launched_at: float,
    workdir: str,
    results: Any,
) -> None:
    """One rank of the direct run; rank 0 puts the figures on `results`.

    interval > 0: a synchronous save + upload after every interval-th step inside the
    timed loop (not after the last step, which ends the timed span, as in Spotline).
    """
    redirect_output(Path(workdir) / f"rank_{rank}.log")
    import torch
    import torch.distributed as dist

    from spotline.config.schema import JobSpec
    from spotline.preflight import open_store
    from spotline.train.process import Topology, init_distributed
    from spotline.train.trainer import Trainer

    spec = JobSpec.model_validate_json(spec_json)
    topo = Topology(spec.parallel.pipeline_stages, replicas, rank)
    init_distributed(topo, "127.0.0.1", port)
    try:
        trainer = Trainer(spec, topo, threads=max(1, int(spec.resources.cpus_per_worker)))
        store = open_store(spec)
        staging = Path(workdir) / "staging" / f"rank_{rank:05d}"
        total = warmup + steps
        in_loop: list[float] = []
        dist.barrier()
        c0 = time.process_time()
        t_first = time.perf_counter()
        for s in range(1, total + 1):
            trainer.train_step()
            if s == 1:
                first_done_at = time.time()
                first_step_s = time.perf_counter() - t_first
            if s == warmup:
                t_warm = time.perf_counter()
            if interval and s % interval == 0 and s < total:
                s0 = time.perf_counter()
                _save_upload(trainer, store, staging / f"step_{s}", rank)
                in_loop.append(time.perf_counter() - s0)
        t_last = time.perf_counter()
        cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
        dist.all_reduce(cpu)

        sync: list[float] = []
        for i in range(saves):
            dist.barrier()
            s0 = time.perf_counter()
            _save_upload(trainer, store, staging / f"sync_{i}", rank)
            worst = torch.tensor([time.perf_counter() - s0], dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            sync.append(float(worst.item()))

        if rank == 0:
            results.put(
                asdict(
                    DirectResult(
                        steps_per_s=total / (t_last - t_first),
                        last_n_steps_per_s=steps / (t_last - t_warm),
                        first_step_s=first_step_s,
                        startup_s=first_done_at - launched_at,
                        cpu_s_per_step=float(cpu.item()) / total,
                        checkpoints_in_loop=len(in_loop),
                        in_loop_save_s=in_loop,
                        sync_save_upload_s=sync,
                        torch_threads=torch.get_num_threads(),
                        interop_threads=torch.get_num_interop_threads(),
                        omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
                    )
                )
            )
    finally:
        dist.destroy_process_group()
    exit_now()


def run_direct(
    spec: Any,
    replicas: int,
    warmup: int,
    steps: int,
    interval: int,
    saves: int,
    workdir: Path,
    timeout_s: float,
) -> DirectResult:
    """interval > 0: synchronous checkpoints inside the timed loop; saves: synchronous
    save + upload timings after it."""
    world = spec.parallel.pipeline_stages * replicas
    workdir.mkdir(parents=True, exist_ok=True)
    args = (
        spec.model_dump_json(),
        replicas,
        free_port(),
        warmup,
        steps,
        interval,
        saves,
        time.time(),
        str(workdir),
    )
    got = spawn_ranks(_direct_rank, args, world, workdir, timeout_s, "direct run")
    return DirectResult(**got)


# --- the Spotline run -------------------------------------------------------------------


def run_spotline(spec: Any, replicas: int, num_cpus: int) -> SpotlineResult:
    import ray

    import spotline
    from spotline.job import JobFailed
    from spotline.runtime.cluster import bind_to_loopback

    bind_to_loopback()
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
            run = spotline.Job(spec).start()
            # Start-up as the user sees it: until the controller reports a step (it
            # collects the ranks' steps every SPOTLINE_POLL_INTERVAL_S).
            startup = math.nan
            while True:
                st = run.status()
                if st["step"] >= 1:
                    startup = time.perf_counter() - t0
                    break
                if st["state"] in ("finished", "failed", "stopped"):
                    break
                time.sleep(STARTUP_POLL_S)
            result = run.wait(verbose=False)
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
    if result.steps_per_s <= 0:
        raise BenchmarkError("spotline run reported no steps/s (no step span)")
    return SpotlineResult(
        steps_per_s=result.steps_per_s,
        span_s=result.steps / result.steps_per_s,
        wall_s=wall,
        startup_s=startup,
        checkpoint_blocked_s=list(result.checkpoint_blocked_s),
        checkpoint_upload_s=list(result.checkpoint_upload_s),
        steps=result.steps,
        replicas=replicas,
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


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else math.nan


def derive(d: DirectResult, dc: DirectResult | None, s: SpotlineResult) -> dict[str, float]:
    """One repeat's figures. Every steps/s is W + N steps over the same wall-clock span."""
    blocked = _mean(s.checkpoint_blocked_s)
    sync = _mean(d.sync_save_upload_s)
    out = {
        "direct_steps_per_s": d.steps_per_s,
        "spotline_steps_per_s": s.steps_per_s,
        "ratio": s.steps_per_s / d.steps_per_s,
    }
    if dc is not None:
        out |= {
            "direct_ckpt_steps_per_s": dc.steps_per_s,
            "ratio_vs_direct_ckpt": s.steps_per_s / dc.steps_per_s,
        }
    out |= {
        "checkpoint_blocked_s": blocked,
        "sync_save_upload_s": sync,
        "checkpoint_blocked_fraction": blocked / sync,
    }
    if dc is not None:
        out["direct_ckpt_save_s"] = _mean(dc.in_loop_save_s)
    out |= {
        "direct_span_s": s.steps / d.steps_per_s,
        "spotline_span_s": s.span_s,
        "spotline_wall_s": s.wall_s,
        "spotline_outside_span_s": s.wall_s - s.span_s,
        "direct_startup_s": d.startup_s,
        "spotline_startup_s": s.startup_s,
        "direct_last_n_steps_per_s": d.last_n_steps_per_s,
        "direct_first_step_s": d.first_step_s,
        "direct_cpu_s_per_step": d.cpu_s_per_step,
    }
    if dc is not None:
        out |= {
            "direct_ckpt_span_s": s.steps / dc.steps_per_s,
            "direct_ckpt_startup_s": dc.startup_s,
            "direct_ckpt_last_n_steps_per_s": dc.last_n_steps_per_s,
        }
    return out


def _no_nan(x: Any) -> Any:
    """JSON has no NaN: a figure that could not be measured is null."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_no_nan(v) for v in x]
    return x


def summarize(runs: list[Repeat]) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Median and [min, max] of every figure over the repeats (NaNs left out)."""
    med: dict[str, float] = {}
    spread: dict[str, list[float]] = {}
    for k in runs[0].derived:
        xs = [r.derived[k] for r in runs if not math.isnan(r.derived[k])]
        med[k] = statistics.median(xs) if xs else math.nan
        spread[k] = [min(xs), max(xs)] if xs else [math.nan, math.nan]
    return med, spread


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
    med: dict[str, float],
    spread: dict[str, list[float]],
    runs: list[Repeat],
    spec: Any,
    args: argparse.Namespace,
    ctx: dict,
) -> str:
    last = runs[-1]
    ckpt = last.direct_ckpt is not None
    n_blocked = len(last.spotline.checkpoint_blocked_s)
    n_sync = len(last.direct.sync_save_upload_s)
    counts = f"x{last.direct_ckpt.checkpoints_in_loop} | x{n_blocked}" if ckpt else f"x{n_blocked}"
    g = med.get

    def row(label: str, d: str | None, dc: str | None, s: str | None) -> tuple:
        cols = (d, dc, s) if ckpt else (d, s)
        return (label, *cols)

    rows = [
        row(
            "steps/s (W+N steps, first start->last end)",
            "direct_steps_per_s",
            "direct_ckpt_steps_per_s",
            "spotline_steps_per_s",
        ),
        row("ratio spotline/direct", None, None, "ratio"),
    ]
    if ckpt:
        rows.append(row("ratio spotline/direct+ckpt", None, None, "ratio_vs_direct_ckpt"))
    rows += [
        row(
            f"checkpoint blocked s/save ({counts})",
            None,
            "direct_ckpt_save_s",
            "checkpoint_blocked_s",
        ),
        row(f"sync save+upload s/save (x{n_sync}, after)", "sync_save_upload_s", None, None),
        row("checkpoint blocked fraction", None, None, "checkpoint_blocked_fraction"),
        row(
            "start-up s (launch->first step done)",
            "direct_startup_s",
            "direct_ckpt_startup_s",
            "spotline_startup_s",
        ),
        row(
            "step span s (first start->last end)",
            "direct_span_s",
            "direct_ckpt_span_s",
            "spotline_span_s",
        ),
        row("end-to-end wall s (submission->result)", None, None, "spotline_wall_s"),
        row("  of which outside the step span", None, None, "spotline_outside_span_s"),
        row(
            "steps/s, last N steps only (diagnostic)",
            "direct_last_n_steps_per_s",
            "direct_ckpt_last_n_steps_per_s",
            None,
        ),
    ]
    several = len(runs) > 1

    def cell(key: str | None) -> str:
        if key is None or g(key) is None or math.isnan(g(key)):
            return "-"
        lo, hi = spread[key]
        return f"{g(key):.3f} [{lo:.3f}-{hi:.3f}]" if several else f"{g(key):.3f}"

    heads = ["direct", "direct+ckpt", "spotline"] if ckpt else ["direct", "spotline"]
    table = [(label, *(cell(k) for k in keys)) for label, *keys in rows]
    width = max(len(r[0]) for r in table)
    cw = [max(len(h), *(len(r[i + 1]) for r in table)) for i, h in enumerate(heads)]

    def line(label: str, cells: list[str]) -> str:
        return f"{label:<{width}}" + "".join(f"  {c:>{w}}" for c, w in zip(cells, cw, strict=True))

    pp = spec.parallel.pipeline_stages
    reps = last.spotline.replicas
    how = f"median [min-max] of {len(runs)} repeats" if several else "1 repeat"
    head = (
        f"{spec.name}: {pp} stage(s) x {reps} replica(s), ZeRO-{spec.parallel.zero_stage}, "
        f"W={args.warmup} + N={args.steps} steps, all timed, checkpoint every "
        f"{args.interval} (direct: none in the loop); {how}"
    )
    lines = [head, line("", heads)]
    lines += [line(label, list(cells)) for label, *cells in table]
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
    p.add_argument(
        "--warmup",
        type=int,
        default=10,
        help="W: first steps (timed too; the last-N diagnostic leaves them out)",
    )
    p.add_argument("--steps", type=int, default=60, help="N: steps after the first W")
    p.add_argument(
        "--interval",
        type=int,
        default=20,
        help="K: checkpoint.interval_steps (Spotline), and direct+ckpt's cadence",
    )
    p.add_argument(
        "--sync-saves",
        type=int,
        default=3,
        help="synchronous save+upload timings after the direct loop",
    )
    p.add_argument(
        "--direct-ckpt",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run direct with synchronous checkpoints every K steps in the loop",
    )
    p.add_argument("--uri", help="checkpoint store root (default: a temp file:// directory)")
    p.add_argument(
        "--repeats", type=int, default=1, help="alternate direct(+ckpt)/spotline R times"
    )
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
            specs = {
                name: with_run_fields(
                    base, f"{store_root}/r{i}-{name}", rep / "staging", total, args.interval
                )
                for name in ("direct", "direct-ckpt", "spotline")
            }
            arms = [("direct", 0, args.sync_saves)]
            if args.direct_ckpt:
                arms.append(("direct-ckpt", args.interval, 0))
            got: dict[str, DirectResult] = {}
            for name, interval, saves in arms:
                print(f"[{i + 1}/{args.repeats}] {name} ...", file=sys.stderr, flush=True)
                try:
                    got[name] = run_direct(
                        specs[name],
                        replicas,
                        args.warmup,
                        args.steps,
                        interval,
                        saves,
                        rep / name,
                        args.timeout,
                    )
                finally:
                    _remove_prefix(specs[name])
            d, dc = got["direct"], got.get("direct-ckpt")
            print(f"[{i + 1}/{args.repeats}] spotline ...", file=sys.stderr, flush=True)
            try:
                s = run_spotline(specs["spotline"], replicas, num_cpus)
            finally:
                _remove_prefix(specs["spotline"])
            if s.steps != total:
                raise BenchmarkError(f"spotline trained {s.steps} steps, direct {total}")
            runs.append(Repeat(d, dc, s, derive(d, dc, s)))
            shutil.rmtree(rep, ignore_errors=True)
    except BenchmarkError as e:
        print(f"overhead.py: {e}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if root:
            _remove_prefix(with_run_fields(base, root, tmp, total, args.interval))

    med, spread = summarize(runs)
    print(render(med, spread, runs, base, args, ctx))
    if args.json:
        out = {
            **med,
            "spread": spread,
            "repeats": [
                {
                    "direct": asdict(r.direct),
                    "direct_ckpt": asdict(r.direct_ckpt) if r.direct_ckpt else None,
                    "spotline": asdict(r.spotline),
                    **r.derived,
                }
                for r in runs
            ],
            "config": {
                "spec": str(args.config),
                "set": args.set,
                "warmup_steps": args.warmup,
                "steps_after_warmup": args.steps,
                "total_steps": total,
                "checkpoint_interval_steps": args.interval,
                "direct_ckpt": args.direct_ckpt,
                "replicas": replicas,
                "pipeline_stages": base.parallel.pipeline_stages,
                "ray_num_cpus": num_cpus,
                "uri": args.uri or "temp file://",
            },
            "machine": ctx,
        }
        Path(args.json).write_text(json.dumps(_no_nan(out), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
