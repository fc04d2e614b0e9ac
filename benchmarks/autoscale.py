"""Autoscaling: Spotline and Ray Train v2 on one local autoscaling Ray cluster.

The cluster is Ray's own autoscaler with its fake multi-node provider
(tests/cluster_fixture.py): a head without GPUs, and 0 to 3 spot nodes (2 CPUs, one
`spot_gpu`), launched only for pending demand and removed a few seconds after they go
idle. Both systems train the same GPT (pp=1, data parallel over gloo on CPU, the same
global batch; the loop of benchmarks/spot_goodput.py), each worker asking for one
`spot_gpu` as a GPU worker asks for a GPU, elastic from 1 to N workers (--max-replicas,
default 2: on 2 cores a third CPU worker cannot make a step faster, so Spotline's cost
rule would rightly never grow onto it):

  spotline   spotline.Job, elastic 1..N: its controller states the demand
  raytrain   Ray Train v2 TorchTrainer, ScalingConfig(num_workers=(1, N))

Each run starts from a cluster with no spot node and reports, in seconds:

  first_step_s   submission -> the first training step
  full_size_s    submission -> the first step trained by N workers
  replace_s      one spot node killed at full size (its raylet and every process on
                 it, as when the cloud takes the instance) -> the first step trained by
                 N workers again

The fake provider is never told that a killed node's instance is gone, so its
autoscaler does not replace it; the benchmark adds a fresh spot node right after the
kill, standing in for that replacement, the same way for both systems. Each run has a
cluster of its own; runs alternate (spotline, raytrain, spotline, ...), --repeats times
each; the median is reported, with the spread.

    python benchmarks/autoscale.py [--repeats R] [--max-replicas N] [--only spotline raytrain]
                                   [--json PATH]

Ray Train needs ray[train] (`pip install -e ".[bench]"`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# `ray start` turns token auth on; Ray's core reads the mode once per process, so this
# process is in token mode before anything imports Ray.
os.environ["RAY_AUTH_MODE"] = "token"

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))

from cluster_fixture import MAX_SPOT_NODES, AutoscalingTestCluster, wait_for  # noqa: E402
from spot_goodput import WORKLOAD, _raytrain_loop  # noqa: E402

FIGURES = ("first_step_s", "full_size_s", "replace_s")
FULL = 2  # the jobs' full size by default (replicas, one worker per spot node)
PHASE_TIMEOUT_S = 300


def _spot_nodes() -> list[str]:
    import ray

    return [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("spot_gpu")]


def _workload(name: str, tmp: Path, full: int) -> dict[str, Any]:
    raw = json.loads(json.dumps(WORKLOAD))
    raw["name"] = name
    # Compute-bound steps (the goodput model's are mostly overhead): a bigger group is
    # faster only then, and Spotline grows only when its cost rule sees it pay.
    raw["model"] = {"n_layers": 2, "d_model": 128, "n_heads": 4, "seq_len": 64}
    raw["train"]["global_batch_size"] = 48
    raw["train"]["steps"] = 1_000_000  # ended by the benchmark
    raw["elastic"] = {"min_replicas": 1, "max_replicas": full, "wait_for_capacity_s": 600}
    raw["checkpoint"]["uri"] = f"file://{tmp}/{name}/ckpt"
    raw["checkpoint"]["staging_dir"] = str(tmp / name / "staging")
    return raw


def _quiet(cluster: AutoscalingTestCluster) -> None:
    """Back to no spot node: every run starts from an empty pool."""
    wait_for(lambda: not _spot_nodes(), "the idle spot nodes to be removed", 180)


# --- Spotline ---------------------------------------------------------------------------


def run_spotline(
    cluster: AutoscalingTestCluster, tmp: Path, name: str, full: int
) -> dict[str, Any]:
    import spotline
    from spotline.config import load_spec

    spec = load_spec(_workload(name, tmp, full))
    t0 = time.time()
    run = spotline.Job(spec).start()
    marks: dict[str, float] = {}
    try:
        marks["first_step_s"] = _wait_full(run, 1, t0) - t0
        marks["full_size_s"] = _wait_full(run, full, t0) - t0
        st = run.status()
        victim = st["workers"][-1]["node_id"]
        t_kill = time.time()
        cluster.kill_node(victim)
        cluster.add_spot_node()
        marks["replace_s"] = _wait_full(run, full, t_kill, avoid=victim) - t_kill
    finally:
        run.stop()
        cluster.remove_added_nodes()
    return marks


def _wait_full(run: Any, replicas: int, since: float, avoid: str | None = None) -> float:
    """When the job first trained a step with `replicas` replicas (none of them on node
    `avoid`) after `since`: the first status showing such a group a step past where it
    was first seen (an upper bound by one status poll)."""
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    seen_at: tuple[Any, int] | None = None  # (the group's ranks' pids, its step then)
    while time.monotonic() < deadline:
        st = run.status()
        if st["state"] in ("failed", "finished", "stopped"):
            raise RuntimeError(f"the job ended {st['state']}: {st.get('error')}")
        workers = st["workers"]
        group = tuple(sorted(w["pid"] for w in workers))
        ok = (
            st["state"] == "running"
            and st["replicas"] >= replicas
            and not any(w["node_id"] == avoid for w in workers)
        )
        if not ok:
            seen_at = None
        elif seen_at is None or seen_at[0] != group:
            seen_at = (group, st["step"])
        elif st["step"] > seen_at[1]:
            return time.time()
        time.sleep(0.1)
    raise TimeoutError(f"no step at {replicas} replica(s) within {PHASE_TIMEOUT_S}s")


# --- Ray Train v2 -----------------------------------------------------------------------


def run_raytrain(
    cluster: AutoscalingTestCluster, tmp: Path, name: str, full: int
) -> dict[str, Any]:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from spotline.config import load_spec

    spec = load_spec(_workload(name, tmp, full))
    events = tmp / name / "events.jsonl"
    stop = tmp / name / "stop"
    events.parent.mkdir(parents=True, exist_ok=True)
    trainer = TorchTrainer(
        _raytrain_loop,
        train_loop_config={
            "spec": spec.model_dump_json(),
            "events": str(events),
            "stop_file": str(stop),
        },
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(
            num_workers=(1, full),
            use_gpu=False,
            resources_per_worker={"CPU": spec.resources.cpus_per_worker, "spot_gpu": 1},
        ),
        run_config=RunConfig(
            name=name,
            storage_path=str(tmp / name / "storage"),
            failure_config=FailureConfig(max_failures=-1),
        ),
    )
    errors: list[BaseException] = []

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    t0 = time.time()
    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    marks: dict[str, float] = {}
    try:
        marks["first_step_s"] = _wait_group(events, 1, t0, errors) - t0
        marks["full_size_s"] = _wait_group(events, full, t0, errors) - t0
        t_kill = time.time()
        cluster.kill_node(_spot_nodes()[-1])  # each spot node holds one worker
        cluster.add_spot_node()
        marks["replace_s"] = _wait_group(events, full, t_kill, errors) - t_kill
    finally:
        stop.touch()
        thread.join(timeout=120)
        cluster.remove_added_nodes()
    return marks


def _wait_group(events: Path, world: int, since: float, errors: list[BaseException]) -> float:
    """When a worker group of `world` workers (or more) first trained a step after
    `since`, from the marks its rank 0 writes at each start."""
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    while time.monotonic() < deadline:
        if errors:
            raise RuntimeError(f"Ray Train failed: {errors[0]}")
        if events.exists():
            for line in events.read_text().splitlines():
                m = json.loads(line)
                if m["kind"] == "first_step" and m["world"] >= world and m["t"] > since:
                    return m["t"]
        time.sleep(0.1)
    raise TimeoutError(f"no step at {world} worker(s) within {PHASE_TIMEOUT_S}s")


# --- main -------------------------------------------------------------------------------


def summarize(runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for system, marks in runs.items():
        out[system] = {
            f: {
                "median": statistics.median(m[f] for m in marks),
                "min": min(m[f] for m in marks),
                "max": max(m[f] for m in marks),
                "runs": [m[f] for m in marks],
            }
            for f in FIGURES
        }
    if {"spotline", "raytrain"} <= set(runs):
        out["spotline_over_raytrain"] = {
            f: out["spotline"][f]["median"] / out["raytrain"][f]["median"] for f in FIGURES
        }
    return out


def render(figures: dict[str, Any]) -> str:
    systems = [s for s in ("spotline", "raytrain") if s in figures]
    head = f"{'seconds (median, min-max)':<28}" + "".join(f"{s:>22}" for s in systems)
    if "spotline_over_raytrain" in figures:
        head += f"{'spotline / raytrain':>22}"
    lines = [head]
    for f in FIGURES:
        row = f"{f:<28}"
        for s in systems:
            v = figures[s][f]
            row += f"{v['median']:>10.1f} ({v['min']:.1f}-{v['max']:.1f})".rjust(22)
        if "spotline_over_raytrain" in figures:
            row += f"{figures['spotline_over_raytrain'][f]:>22.2f}"
        lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="runs of each system")
    ap.add_argument("--only", nargs="*", choices=["spotline", "raytrain"])
    ap.add_argument(
        "--max-replicas",
        type=int,
        default=FULL,
        help=f"the jobs' full size, 2..{MAX_SPOT_NODES} (default {FULL})",
    )
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    if not 2 <= args.max_replicas <= MAX_SPOT_NODES:
        ap.error(f"--max-replicas must be 2..{MAX_SPOT_NODES}")
    systems = args.only or ["spotline", "raytrain"]
    if "raytrain" in systems:
        try:
            import ray.train.torch  # noqa: F401
        except ImportError as e:
            print(
                f'autoscale.py: Ray Train needs ray[train] ({e}); pip install -e ".[bench]"',
                file=sys.stderr,
            )
            return 2
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import ray

    from spotline.runtime.cluster import bind_to_loopback

    bind_to_loopback()  # every node of the benchmark's cluster listens on 127.0.0.1

    runners = {"spotline": run_spotline, "raytrain": run_raytrain}
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory(prefix="spotline-autoscale-") as tmp:
        for i in range(args.repeats):
            for system in systems:
                print(f"[autoscale] {system} run {i + 1} ...", flush=True)
                # A fresh cluster per run: the fake provider goes on counting a killed
                # node (it never looks unresponsive), which would skew the next run.
                cluster = AutoscalingTestCluster.start()
                try:
                    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
                    _quiet(cluster)
                    marks = runners[system](
                        cluster, Path(tmp), f"autoscale-{system}-{i}", args.max_replicas
                    )
                finally:
                    ray.shutdown()
                    cluster.stop()
                runs[system].append(marks)
                print(
                    "[autoscale]   " + ", ".join(f"{f} {marks[f]:.1f}" for f in FIGURES),
                    flush=True,
                )
    figures = summarize(runs)
    print()
    print(render(figures))
    if args.json:
        out = {s: {f: figures[s][f]["median"] for f in FIGURES} for s in systems}
        args.json.write_text(json.dumps({**out, "detail": figures}, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
