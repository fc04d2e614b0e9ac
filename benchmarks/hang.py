"""A frozen rank and a slowed rank, on a 4-rank Spotline job: how fast a hang is found
and training resumes, and how well a straggler's slowdown is read.

Two arms per repeat, each a `spotline.Job` on one local Ray cluster (CPU, gloo; a GPT
at pp=1 with 4 data-parallel replicas):

  freeze    rank 2 stops its own process with SIGSTOP in the first forward of step
            FREEZE_STEP (spotline.runtime.faults): alive and silent, its peers blocked
            in their next collective, as a wedged device leaves them. Without hang
            detection they would wait for the collective timeout (600 s by default).
  slow      rank 1's forward passes take 2x as long (busy waiting), for the whole job.

Figures, from what the job recorded:

  hang_detect_s     the freeze (the fault's marker file, written just before SIGSTOP)
                    to the hang declared (the restart's start in the job's recovery
                    record: its first step after the hang, minus how long that took)
  hang_recover_s    the hang declared to the first step of the new group (teardown,
                    placement, engine build, restore of the newest commit)
  straggler_reported_ratio
                    (1 + the reported slowdown of rank 1) / the injected factor: 1.0 is
                    an exact reading

The hang floor is production's (SPOTLINE_HANG_FLOOR_S, 20 s): steps here are far
shorter than a tenth of it, so the bound is the floor. The table shows medians with
[min-max] over repeats.

    python benchmarks/hang.py --json /tmp/hang.json        # about 3 minutes on 2 cores
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

FREEZE_STEP = 20
FACTOR = 2.0
RANKS = 4


def bench_spec(workdir: Path, name: str, steps: int) -> Any:
    from spotline.config import load_spec

    return load_spec(
        {
            "name": name,
            "model": {"n_layers": 4, "d_model": 128, "n_heads": 4, "seq_len": 64},
            "data": {"max_bytes": 300_000},
            "parallel": {"pipeline_stages": 1, "micro_batches": 1},
            "elastic": {"min_replicas": RANKS, "max_replicas": RANKS},
            "train": {"steps": steps, "global_batch_size": 4 * RANKS, "warmup_steps": 5},
            "checkpoint": {
                "uri": f"file://{workdir}/{name}/ckpt",
                "staging_dir": str(workdir / name / "staging"),
                "interval_steps": 10,
            },
            # Marked as a test: its ranks apply the faults SPOTLINE_TEST_FAULTS names.
            "failure": {"straggler_window_steps": 10, "cordon": False, "test_faults": True},
            "resources": {"device": "cpu", "cpus_per_worker": 0.5},
        }
    )


def _write_faults(faults_dir: Path, name: str, faults: list[dict[str, Any]]) -> None:
    (faults_dir / f"{name}.json").write_text(json.dumps(faults))


def freeze_arm(workdir: Path, faults_dir: Path, repeat: int) -> dict[str, Any]:
    import spotline

    name = f"hang-freeze-{repeat}"
    _write_faults(
        faults_dir, name, [{"kind": "freeze", "rank": 2, "step": FREEZE_STEP, "phase": "forward"}]
    )
    t0 = time.time()
    result = spotline.Job(bench_spec(workdir, name, 40)).run(verbose=False)
    if result.state != "finished":
        raise RuntimeError(f"{name} ended {result.state}: {result.error}")
    marker = faults_dir / f"{name}.0.fired"
    frozen_at = marker.stat().st_mtime
    (rec,) = [r for r in result.recoveries if r["why"] == "hang"]
    declared_at = rec["resumed_at"] - rec["seconds"]
    return {
        "hang_detect_s": declared_at - frozen_at,
        "hang_recover_s": rec["seconds"],
        "named": result.attempts[0]["error"],
        "restored_from": result.attempts[1]["restored_from"],
        "wall_s": time.time() - t0,
    }


def slow_arm(workdir: Path, faults_dir: Path, repeat: int) -> dict[str, Any]:
    import spotline

    name = f"hang-slow-{repeat}"
    _write_faults(faults_dir, name, [{"kind": "slow", "rank": 1, "factor": FACTOR}])
    result = spotline.Job(bench_spec(workdir, name, 60)).run(verbose=False)
    if result.state != "finished":
        raise RuntimeError(f"{name} ended {result.state}: {result.error}")
    found = {s["rank"]: s for s in result.health["stragglers"]}
    ranks = result.health["ranks"]
    mine = found.get(1)
    return {
        "straggler_reported_ratio": (1 + mine["slowdown"]) / FACTOR if mine else None,
        "reported_ranks": sorted(found),
        "compute_s": {r["rank"]: r["compute_s"] for r in ranks},
    }


def _fmt(values: list[float]) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    med = statistics.median(vals)
    return f"{med:.2f} [{min(vals):.2f}-{max(vals):.2f}]" if len(vals) > 1 else f"{med:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))
    # Ray's core reads its auth mode once, at import; `ray start` clusters on this host
    # run with tokens, and a local one started here does the same.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    import ray

    from spotline.runtime.cluster import bind_to_loopback

    workdir = Path(tempfile.mkdtemp(prefix="spotline-hang-"))
    faults_dir = workdir / "faults"
    faults_dir.mkdir()
    bind_to_loopback()
    ray.init(
        address="local",
        num_cpus=RANKS,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
        runtime_env={"env_vars": {"SPOTLINE_TEST_FAULTS": str(faults_dir)}},
    )
    runs: list[dict[str, Any]] = []
    try:
        for i in range(args.repeats):
            runs.append({"freeze": freeze_arm(workdir, faults_dir, i)})
            runs[-1]["slow"] = slow_arm(workdir, faults_dir, i)
            print(f"repeat {i + 1}/{args.repeats}: {json.dumps(runs[-1], default=str)[:400]}")
    finally:
        ray.shutdown()

    detect = [r["freeze"]["hang_detect_s"] for r in runs]
    recover = [r["freeze"]["hang_recover_s"] for r in runs]
    ratio = [r["slow"]["straggler_reported_ratio"] for r in runs]
    print()
    print(f"{'figure':<28} {'median [min-max]':>22}   goal")
    print(f"{'hang_detect_s':<28} {_fmt(detect):>22}   < 30 s (the collective timeout: 600 s)")
    print(f"{'hang_recover_s':<28} {_fmt(recover):>22}   < 15 s")
    print(f"{'straggler_reported_ratio':<28} {_fmt(ratio):>22}   1.0 (injected {FACTOR}x)")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "hang_detect_s": statistics.median(detect),
                    "hang_recover_s": statistics.median(recover),
                    "straggler_reported_ratio": statistics.median(
                        [v for v in ratio if v is not None] or [float("nan")]
                    ),
                    "runs": runs,
                },
                indent=2,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
