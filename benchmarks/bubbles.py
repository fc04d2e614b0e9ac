"""Pipeline bubbles and backfill: measured vs theoretical bubble, how much of it backfill
fills, and what that costs the training step, in one invocation.

For each shape (p stages, m micro-batches per step, one replica) the same Spotline
job runs twice on a fresh local Ray cluster:

off  backfill disabled: the measured bubble fraction and the step time.
on   backfill enabled with an eval task and a speculative-decoding task due at every
     checkpoint, so the executors always have work; the governor holds training's
     slowdown under backfill.max_slowdown against its own paused baseline.

The "device" here is a CPU core. SPOTLINE_PIN_CORES=1 pins rank r's worker *and* its
backfill executor to core r (every thread of both processes), and each worker uses
one torch thread, so a stage and its executor compete for exactly one core as they
would for one GPU, and an executor can only run when its stage leaves the core idle.
Shapes with more stages than this machine has cores are skipped (p=4 needs 4 cores).

Figures, per shape:
- bubble measured: the off run's time stages spent blocked on other stages (receives,
  sends, the end-of-step syncs) / step time, all stages; theory: (p-1)/(m+p-1).
- fill: the on run's executor busy time inside windows / window time (waits long
  enough to signal, SPOTLINE_BACKFILL_MIN_WINDOW_S), counted over the chunks that ran
  with backfill on (the governor pauses it for baselines). The busy time is measured
  by the stage from the kernel (the executor thread's on-CPU time), never capped.
  bubble_fill is the same busy time over the whole bubble, short waits included.
- overrun: executor busy time during steps outside windows, as a fraction of the step
  (overrun_fraction) and in seconds per step.
- slowdown: the on run's mean step time while backfill ran / the off run's mean step
  time (recorded by the stages themselves; checkpoint saves are not part of a step).
  The governor's own figure (against its in-run paused baseline) is shown beside it.
- throughput: held-out eval micro-batches and speculative tokens that backfill
  completed per second of training, and the draft's accepted tokens per verification.

Speculative decoding with a draft trained in the bubbles (--spec-steps N, 0 skips it):
one more 2x2 job of N steps with backfill on and no task in its spec. Once it has
trained N/3 steps (past the first checkpoints, whose weights only repeat a token),
the speculative task is submitted through the SDK (`run.backfill.submit`), as a user
would: it distils its draft from the latest commit in the bubbles, then decodes the
prompts with the draft and the target (both KV-cached) and again with the target
alone, greedily, and compares. backfill.finish_timeout_s is 0: a task that did not
finish while training ran is reported as not finished, never completed afterwards.

    python benchmarks/bubbles.py [--steps N] [--shapes 2x2,2x8] [--spec-steps N]
                                 [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from overhead import machine_context  # noqa: E402

# Two of configs/prompts.txt: the speculative task must finish inside a run's bubbles.
PROMPTS = (REPO / "configs" / "prompts.txt").read_text().splitlines()[:2]


SPEC_TASK = {
    "kind": "speculative",
    "prompts": PROMPTS,
    # On 2 CPU cores 16 tokens at gamma 4 cannot reach 1.5x even with a perfect draft
    # (a 5-position verify costs 1.4x a 1-token decode).
    "max_new_tokens": 32,
    "gamma": 6,
    # 20 steps left the draft near random (acceptance ~0.3, slower than the target
    # alone); 250 (1000 distilled sequences) is where acceptance levels off.
    "draft": {"n_layers": 1, "d_model": 64, "train_steps": 250},
}


def build_spec(
    p: int,
    m: int,
    steps: int,
    interval: int,
    tmp: Path,
    backfill: bool,
    name: str,
    tasks: list[dict[str, Any]] | None = None,
):
    from spotline.config import load_spec

    if tasks is None:
        tasks = [
            # Enough eval work that an executor is rarely idle between commits.
            {"kind": "eval", "every_steps": interval, "batches": 32},
            {**SPEC_TASK, "every_steps": 4 * interval},
        ]

    return load_spec(
        {
            "name": name,
            "model": {"n_layers": 4, "d_model": 128, "n_heads": 4, "seq_len": 128},
            "data": {"max_bytes": 2_000_000},
            "parallel": {"pipeline_stages": p, "micro_batches": m, "zero_stage": 1},
            "elastic": {"min_replicas": 1, "max_replicas": 1},
            "train": {"steps": steps, "global_batch_size": 2 * m, "warmup_steps": 10},
            "checkpoint": {
                "uri": f"file://{tmp}/{name}/ckpt",
                "interval_steps": interval,
                "keep_last": 2,
                "staging_dir": str(tmp / "staging"),
            },
            "resources": {"cpus_per_worker": 1},
            "backfill": {
                "enabled": backfill,
                "max_slowdown": 0.02,
                "baseline_steps": 10,
                "rebaseline_every_steps": 100,
                "finish_timeout_s": 0,  # count only what ran alongside training
                "tasks": tasks if backfill else [],
            },
        }
    )


def run_job(spec, submit_at: int | None = None, task: dict[str, Any] | None = None) -> Any:
    """The job's result; with `submit_at`, `task` is submitted through the SDK once the
    job has trained that many steps."""
    import ray

    import spotline
    from spotline.preflight import preflight
    from spotline.runtime.cluster import bind_to_loopback

    preflight(spec)  # reads the prompts file into the spec
    bind_to_loopback()
    ray.init(
        address="local",
        num_cpus=spec.parallel.pipeline_stages,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="WARNING",
    )
    try:
        if submit_at is None:
            return spotline.Job(spec).run(verbose=False)
        run = spotline.Job(spec).start()
        while (st := run.status())["step"] < submit_at:
            if st["state"] in ("finished", "failed", "stopped"):
                return run.wait(verbose=False)  # ended before the task was due
            time.sleep(0.5)
        run.backfill.submit(task)
        return run.wait(verbose=False)
    finally:
        ray.shutdown()


def step_time(bubbles: dict[str, Any], key: str | None = None) -> float:
    b = bubbles[key] if key else bubbles
    return b["step_s"] / b["steps"] if b["steps"] else float("nan")


def measure(p: int, m: int, args, tmp: Path) -> dict[str, Any]:
    off = run_job(build_spec(p, m, args.steps, args.interval, tmp, False, f"off-p{p}m{m}"))
    on = run_job(build_spec(p, m, args.steps, args.interval, tmp, True, f"on-p{p}m{m}"))
    ob, nb = off.bubbles, on.bubbles
    while_on = nb["while_backfill_on"]
    train_s = on.steps / on.steps_per_s if on.steps_per_s else float("nan")
    done = [t["result"] for t in on.backfill["tasks"] if t["state"] == "done"]
    evals = [r for r in done if r["kind"] == "eval"]
    specs = [r for r in done if r["kind"] == "speculative"]
    eval_mb = sum(r["batches"] * m for r in evals)  # micro-batches of one replica
    verifs = sum(r["verifications"] for r in specs)
    return {
        "p": p,
        "m": m,
        "bubble_theory": ob["theory"],
        "bubble_measured": ob["bubble_fraction"],
        "bubble_measured_per_stage": [s["bubble_fraction"] for s in ob["per_stage"].values()],
        "fill": while_on["fill_fraction"],
        "bubble_fill": while_on["bubble_fill_fraction"],
        "window_share_of_bubble": (
            while_on["window_s"] / while_on["wait_s"] if while_on["wait_s"] else 0.0
        ),
        "fill_per_stage_overall": [s["fill_fraction"] for s in nb["per_stage"].values()],
        "overrun_s_per_step": while_on["overrun_s_per_step"],
        "overrun_fraction": while_on["overrun_fraction"],
        # Share of the signalled window time past its forecast end (no unit starts there).
        "open_past_forecast": (
            while_on["beyond_s"] / while_on["open_s"] if while_on["open_s"] else 0.0
        ),
        "slowdown": step_time(while_on) / step_time(ob) if while_on["steps"] else float("nan"),
        "governor_slowdown": on.backfill["slowdown"],
        "governor_margin": on.backfill["margin"],
        "step_s_off": step_time(ob),
        "step_s_on": step_time(while_on) if while_on["steps"] else None,
        "steps_with_backfill_on": int(while_on["steps"] / p),
        "eval_batches_per_s": eval_mb / train_s,
        "spec_tokens_per_s": sum(r["new_tokens"] for r in specs) / train_s,
        "accepted_per_verification": (
            sum(r["accepted"] for r in specs) / verifs if verifs else None
        ),
        "spec_speedup_vs_target_only": (
            sum(r["speedup"] for r in specs) / len(specs) if specs else None
        ),
        "tasks_done": len(done),
        "tasks_deferred": sum(1 for r in done if r.get("deferred")),
        "steps_per_s_off": off.steps_per_s,
        "steps_per_s_on": on.steps_per_s,
    }


def measure_spec(args, tmp: Path) -> dict[str, Any]:
    """The speculative task, submitted at a third of a 2x2 run: what it reached while
    training ran."""
    steps = args.spec_steps
    spec = build_spec(2, 2, steps, args.interval, tmp, True, "spec-p2m2", tasks=[])
    submit_at = steps // 3
    res = run_job(spec, submit_at=submit_at, task=SPEC_TASK)
    tasks = res.backfill["tasks"] if res.backfill else []
    rec = (
        tasks[0]
        if tasks
        else {
            "step": None,
            "state": "not submitted",
            "error": f"the job ended ({res.state}) before step {submit_at}: {res.error}",
            "result": None,
        }
    )
    r = rec["result"] or {}
    w = res.bubbles["while_backfill_on"]
    return {
        "steps": steps,
        "submitted_at_step": submit_at,
        "weights_step": rec["step"],
        "state": rec["state"],
        "error": rec["error"],
        "finished_in_bubbles": rec["state"] == "done" and r.get("after_training_s") == 0.0,
        "busy_s": r.get("busy_s"),
        "wall_s": r.get("wall_s"),
        "tokens_per_s": r.get("tokens_per_s"),
        "target_only_tokens_per_s": r.get("target_only_tokens_per_s"),
        "speedup_vs_target_only": r.get("speedup"),
        "accepted_per_verification": r.get("accepted_per_verification"),
        "acceptance_rate": r.get("acceptance_rate"),
        "all_equal_target_greedy": r.get("all_equal_target_greedy"),
        "kv_cache": r.get("kv_cache"),
        "deferred": (r.get("deferred") or {}).get("why"),
        "fill": w["fill_fraction"],
        "overrun_fraction": w["overrun_fraction"],
        "governor_slowdown": res.backfill["slowdown"],
    }


def render_spec(s: dict[str, Any]) -> str:
    head = (
        f"speculative decoding, 2x2, {s['steps']} steps, submitted at step "
        f"{s['submitted_at_step']} (weights of step {s['weights_step']}): {s['state']}"
    )
    if s["state"] != "done":
        return f"{head} ({s['error']})"
    return (
        f"{head}, {'in the bubbles' if s['finished_in_bubbles'] else 'partly after training'}\n"
        f"  {s['tokens_per_s']:.1f} tokens/s against {s['target_only_tokens_per_s']:.1f} for "
        f"the target alone: {s['speedup_vs_target_only']:.2f}x; "
        f"{s['accepted_per_verification']:.2f} accepted per verification "
        f"(acceptance {s['acceptance_rate']:.2f}); output equals greedy: "
        f"{s['all_equal_target_greedy']}; busy {s['busy_s']:.1f}s over {s['wall_s']:.0f}s; "
        f"fill {s['fill']:.3f}"
    )


def render(runs: list[dict[str, Any]], ctx: dict[str, Any], skipped: list[str]) -> str:
    cols = [
        ("p x m", lambda r: f"{r['p']}x{r['m']}"),
        ("bubble theory", lambda r: f"{r['bubble_theory']:.3f}"),
        ("bubble measured", lambda r: f"{r['bubble_measured']:.3f}"),
        ("fill", lambda r: f"{r['fill']:.3f}"),
        ("overrun", lambda r: f"{r['overrun_fraction']:.3f}"),
        ("slowdown on/off", lambda r: f"{r['slowdown']:.3f}"),
        ("governor", lambda r: _pct(r["governor_slowdown"])),
        ("eval mb/s", lambda r: f"{r['eval_batches_per_s']:.2f}"),
        ("spec tok/s", lambda r: f"{r['spec_tokens_per_s']:.1f}"),
        ("acc/verif", lambda r: _num(r["accepted_per_verification"])),
        ("spec/greedy", lambda r: _num(r["spec_speedup_vs_target_only"])),
    ]
    widths = [max(len(h), *(len(f(r)) for r in runs)) for h, f in cols]
    lines = ["  ".join(h.rjust(w) for (h, _), w in zip(cols, widths, strict=True))]
    for r in runs:
        lines.append("  ".join(f(r).rjust(w) for (_, f), w in zip(cols, widths, strict=True)))
    lines.append(
        f"machine: {ctx['cores']} cores, load avg {ctx['load_avg_1min_at_start']} at start, "
        f"torch {ctx['torch']}, deepspeed {ctx['deepspeed']}, ray {ctx['ray']}; one core per "
        "stage, shared with its executor"
    )
    lines += [f"skipped {s}" for s in skipped]
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=600, help="training steps per run")
    ap.add_argument("--interval", type=int, default=25, help="checkpoint every N steps")
    ap.add_argument(
        "--shapes",
        default="2x2,2x8,4x8",  # 4x8 runs only with 4 cores to pin
        help="comma-separated PxM pipeline shapes (P stages, M micro-batches)",
    )
    ap.add_argument(
        "--spec-steps",
        type=int,
        default=6000,  # submitted at 2000, the task finished by about step 3900 here
        help="steps of the speculative-decoding run (0: skip it)",
    )
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["SPOTLINE_PIN_CORES"] = "1"  # inherited by the local Ray cluster's workers
    ctx = machine_context()
    cores = len(os.sched_getaffinity(0))
    runs, skipped = [], []
    with tempfile.TemporaryDirectory(prefix="spotline-bubbles-") as d:
        for shape in filter(None, args.shapes.split(",")):
            p, m = (int(x) for x in shape.lower().split("x"))
            if p > cores:
                skipped.append(
                    f"{p}x{m}: {p} stages need {p} cores to pin, this machine has {cores}"
                )
                continue
            t0 = time.time()
            runs.append(measure(p, m, args, Path(d)))
            print(f"{p}x{m} done in {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
        speculative = None
        if args.spec_steps > 0:
            t0 = time.time()
            speculative = measure_spec(args, Path(d))
            print(f"speculative run done in {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"machine": ctx, "runs": runs, "skipped": skipped, "speculative": speculative},
                indent=2,
            )
        )
    if runs or skipped:
        print(render(runs, ctx, skipped))
    if speculative is not None:
        print(render_spec(speculative))
    return 0


if __name__ == "__main__":
    sys.exit(main())
