"""Tokens to a target held-out loss: the fixed global batch against the adaptive one.

Three arms train the same model on the same data (the spec's, default
`configs/quickstart.yaml` with `--set` overrides, at pp=1 and --replicas data-parallel
ranks under torch.multiprocessing, the `Trainer` Spotline's workers host, calling
`train_step` and the per-step agreement exactly as a worker does):

fixed         train.batch_schedule 'fixed' at --start-batch sequences per step;
adaptive      'adaptive' from --start-batch, growing toward the gradient noise scale at
              every checkpoint boundary (--interval steps) up to --max-batch, with the
              square-root lr rule;
fixed-max     'fixed' at --max-batch, with the lr the adaptive rule gives that batch
              (lr x sqrt(max / start)); skipped with --no-fixed-max.

The lr is constant after warm-up (train.min_lr_ratio 1), so no arm's lr depends on how
many steps it will run. Every arm trains --tokens tokens and measures the held-out loss
(the same train.eval_batches held-out batches every time) every --eval-tokens tokens.
The target is --target, or by default the higher of the fixed and adaptive arms' best
held-out losses, so that both reach it; tokens to target is the first measurement at or
below it ('-' when an arm never gets there within its tokens).

    python benchmarks/adaptive_batch.py --set model.seq_len=32 --json /tmp/adaptive_batch.json

`--json` writes tokens_to_target_fixed, tokens_to_target_adaptive (and _fixed_max),
steps_to_target_*, the target, every arm's curve and the adaptive schedule's history.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ranks import BenchmarkError, free_port, redirect_output, spawn_ranks

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "quickstart.yaml"


def build_spec(args: argparse.Namespace, arm: str) -> Any:
    from spotline.config import load_spec

    d, mbs = args.replicas, args.micro_batch_size
    batch = args.max_batch if arm == "fixed-max" else args.start_batch
    over: dict[str, Any] = {
        "name": f"adaptive-bench-{arm}",
        "parallel.pipeline_stages": 1,
        "parallel.micro_batches": batch // (mbs * d),
        "elastic.min_replicas": d,
        "elastic.max_replicas": d,
        "train.global_batch_size": batch,
        "train.steps": 10**7,  # the tokens budget ends a run, not the step count
        "train.min_lr_ratio": 1.0,
        "checkpoint.interval_steps": args.interval,
        "train.eval_batches": args.eval_batches,
    }
    from spotline.config.loader import parse_override_list

    over.update(parse_override_list(args.set))
    spec = load_spec(args.config, over)
    if arm == "fixed-max":
        scale = math.sqrt(args.max_batch / args.start_batch)
        spec = load_spec(args.config, {**over, "train.lr": spec.train.lr * scale})
    if arm == "adaptive":
        spec = load_spec(
            args.config,
            {
                **over,
                "train.batch_schedule": "adaptive",
                "train.adaptive.min_batch_size": args.start_batch,
                "train.adaptive.max_batch_size": args.max_batch,
            },
        )
    return spec


def _rank(rank: int, cfg_json: str, results: Any) -> None:
    """One rank of an arm: train to the tokens budget, measuring the held-out loss."""
    cfg = json.loads(cfg_json)
    redirect_output(Path(cfg["work"]) / f"rank_{rank}.log")
    from spotline.config.schema import JobSpec
    from spotline.train.process import Topology, init_distributed
    from spotline.train.trainer import Trainer

    spec = JobSpec.model_validate_json(cfg["spec"])
    topo = Topology(1, cfg["replicas"], rank)
    init_distributed(topo, "127.0.0.1", cfg["port"])
    tr = Trainer(spec, topo, threads=cfg["threads"])
    seq = spec.model.seq_len
    tokens, next_eval, curve = 0, 0, []
    t0 = time.perf_counter()
    while True:
        if tokens >= next_eval or tokens >= cfg["tokens"]:
            curve.append(
                {
                    "tokens": tokens,
                    "step": tr.step,
                    "heldout": tr.heldout_loss(),
                    "batch": tr.schedule.batch,
                }
            )
            next_eval += cfg["eval_tokens"]
        if tokens >= cfg["tokens"]:
            break
        tokens += tr.schedule.batch * seq  # the batch this step trains on
        tr.train_step()
        tr.agree(0, 0)  # as a worker does: an adaptive batch changes here
    if rank == 0:
        results.put(
            {
                "curve": curve,
                "history": tr.schedule.history,
                "estimates": tr.schedule.estimates,
                "wall_s": time.perf_counter() - t0,
                "final_lr": tr.lr(),
            }
        )


def run_arm(args: argparse.Namespace, arm: str, work: Path) -> dict[str, Any]:
    spec = build_spec(args, arm)
    (work / arm).mkdir(parents=True, exist_ok=True)
    cfg = {
        "spec": spec.model_dump_json(),
        "replicas": args.replicas,
        "port": free_port(),
        "work": str(work / arm),
        "threads": args.threads,
        "tokens": args.tokens,
        "eval_tokens": args.eval_tokens,
    }
    out = spawn_ranks(
        _rank, (json.dumps(cfg),), args.replicas, work / arm, args.timeout, f"arm {arm}"
    )
    return out


def to_target(curve: list[dict[str, Any]], target: float) -> tuple[int | None, int | None]:
    """(tokens, steps) at the first measurement at or below `target`."""
    for point in curve:
        if point["heldout"] <= target:
            return point["tokens"], point["step"]
    return None, None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config", nargs="?", default=str(DEFAULT_CONFIG))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--start-batch", type=int, default=4)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--interval", type=int, default=20, help="checkpoint.interval_steps")
    ap.add_argument("--tokens", type=int, default=150_000, help="tokens each arm trains")
    ap.add_argument("--eval-tokens", type=int, default=10_000)
    ap.add_argument("--eval-batches", type=int, default=25, help="held-out batches per measurement")
    ap.add_argument("--target", type=float, default=None, help="held-out loss to reach")
    ap.add_argument("--no-fixed-max", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    unit = args.micro_batch_size * args.replicas
    for name in ("start_batch", "max_batch"):
        if getattr(args, name) % unit:
            ap.error(
                f"--{name.replace('_', '-')} must be a multiple of --micro-batch-size x "
                f"--replicas ({unit})"
            )
    arms = ["fixed", "adaptive"] + ([] if args.no_fixed_max else ["fixed-max"])
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="spotline-adaptive-bench-") as tmp:
        try:
            for arm in arms:
                runs[arm] = run_arm(args, arm, Path(tmp))
        except BenchmarkError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    best = {arm: min(p["heldout"] for p in r["curve"]) for arm, r in runs.items()}
    # By default the loss both headline arms reach (fixed-max is measured against it too).
    default = max(best["fixed"], best["adaptive"])
    target = args.target if args.target is not None else default
    figures: dict[str, Any] = {"target_heldout_loss": target}
    rows = []
    for arm, r in runs.items():
        key = arm.replace("-", "_")
        tok, steps = to_target(r["curve"], target)
        figures[f"tokens_to_target_{key}"] = tok
        figures[f"steps_to_target_{key}"] = steps
        rows.append((arm, tok, steps, best[arm], r["history"][-1][1], r["final_lr"]))
    fixed, adaptive = figures["tokens_to_target_fixed"], figures["tokens_to_target_adaptive"]
    ratio = adaptive / fixed if fixed and adaptive else None
    figures["adaptive_over_fixed_tokens"] = ratio
    s_fixed, s_adaptive = figures["steps_to_target_fixed"], figures["steps_to_target_adaptive"]
    figures["adaptive_over_fixed_steps"] = s_adaptive / s_fixed if s_fixed and s_adaptive else None
    print(f"target held-out loss {target:.4f}  ({args.tokens:,} tokens per arm)")
    head = (
        "arm",
        "tokens to target",
        "steps to target",
        "best held-out",
        "final batch",
        "final lr",
    )
    print(f"{head[0]:<10} {head[1]:>17} {head[2]:>16} {head[3]:>14} {head[4]:>12} {head[5]:>9}")
    for arm, tok, steps, b, final, lr in rows:
        t = "-" if tok is None else f"{tok:,}"
        s = "-" if steps is None else str(steps)
        print(f"{arm:<10} {t:>17} {s:>16} {b:>14.4f} {final:>12} {lr:>9.5f}")
    hist = runs["adaptive"]["history"]
    print("adaptive schedule (first step, global batch):", ", ".join(f"{a}:{b}" for a, b in hist))
    est = runs["adaptive"]["estimates"]
    print("noise scale at boundaries (step, B_simple):", ", ".join(f"{s}:{b:.1f}" for s, b in est))
    if ratio is not None:
        steps_ratio = figures["adaptive_over_fixed_steps"]
        print(f"adaptive / fixed to target: {ratio:.3f}x the tokens, {steps_ratio:.3f}x the steps")
    if args.json:
        out = {**figures, "args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
