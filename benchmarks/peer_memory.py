"""What peer memory costs: the keepers' bytes, a rank's host memory, and the job's pace.

On one multi-node `ray.cluster_utils.Cluster` (a head and two nodes of two `spot_gpu`
slots each, all on 127.0.0.1, CPU compute), for two shapes of the same GPT:

  pp1   1 stage x 4 replicas (ZeRO-1): two ranks a node
  pp2   2 stages x 2 replicas: one replica a node

it runs the job with no preemption, alternating arms in one invocation:

  on       the default: peer snapshots (k measured) and in-place recovery
  off      recovery.peer_snapshots: false, recovery.in_place: false
  budget   `on` with recovery.peer_memory at 1.5 copies of the busiest node's share:
           one kept step (the first degrade level)

and reads, every half second while each job trains (from /proc; each keeper's own
high-water mark of the bytes it held is asked every five seconds):

- keeper_bytes_ratio: the most a node's keeper held (its own count of bytes, and its
  process's resident memory above where it started) over that node's share of the
  state, one copy of its own ranks' and its buddy's (goal <= 2.2);
- rank_rss_ratio: a rank's peak resident memory over its state bytes (what its
  checkpoint holds). On CPU the live model, gradients and optimizer are host memory
  too, so the table also gives the peak of `on` over `off` per state byte: what
  recovery itself adds (on a GPU node the raw ratio is that, plus the process);
- recovery_on_vs_off: committed steps per minute (job start to result) of `on` over
  `off`, each pair run back to back, the median of the pairs (goal >= 0.98). A short
  job runs first on each shape and is not counted: the first job on a new cluster
  reached its first step 2-4.5 s later than the ones after it, whichever arm it was
  (a one-time cost of the cluster's first job, not of either arm).

    python benchmarks/peer_memory.py [--steps N] [--pairs 3] [--warmup-steps 30]
        [--only pp1 pp2] [--json PATH]

About 15 minutes on 2 cores at the defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

SHAPES = {"pp1": (1, 4), "pp2": (2, 2)}
"""Shape -> (pipeline stages, replicas)."""
NODES, SLOTS = 2, 2
SAMPLE_S = 0.5
"""How often the ranks' and keepers' resident memory is read (from /proc, no call)."""
ASK_EVERY = 10
"""Samples between two questions to a keeper (its high-water mark of bytes held)."""

WORKLOAD: dict[str, Any] = {
    "model": {"n_layers": 4, "d_model": 256, "n_heads": 4, "seq_len": 64},
    "data": {"max_bytes": 1_000_000},
    "parallel": {"micro_batches": 2, "zero_stage": 1},
    "train": {"global_batch_size": 8, "warmup_steps": 20, "log_every": 100},
    "checkpoint": {"interval_steps": 100, "keep_last": 2},
    "resources": {"device": "cpu", "cpus_per_worker": 0.5, "stages": []},
    "failure": {"max_failures": 0},
}


def spec_for(shape: str, arm: str, steps: int, tmp: Path, budget: int | None = None):
    from spotline.config import load_spec

    pp, replicas = SHAPES[shape]
    raw = json.loads(json.dumps(WORKLOAD))
    raw["name"] = f"peermem-{shape}-{arm}"
    raw["parallel"]["pipeline_stages"] = pp
    raw["resources"]["stages"] = [{"resources": {"spot_gpu": 1}}] * pp
    raw["train"]["steps"] = steps
    raw["elastic"] = {"min_replicas": replicas, "max_replicas": replicas}
    raw["checkpoint"]["uri"] = f"file://{tmp}/{shape}-{arm}-{time.time_ns()}/ckpt"
    raw["checkpoint"]["staging_dir"] = str(tmp / "staging")
    on = arm != "off"
    raw["recovery"] = {"peer_snapshots": on, "in_place": on}
    if budget is not None:
        raw["recovery"]["peer_memory"] = str(budget)
    return load_spec(raw)


class Watch:
    """Samples the ranks' and the keepers' memory while a job runs."""

    def __init__(self, run: Any):
        self.run = run
        self.rank_rss: dict[int, int] = defaultdict(int)  # pid -> peak
        self.keeper_bytes: dict[str, int] = defaultdict(int)  # node -> peak held
        self.keeper_rss: dict[str, list[int]] = defaultdict(list)  # node -> samples
        self.nodes: dict[str, list[int]] = {}  # node -> ranks
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        import psutil
        import ray

        from spotline.compat.ray import call_on_actor
        from spotline.runtime.keeper import keeper_name

        keepers: dict[str, tuple[Any, int]] = {}
        tick = 0
        while not self._stop.is_set():
            tick += 1
            with contextlib.suppress(Exception):  # a job between states, a keeper gone
                st = self.run.status()
                if st["step"] >= 2:  # optimizer state exists
                    for w in st.get("workers") or []:
                        with contextlib.suppress(psutil.Error):
                            rss = psutil.Process(w["pid"]).memory_info().rss
                            self.rank_rss[w["pid"]] = max(self.rank_rss[w["pid"]], rss)
                        self.nodes.setdefault(w["node_id"], [])
                        if w["rank"] not in self.nodes[w["node_id"]]:
                            self.nodes[w["node_id"]].append(w["rank"])
                # This job's keepers only (an earlier arm's may still be going away), by
                # name on its workers' nodes: Ray's state API needs a dashboard, and the
                # cluster here runs none.
                for node in self.nodes:
                    if node not in keepers:
                        with contextlib.suppress(ValueError):  # not started yet
                            handle = ray.get_actor(keeper_name(self.run.spec.name, node))
                            pid = ray.get(call_on_actor(handle, lambda _: os.getpid()))
                            keepers[node] = (handle, pid)
                for node, (handle, pid) in keepers.items():
                    # The keeper's own high-water mark, asked every ASK_EVERY samples:
                    # a call into it at each sample would slow the `on` arm alone.
                    if tick % ASK_EVERY == 0:
                        held = ray.get(handle.peak_nbytes.remote(), timeout=5)
                        self.keeper_bytes[node] = max(self.keeper_bytes[node], held)
                    with contextlib.suppress(psutil.Error):
                        self.keeper_rss[node].append(psutil.Process(pid).memory_info().rss)
            self._stop.wait(SAMPLE_S)


def run_arm(shape: str, arm: str, steps: int, tmp: Path, budget: int | None = None) -> dict:
    import spotline
    from spotline.planning.peer_memory import rank_copy_bytes

    spec = spec_for(shape, arm, steps, tmp, budget)
    t0 = time.time()
    run = spotline.Job(spec).start()
    with Watch(run) as w:
        result = run.wait(verbose=False)
    wall = time.time() - t0
    pp, replicas = SHAPES[shape]
    copy = rank_copy_bytes(spec, replicas)
    out: dict[str, Any] = {
        "shape": shape,
        "arm": arm,
        "committed": result.committed_steps[-1] if result.committed_steps else 0,
        "wall_s": wall,
        "steps_per_min": (result.committed_steps[-1] if result.committed_steps else 0) / wall * 60,
        "rank_rss_peak": max(w.rank_rss.values(), default=0),
        "rank_state_bytes": max(copy),
        "peer_memory": result.peer_memory,
    }
    if arm != "off" and w.keeper_bytes:
        ring = sorted(w.nodes)
        share = {}
        for i, node in enumerate(ring):
            own = sum(copy[r] for r in w.nodes[node])
            buddy = sum(copy[r] for r in w.nodes[ring[i - 1]]) if len(ring) > 1 else 0
            share[node] = own + buddy
        out["keeper_bytes_ratio"] = max(
            w.keeper_bytes[n] / share[n] for n in share if n in w.keeper_bytes
        )
        out["keeper_rss_ratio"] = max(
            (max(xs) - xs[0]) / share[n] for n, xs in w.keeper_rss.items() if n in share and xs
        )
        out["node_share_bytes"] = max(share.values())
    return out


def cluster() -> Any:
    import ray
    from ray.cluster_utils import Cluster

    from spotline.runtime.cluster import bind_to_loopback

    bind_to_loopback()
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False},
    )
    for _ in range(NODES):
        c.add_node(num_cpus=SLOTS * 0.5, resources={"spot_gpu": SLOTS})
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, logging_level="ERROR")
    return c


def spread(xs: list[float]) -> str:
    if not xs:
        return "n/a"
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument(
        "--warmup-steps",
        type=int,
        default=30,
        help="steps of an uncounted job run first on each shape (0: none)",
    )
    ap.add_argument("--only", nargs="*", choices=sorted(SHAPES), default=sorted(SHAPES))
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    from spotline.units import human_bytes

    tmp = Path(tempfile.mkdtemp(prefix="spotline-peermem-"))
    c = cluster()
    runs: list[dict[str, Any]] = []
    try:
        for shape in args.only:
            if args.warmup_steps:  # the first job on a new cluster pays its one-time start
                run_arm(shape, "off", args.warmup_steps, tmp)
                print(f"[peer_memory] {shape} warm-up job: not counted", flush=True)
            for i in range(args.pairs):
                order = ("on", "off") if i % 2 == 0 else ("off", "on")
                for arm in order:
                    r = run_arm(shape, arm, args.steps, tmp)
                    runs.append(r)
                    print(
                        f"[peer_memory] {shape} {arm}: {r['steps_per_min']:.0f} steps/min",
                        flush=True,
                    )
            shares = [r["node_share_bytes"] for r in runs if r["shape"] == shape and r["arm"] == "on" and "node_share_bytes" in r]  # fmt: skip
            if not shares:
                raise SystemExit(f"no keeper was read in any `on` arm of {shape}")
            budget = int(1.5 * shares[-1])
            r = run_arm(shape, "budget", args.steps, tmp, budget)
            runs.append(r)
            print(f"[peer_memory] {shape} budget {human_bytes(budget)}: done", flush=True)
    finally:
        import ray

        ray.shutdown()
        c.shutdown()
    figures: dict[str, Any] = {"runs": runs, "shapes": {}}
    print()
    print("shape  keeper bytes / node share   keeper RSS / share   rank RSS / state   "
          "(on - off) RSS / state   on / off steps per min (pairs)")  # fmt: skip
    for shape in args.only:
        mine = [r for r in runs if r["shape"] == shape]
        on = [r for r in mine if r["arm"] == "on"]
        off = [r for r in mine if r["arm"] == "off"]
        budget = [r for r in mine if r["arm"] == "budget"]
        pairs = [a["steps_per_min"] / b["steps_per_min"] for a, b in zip(on, off, strict=False)]
        state = on[0]["rank_state_bytes"]
        f = {
            # Over the `on` arms whose keepers were read (a run too short for a read has none).
            "keeper_bytes_ratio": max(
                r["keeper_bytes_ratio"] for r in on if "keeper_rss_ratio" in r
            ),
            "keeper_rss_ratio": max(r["keeper_rss_ratio"] for r in on if "keeper_rss_ratio" in r),
            "keeper_bytes_ratio_budget": budget[0].get("keeper_bytes_ratio") if budget else None,
            "rank_rss_ratio": max(r["rank_rss_peak"] for r in on) / state,
            "rank_rss_over_off": (
                statistics.median(r["rank_rss_peak"] for r in on)
                - statistics.median(r["rank_rss_peak"] for r in off)
            )
            / state,
            "recovery_on_vs_off": statistics.median(pairs),
            "recovery_on_vs_off_pairs": pairs,
            "state_bytes_per_rank": state,
            "k": [(r["peer_memory"] or {}).get("every_steps") for r in on],
        }
        figures["shapes"][shape] = f
        print(
            f"{shape:5}  {f['keeper_bytes_ratio']:.2f} (budget arm "
            f"{f['keeper_bytes_ratio_budget'] or 0:.2f})             "
            f"{f['keeper_rss_ratio']:.2f}                 {f['rank_rss_ratio']:.2f}"
            f"               {f['rank_rss_over_off']:+.2f}                   "
            f"{spread(pairs)}"
        )
    # The headline figures: the worst shape.
    shapes = figures["shapes"].values()
    figures["keeper_bytes_ratio"] = max(f["keeper_bytes_ratio"] for f in shapes)
    figures["rank_rss_ratio"] = max(f["rank_rss_ratio"] for f in shapes)
    figures["recovery_on_vs_off"] = min(f["recovery_on_vs_off"] for f in shapes)
    print(
        f"\nkeeper_bytes_ratio {figures['keeper_bytes_ratio']:.2f} (goal <= 2.2), "
        f"rank_rss_ratio {figures['rank_rss_ratio']:.2f} (goal <= 3), "
        f"recovery_on_vs_off {figures['recovery_on_vs_off']:.3f} (goal >= 0.98)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
