"""Seconds from a node lost without notice to training again: in place against a restart.

One job on a fresh multi-node Ray cluster (`ray.cluster_utils`): a head with no
devices and three "spot" nodes with one `spot_gpu` each (CPU compute), a tiny GPT at
pp=1 with 3 replicas, peer copies every 5 steps and no commit before the loss. At step
60 the node of rank 2 vanishes (its processes SIGKILLed, its state keeper killed, the
node removed). Two arms, the same job otherwise:

  inplace   recovery.in_place: true: the replicas that survive keep their processes
            and re-form at 2 replicas
  restart   recovery.in_place: false: every rank ends and a new group starts

Measured from the driver, which polls the job's status every 50 ms: the seconds from
the kill to the status whose events first say the next group trained a step
("training again", everything the user waits for included), the controller's own
figure in that event (from when it saw the loss), the ranks kept (the same PIDs), and
the steps lost (the last step the lost group trained, minus the step restored). The table gives
medians with [min-max] over the repeats.

    python benchmarks/loss_to_training.py --repeats 3 --json /tmp/loss.json   # ~1 min a run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))

KILL_AT = 60


def _spec(tmp: Path, name: str, in_place: bool):
    from spotline.config import load_spec

    return load_spec(
        {
            "name": name,
            "model": {"n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 32},
            "data": {"max_bytes": 300_000},
            "parallel": {"pipeline_stages": 1, "micro_batches": 2},
            "elastic": {"min_replicas": 1, "max_replicas": 3},
            "train": {"steps": 400, "global_batch_size": 12, "warmup_steps": 5},
            "checkpoint": {
                "uri": f"file://{tmp}/ckpt",
                "interval_steps": 1000,
                "staging_dir": str(tmp / "staging"),
            },
            "resources": {
                "device": "cpu",
                "cpus_per_worker": 0.5,
                "stages": [{"resources": {"spot_gpu": 1}}],
            },
            "recovery": {"peer_interval_steps": 5, "in_place": in_place},
            # Steps of a few ms on a shared 2-core host straggle by chance: no cordons.
            "failure": {"cordon": False},
        }
    )


def _once(in_place: bool, tmp: Path) -> dict[str, Any]:
    import ray
    from ray.cluster_utils import Cluster

    import spotline
    from spotline.runtime.keeper import keeper_name

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 0})
    nodes = [cluster.add_node(num_cpus=2, resources={"spot_gpu": 1}) for _ in range(3)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, logging_level="WARNING")
    try:
        run = spotline.Job(_spec(tmp, "loss", in_place)).start()
        killed_at = victim = None
        pids: set[int] = set()
        again = None
        events: list[str] = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            st = run.status()
            events = st["events"]
            if killed_at is None and st["step"] >= KILL_AT and st["replicas"] == 3:
                pids = {w["pid"] for w in st["workers"]}
                victim = next(w["node_id"] for w in st["workers"] if w["rank"] == 2)
                for w in st["workers"]:
                    if w["node_id"] == victim:
                        os.kill(w["pid"], signal.SIGKILL)
                ray.kill(ray.get_actor(keeper_name(st["name"], victim)))
                cluster.remove_node(next(n for n in nodes if n.node_id == victim), False)
                killed_at, seen = time.monotonic(), len(st["events"])
            elif killed_at is not None and any("training again" in e for e in events[seen:]):
                again = time.monotonic() - killed_at  # the next group's first step is in
                break
            if st["state"] in ("finished", "failed"):
                break
            time.sleep(0.05)
        if again is None:
            raise SystemExit(f"no training after the loss; last events: {events[-8:]}")
        ctl = [
            float(m.group(1))
            for e in events
            if (m := re.search(r"training again ([\d.]+)s after the node loss", e))
        ]
        st = run.status()
        kept = {w["pid"] for w in st["workers"]} & pids
        lost_group, next_group = run.stop().attempts[:2]
        return {
            "loss_to_training_s": again,
            "controller_s": ctl[-1] if ctl else None,
            "kept_ranks": len(kept),
            "replicas_after": st["replicas"],
            # The last step the lost group trained (its ranks ran past the status polled
            # at the kill) minus the step the next group restored.
            "steps_lost": lost_group["losses"][-1][0] - next_group["restored_from"],
            "blocked": [e for e in events if "still in its step" in e],
        }
    finally:
        ray.shutdown()
        cluster.shutdown()


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):6.2f} s [{min(xs):.2f}-{max(xs):.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows: dict[str, list[dict[str, Any]]] = {"inplace": [], "restart": []}
    for i in range(args.repeats):
        for arm in rows:  # alternated, so drift on a shared machine hits both arms
            with tempfile.TemporaryDirectory() as tmp:
                rows[arm].append(_once(arm == "inplace", Path(tmp)))
            print(f"[loss_to_training] repeat {i + 1}/{args.repeats} {arm}: {rows[arm][-1]}")
    print(f"\nnode lost without notice at step {KILL_AT}, 3 -> 2 replicas, {args.repeats} runs")
    print(f"{'arm':<10}{'loss -> training':>26}{'controller':>26}{'kept':>6}{'lost':>6}")
    for arm, rs in rows.items():
        ctl = [r["controller_s"] for r in rs if r["controller_s"] is not None]
        print(
            f"{arm:<10}{_fmt([r['loss_to_training_s'] for r in rs]):>26}"
            f"{_fmt(ctl) if ctl else 'n/a':>26}"
            f"{statistics.median(r['kept_ranks'] for r in rs):>6.0f}"
            f"{statistics.median(r['steps_lost'] for r in rs):>6.0f}"
        )
    ratio = statistics.median(r["loss_to_training_s"] for r in rows["restart"]) / statistics.median(
        r["loss_to_training_s"] for r in rows["inplace"]
    )
    print(f"restart / in place (loss -> training, medians): {ratio:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"runs": rows, "restart_over_inplace": ratio}, indent=2))


if __name__ == "__main__":
    main()
