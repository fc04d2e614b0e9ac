"""What peer memory costs: the keepers' bytes, a rank's host memory, and the job's pace.

On one multi-node `ray.cluster_utils.Cluster` (a head and two nodes of two `spot_gpu`
slots each, all on 127.0.0.1, CPU compute), for two shapes of the same GPT:

  pp1   1 stage x 4 replicas (ZeRO-1): two ranks a node
  pp2   2 stages x 2 replicas: one replica a node

it runs the job with no preemption, alternating arms in one invocation:

  on       the default: peer snapshots (k measured) and in-place recovery
  off      recovery.peer_snapshots: false, recovery.in_place: false
  budget   `on` with recovery.peer_memory at what one kept step needs on the busiest
           node (the first degrade level)
  restore  `on`, with one rank's process killed once copies are kept: the group
           restores from peer memory in place; the keepers' peaks are read from just
           before the kill to the new group's first settled copy

and reads, every half second while each job trains (ranks' RSS from /proc; each
keeper's own account, `StateKeeper.memory`, every five seconds):

- keeper_bytes_ratio: the most a node's keeper counted at once (its copies' rooms, the
  copy arriving in Ray's object store, reads on their way out, its working heap) over
  that node's share of the state: one copy of its own ranks' and its buddy's;
- keeper_rss_own_ratio: the keeper process's resident memory above its start (its
  copies' maps, the store's pages a copy arrives through, its heap), at its highest and
  at the end, over the node's OWN state (one copy of its own ranks'): what holding
  peers' copies costs a node against what it trains;
- restore_own_ratio: the same measured from just before a rank is killed to the new
  group's first settled copy (the restore's peak), beside the plan's figure for it;
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

About 18 minutes on 2 cores at the defaults.
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
    if arm == "restore":  # the one rank killed on purpose
        raw["failure"]["max_failures"] = 1
    if budget is not None:
        raw["recovery"]["peer_memory"] = str(budget)
    return load_spec(raw)


class Watch:
    """Samples the ranks' memory while a job runs, and asks its keepers for theirs."""

    def __init__(self, run: Any):
        self.run = run
        self.rank_rss: dict[int, int] = defaultdict(int)  # pid -> peak
        self.keepers: dict[str, dict[str, Any]] = {}  # node -> its newest account
        self.fits: dict[str, dict[str, Any]] = {}  # node -> own, buddy, keeper name
        self.nodes: dict[str, list[int]] = {}  # node -> ranks
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()

    def ask(self, reset: bool = False) -> dict[str, dict[str, Any]]:
        """Every keeper of the latest placement's account, by node (`reset`: its peaks
        start again from now)."""
        import ray

        out = {}
        for node, f in self.fits.items():
            with contextlib.suppress(Exception):  # a keeper gone, or not started yet
                handle = ray.get_actor(f["keeper"])
                out[node] = ray.get(handle.memory.remote(reset), timeout=5)
        return out

    def _loop(self) -> None:
        import psutil

        tick = 0
        while not self._stop.is_set():
            tick += 1
            with contextlib.suppress(Exception):  # a job between states
                st = self.run.status()
                if st["step"] >= 2:  # optimizer state exists
                    for w in st.get("workers") or []:
                        with contextlib.suppress(psutil.Error):
                            rss = psutil.Process(w["pid"]).memory_info().rss
                            self.rank_rss[w["pid"]] = max(self.rank_rss[w["pid"]], rss)
                        self.nodes.setdefault(w["node_id"], [])
                        if w["rank"] not in self.nodes[w["node_id"]]:
                            self.nodes[w["node_id"]].append(w["rank"])
                for f in (st.get("peer_memory") or {}).get("nodes") or []:
                    if f.get("keeper"):
                        self.fits[f["node"]] = f
                # A keeper keeps its own high-water marks: asked every ASK_EVERY samples,
                # a call into it at each sample would slow the `on` arm alone.
                if tick % ASK_EVERY == 0:
                    self.keepers.update(self.ask())
            self._stop.wait(SAMPLE_S)


def _rss_above(m: dict[str, Any], key: str = "rss_peak") -> int:
    """A keeper's resident memory (its heap and shared maps) above its process's start."""
    rss, start = m[key], m["rss_start"]
    now = rss["anon_shmem"] if "anon_shmem" in rss else rss["anon"] + rss["shmem"]
    return now - start["anon"] - start["shmem"]


def _restore_window(w: Watch, run: Any) -> dict[str, dict[str, Any]]:
    """Kill rank 0's process once copies are kept; the keepers' accounts from just
    before it to the new group's first settled copy after its restore from peers."""
    import signal

    from spotline.testing import wait_for

    st = wait_for(run, lambda s: ((s.get("peer_memory") or {}).get("copies") or 0) >= 3, "copies")
    w.ask(reset=True)
    pid = next(x["pid"] for x in st["workers"] if x["rank"] == 0)
    os.kill(pid, signal.SIGKILL)

    def settled_after(s: dict[str, Any]) -> bool:
        pm = s.get("peer_memory") or {}
        restores = pm.get("restores") or []
        return bool(restores) and (pm.get("newest_step") or 0) > restores[-1]["step"]

    wait_for(run, settled_after, "a copy after the restore from peers", 300)
    time.sleep(2 * SAMPLE_S)  # its settle reaches the keepers
    return w.ask()


def run_arm(shape: str, arm: str, steps: int, tmp: Path, budget: int | None = None) -> dict:
    import spotline
    from spotline.planning.peer_memory import node_peer_memory, rank_copy_bytes

    spec = spec_for(shape, arm, steps, tmp, budget)
    t0 = time.time()
    run = spotline.Job(spec).start()
    window: dict[str, dict[str, Any]] = {}
    with Watch(run) as w:
        if arm == "restore":
            window = _restore_window(w, run)
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
    if arm == "restore":
        out["restores"] = (result.peer_memory or {}).get("restores")
        plan = node_peer_memory(spec, replicas, SLOTS, None)
        out["plan_restore_own_ratio"] = plan.restore_peak / plan.own
    if arm != "off" and w.keepers:
        fits = {n: f for n, f in w.fits.items() if n in w.keepers}
        out["keeper_bytes_ratio"] = max(
            w.keepers[n]["peak"] / (f["own"] + f["buddy"]) for n, f in fits.items()
        )
        out["keeper_rss_own_ratio"] = max(
            _rss_above(w.keepers[n]) / f["own"] for n, f in fits.items()
        )
        out["keeper_rss_own_end"] = max(
            _rss_above(w.keepers[n], "rss") / f["own"] for n, f in fits.items()
        )
        out["keeper_rss_over_counted"] = max(
            _rss_above(w.keepers[n]) / w.keepers[n]["peak"] for n in fits
        )
        out["node_share_bytes"] = max(f["own"] + f["buddy"] for f in fits.values())
        out["node_own_bytes"] = max(f["own"] for f in fits.values())
        out["buddy_own"] = max(f["buddy"] / f["own"] for f in fits.values())
        if window:
            out["restore_own_ratio"] = max(
                _rss_above(window[n]) / fits[n]["own"] for n in window if n in fits
            )
            out["restore_counted_own_ratio"] = max(
                window[n]["peak"] / fits[n]["own"] for n in window if n in fits
            )
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


def said(r: dict[str, Any]) -> str:
    """One arm's figures as it ends (the table comes at the end of every shape)."""
    keys = ("keeper_bytes_ratio", "keeper_rss_own_ratio", "keeper_rss_own_end",
            "keeper_rss_over_counted", "restore_own_ratio", "restore_counted_own_ratio",
            "plan_restore_own_ratio")  # fmt: skip
    got = ", ".join(f"{k} {r[k]:.2f}" for k in keys if r.get(k) is not None)
    return f"{r['steps_per_min']:.0f} steps/min" + (f"; {got}" if got else "")


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
    from spotline import constants
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
                    print(f"[peer_memory] {shape} {arm}: {said(r)}", flush=True)
            shares = [r["node_share_bytes"] for r in runs if r["shape"] == shape and r["arm"] == "on" and "node_share_bytes" in r]  # fmt: skip
            if not shares:
                raise SystemExit(f"no keeper was read in any `on` arm of {shape}")
            # One kept step needs two copies of the share and the keeper's heap; two kept
            # steps, three: half way between keeps one.
            budget = int(2.5 * shares[-1]) + constants.SPOTLINE_KEEPER_HEAP_BYTES
            r = run_arm(shape, "budget", args.steps, tmp, budget)
            runs.append(r)
            print(f"[peer_memory] {shape} budget {human_bytes(budget)}: {said(r)}", flush=True)
            runs.append(run_arm(shape, "restore", args.steps, tmp))
            r = runs[-1]
            print(f"[peer_memory] {shape} restore {r.get('restores')}: {said(r)}", flush=True)
    finally:
        import ray

        ray.shutdown()
        c.shutdown()
    figures: dict[str, Any] = {"runs": runs, "shapes": {}}
    print()
    print("shape  keeper counted / share   keeper RSS / own: peak, end   restore RSS / own "
          "(plan)   rank RSS / state   (on - off) / state   on / off (pairs)")  # fmt: skip
    for shape in args.only:
        mine = [r for r in runs if r["shape"] == shape]
        on = [r for r in mine if r["arm"] == "on" and "keeper_bytes_ratio" in r]
        off = [r for r in mine if r["arm"] == "off"]
        budget = [r for r in mine if r["arm"] == "budget"]
        restore = [r for r in mine if r["arm"] == "restore"]
        pairs = [
            a["steps_per_min"] / b["steps_per_min"]
            for a, b in zip([r for r in mine if r["arm"] == "on"], off, strict=False)
        ]
        state = mine[0]["rank_state_bytes"]
        rs = restore[0] if restore else {}
        f = {
            # Over the `on` arms whose keepers were read (a run too short for a read has none).
            "keeper_bytes_ratio": max(r["keeper_bytes_ratio"] for r in on),
            "keeper_bytes_ratio_budget": budget[0].get("keeper_bytes_ratio") if budget else None,
            "keeper_rss_own_ratio": max(r["keeper_rss_own_ratio"] for r in on),
            "keeper_rss_own_end": max(r["keeper_rss_own_end"] for r in on),
            "keeper_rss_over_counted": max(r["keeper_rss_over_counted"] for r in on),
            "buddy_over_own": max(r["buddy_own"] for r in on),
            "restore_own_ratio": rs.get("restore_own_ratio"),
            "restore_counted_own_ratio": rs.get("restore_counted_own_ratio"),
            "plan_restore_own_ratio": rs.get("plan_restore_own_ratio"),
            "restores": rs.get("restores"),
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
            f"{f['keeper_bytes_ratio_budget'] or 0:.2f})       "
            f"{f['keeper_rss_own_ratio']:.2f}, {f['keeper_rss_own_end']:.2f}                  "
            f"{f['restore_own_ratio'] or 0:.2f} ({f['plan_restore_own_ratio'] or 0:.2f})"
            f"            {f['rank_rss_ratio']:.2f}            {f['rank_rss_over_off']:+.2f}"
            f"               {spread(pairs)}"
        )
    # The headline figures: the worst shape.
    shapes = figures["shapes"].values()
    for key in ("keeper_bytes_ratio", "keeper_rss_own_ratio", "rank_rss_ratio"):
        figures[key] = max(f[key] for f in shapes)
    figures["recovery_on_vs_off"] = min(f["recovery_on_vs_off"] for f in shapes)
    print(
        f"\nkeeper_rss_own_ratio {figures['keeper_rss_own_ratio']:.2f} (counted: "
        f"{figures['keeper_bytes_ratio']:.2f} of own + buddy), "
        f"rank_rss_ratio {figures['rank_rss_ratio']:.2f} (goal <= 3), "
        f"recovery_on_vs_off {figures['recovery_on_vs_off']:.3f} (goal >= 0.98)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
