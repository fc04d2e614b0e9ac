"""A 4-trial ASHA sweep against running the same 4 jobs one after another.

Both arms run on one local Ray cluster, in one process, from the same sweep file
(default `configs/sweep.yaml`, with `--set` overrides applied to its base job):

sweep         `spotline.tune` with the file's scheduler (ASHA): trials run as many at a
              time as the cluster holds at each trial's minimum size, and ASHA stops the
              worse ones early (each with a commit);
sequential    the very configs the sweep's trials drew, each run as a plain job to its
              end, one after another.

Wall-clock for both: from the first preflight to the last job's end, start-ups,
checkpoints, held-out losses and Tune's own bookkeeping included. The best eval loss of
an arm is the lowest held-out loss of its jobs that trained to the end (a stopped trial
has none). `--repeats N` runs both arms N times and reports the median [min-max].

    python benchmarks/sweep.py --json /tmp/sweep.json

`--json` writes sweep_s, sequential_s, best_eval_loss_sweep, best_eval_loss_sequential,
trials_stopped_early (medians over the repeats) and every repeat's figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SWEEP = REPO / "configs" / "sweep.yaml"


def one_repeat(args: argparse.Namespace, k: int) -> dict[str, Any]:
    from spotline.config import parse_override_list
    from spotline.config.sweep import load_sweep
    from spotline.job import Job
    from spotline.tune import from_sweep_spec

    sweep, here = load_sweep(args.sweep)
    tmp = Path(tempfile.mkdtemp(prefix=f"spotline-sweep-bench-{k}-"))
    base = sweep.job if isinstance(sweep.job, dict) else str(here / sweep.job)
    over = {**sweep.overrides, **parse_override_list(args.set)}
    job = Job.from_yaml(base, over) if isinstance(base, str) else Job.from_dict(base, over)
    sweep = sweep.model_copy(
        update={
            "name": f"bench-{k}",
            "storage_path": str(tmp / "tune"),
            "checkpoint_uri": f"file://{tmp}/sweep",
            "num_samples": args.trials,
            "seed": args.seed + k,
        }
    )
    t0 = time.perf_counter()
    grid = from_sweep_spec(sweep, job).fit()
    sweep_s = time.perf_counter() - t0
    if grid.errors:
        raise SystemExit(f"sweep.py: a trial failed: {grid.errors[0]}")
    trials = [{"config": r.config, "metrics": r.metrics} for r in grid]
    finished = [t for t in trials if t["metrics"].get("finished")]
    stopped = len(trials) - len(finished)

    t0 = time.perf_counter()
    sequential = []
    for i, t in enumerate(trials):
        alone = job.with_overrides(
            {**t["config"], "name": f"bench-{k}-seq-{i}", "checkpoint.uri": f"file://{tmp}/seq{i}"}
        )
        result = alone.run(verbose=False)
        sequential.append({"config": t["config"], "heldout_loss": result.heldout_loss})
    sequential_s = time.perf_counter() - t0
    return {
        "sweep_s": sweep_s,
        "sequential_s": sequential_s,
        "best_eval_loss_sweep": min(t["metrics"]["eval_loss"] for t in finished),
        "best_eval_loss_sequential": min(s["heldout_loss"] for s in sequential),
        "trials_stopped_early": stopped,
        "trials": trials,
        "sequential": sequential,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sweep", default=str(DEFAULT_SWEEP), help="a sweep YAML")
    p.add_argument("--set", action="append", default=[], help="override of the base job")
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="seed of the first repeat's draws")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()

    from spotline.runtime.cluster import connect_ray

    connect_ray(None)
    runs = [one_repeat(args, k) for k in range(args.repeats)]
    keys = ("sweep_s", "sequential_s", "best_eval_loss_sweep", "best_eval_loss_sequential",
            "trials_stopped_early")  # fmt: skip
    out: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k in keys}
    out["sequential_over_sweep"] = out["sequential_s"] / out["sweep_s"]
    out["runs"] = runs

    def spread(key: str, fmt: str) -> str:
        vals = [r[key] for r in runs]
        mid = format(statistics.median(vals), fmt)
        return mid if len(vals) == 1 else f"{mid} [{min(vals):{fmt}}-{max(vals):{fmt}}]"

    print(f"{'':28}{'sweep (ASHA)':>22}{'sequential':>22}")
    print(f"{'wall s':28}{spread('sweep_s', '.1f'):>22}{spread('sequential_s', '.1f'):>22}")
    print(
        f"{'best held-out loss':28}{spread('best_eval_loss_sweep', '.4f'):>22}"
        f"{spread('best_eval_loss_sequential', '.4f'):>22}"
    )
    print(f"{'trials stopped early':28}{spread('trials_stopped_early', 'g'):>22}{'0':>22}")
    print(f"sequential / sweep wall time: {out['sequential_over_sweep']:.2f}x "
          f"({args.trials} trials, {args.repeats} repeat(s))")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
