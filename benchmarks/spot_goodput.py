"""Goodput on spot capacity: one workload, one scripted preemption trace, three systems.

Every arm runs the same GPT (pp=1, ZeRO-1 data parallel, AdamW, constant global batch)
for the same number of steps on a fresh multi-node Ray cluster (`ray.cluster_utils`,
one `spot_gpu` per spot node standing in for its GPU, CPU compute), while a thread
replays the trace in benchmarks/traces/ (notices = GCS drains with a deadline, then the
node goes; losses = the node vanishes; returns = a fresh node joins):

  nopreempt   Spotline, no trace: the reference rate.
  spotline    Spotline: ray-drain notices -> just-in-time checkpoint, shrink to what
              is left, grow back when a node returns and growing pays (elastic 1..3);
              every recovery restarts from the newest commit in object storage
              (recovery.peer_snapshots: false).
  peer        the same, with peer-memory snapshots (recovery.peer_snapshots, k
              measured): a recovery restores the newest step every rank left in live
              nodes' memory, reading nothing from object storage when a copy exists;
              every recovery still ends all ranks and starts new ones
              (recovery.in_place: false).
  inplace     peer memory and in-place recovery (recovery.in_place): the ranks that
              survive a loss, a notice or a grow keep their processes and re-form at
              the new shape; only missing replicas start anew.
  periodic    the same Spotline job with periodic checkpoints only: no notices and no
              elastic shrink (min = max = 3), so it waits for the node to come back.
  raytrain    Ray Train v2 `TorchTrainer`, ScalingConfig(num_workers=(1, 3)), DDP over
              gloo, with its preemption support: every step calls
              `ray.train.get_preemption_info()` and reports a just-in-time checkpoint
              when a node is doomed, plus the same periodic checkpoints. Its ratio is
              against its own no-preemption run (raytrain-nopreempt).

Goodput = committed steps per minute of wall time (the job's start to its result).
Also printed: notice -> commit latency (trace's drain to the committed JIT checkpoint),
node loss -> first step after resume, steps lost per loss without notice (the last step
the lost group trained minus the step the next one restored), bytes read from object
storage per restore, and nopreempt_vs_raytrain: Spotline's
no-preemption steps per minute over Ray Train's (nopreempt / raytrain-nopreempt), the
same workload in the same invocation, so the two systems' own rates compare directly.

    python benchmarks/spot_goodput.py [--trace PATH] [--steps N] [--only ARM ...] [--json PATH]

The Ray Train arms need ray[train] (`pip install -e ".[bench]"`); without it, only
Spotline's arms can run (--only nopreempt spotline periodic).
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = REPO / "benchmarks" / "traces" / "spot_3nodes.yaml"

WORKLOAD: dict[str, Any] = {
    "model": {"n_layers": 2, "d_model": 64, "n_heads": 2, "seq_len": 64},
    "data": {"max_bytes": 1_000_000},
    "parallel": {"pipeline_stages": 1, "micro_batches": 2, "zero_stage": 1},
    "train": {"global_batch_size": 12, "warmup_steps": 20, "log_every": 50},
    "checkpoint": {"interval_steps": 50, "keep_last": 3},
    # Each worker asks for the node's one `spot_gpu` (the trace's stand-in for a GPU).
    "resources": {
        "device": "cpu",
        "cpus_per_worker": 0.5,
        "stages": [{"resources": {"spot_gpu": 1}}],
    },
    "failure": {"max_failures": -1},
}


# --- the cluster and the trace ----------------------------------------------------------


class SpotCluster:
    def __init__(self, trace: dict[str, Any]):
        import ray
        from ray.cluster_utils import Cluster

        from spotline.runtime.cluster import bind_to_loopback

        self.node_args = dict(trace["node"])
        bind_to_loopback()  # every node of the cluster on 127.0.0.1
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 2, "num_gpus": 0, "include_dashboard": False},
        )
        self.slots: list[Any] = [
            self.cluster.add_node(**self.node_args) for _ in range(trace["spot_nodes"])
        ]
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, log_to_driver=False, logging_level="ERROR")

    def drain(self, slot: int, deadline_s: float) -> None:
        from spotline.compat.ray import drain_for_preemption

        drain_for_preemption(
            self.slots[slot].node_id,
            "spot preemption (benchmark trace)",
            time.time() + deadline_s,
        )

    def remove(self, slot: int) -> None:
        node, self.slots[slot] = self.slots[slot], None
        if node is not None:
            with contextlib.suppress(Exception):  # a drained idle node may be gone already
                self.cluster.remove_node(node, allow_graceful=False)

    def add(self, slot: int) -> None:
        if self.slots[slot] is None:
            self.slots[slot] = self.cluster.add_node(**self.node_args)

    def close(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()


class TraceReplay:
    """Replays the trace against the cluster from `t0`; records when each event landed.

    Runs on the main thread (Ray starts a node's processes only from there) while the
    job runs on another: `run_job(fn)` does both.
    """

    def __init__(self, cluster: SpotCluster, events: list[dict[str, Any]], t0: float):
        self.cluster, self.t0 = cluster, t0
        self.todo = sorted(
            [dict(e) for e in events]
            + [
                {"at": e["at"] + e["deadline_s"], "kind": "gone", "node": e["node"]}
                for e in events
                if e["kind"] == "notice"
            ],
            key=lambda e: e["at"],
        )
        self.log: list[dict[str, Any]] = []

    def run_job(self, job: Callable[[], Any]) -> Any:
        """Run `job()` on a thread while replaying the trace here; return its result."""
        out: dict[str, Any] = {}

        def target() -> None:
            try:
                out["result"] = job()
            except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
                out["error"] = e

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        for e in self.todo:
            thread.join(max(0.0, self.t0 + e["at"] - time.time()))
            if not thread.is_alive():
                break
            self._apply(e)
        thread.join()
        if "error" in out:
            raise out["error"]
        return out["result"]

    def _apply(self, e: dict[str, Any]) -> None:
        node = self.cluster.slots[e["node"]]
        node_id = node.node_id if node is not None else None
        if e["kind"] == "notice":
            self.cluster.drain(e["node"], e["deadline_s"])
        elif e["kind"] in ("loss", "gone"):
            self.cluster.remove(e["node"])
        elif e["kind"] == "return":
            self.cluster.add(e["node"])
            node_id = self.cluster.slots[e["node"]].node_id
        self.log.append({"t": time.time(), "kind": e["kind"], "node_id": node_id})

    def times(self, kind: str) -> list[float]:
        return [e["t"] for e in self.log if e["kind"] == kind]


def _latencies(marks: list[float], events: list[float]) -> list[float]:
    """For each event, seconds until the first mark after it."""
    out = []
    for t in events:
        later = [m - t for m in marks if m >= t]
        if later:
            out.append(min(later))
    return out


# --- Spotline arms ------------------------------------------------------------------------


def _workload(mode: str, steps: int) -> dict[str, Any]:
    """The shared workload as a fresh spec dict for one arm."""
    raw = json.loads(json.dumps(WORKLOAD))
    raw["name"] = f"goodput-{mode}"
    raw["train"]["steps"] = steps
    return raw


def run_spotline(
    trace: dict[str, Any], preempt: bool, steps: int, mode: str, tmp: Path
) -> dict[str, Any]:
    import spotline
    from spotline.config import load_spec

    n = trace["spot_nodes"]
    raw = _workload(mode, steps)
    raw["checkpoint"]["uri"] = f"file://{tmp}/{mode}/ckpt"
    raw["checkpoint"]["staging_dir"] = str(tmp / mode / "staging")
    if mode in ("spotline", "peer", "inplace"):
        raw["elastic"] = {"min_replicas": 1, "max_replicas": n}
        raw["preemption"] = {"sources": [{"kind": "ray-drain", "poll_interval_s": 0.5}]}
    else:  # nopreempt and periodic: a fixed-size job that waits for its nodes
        raw["elastic"] = {"min_replicas": n, "max_replicas": n, "wait_for_capacity_s": 3600}
    # Peer memory only in its arms, in-place recovery only in its own: the others end
    # every rank at a recovery and restart from object storage.
    raw["recovery"] = {
        "peer_snapshots": mode in ("peer", "inplace"),
        "in_place": mode == "inplace",
    }
    spec = load_spec(raw)
    cluster = SpotCluster(trace)
    try:
        t0 = time.time()
        run = spotline.Job(spec).start()
        replay = TraceReplay(cluster, trace["events"] if preempt else [], t0)
        result = replay.run_job(lambda: run.wait(verbose=False))
        wall = time.time() - t0
    finally:
        cluster.close()
    jit = [x["committed_at"] for x in result.notices if x.get("committed_at") is not None]
    # Only restarts that a loss caused (a node loss, or a failure when the node was not
    # seen go): a loss that hit no rank of the running group restarts nothing, and the
    # next group start after it is not a recovery from it.
    resumed = [r["resumed_at"] for r in result.recoveries if r["why"] in ("node loss", "failure")]
    losses = replay.times("loss") + (replay.times("gone") if mode == "periodic" else [])
    pairs = list(zip(result.attempts, result.attempts[1:], strict=False))
    return {
        "system": mode,
        "steps": result.steps,
        "wall_s": wall,
        "steps_per_min": result.steps / wall * 60,
        "notice_to_commit_s": _latencies(jit, replay.times("notice")),
        "recovery_s": _latencies(resumed, losses),
        "restarts": len(result.recoveries),
        "recoveries": [(r["why"], round(r["seconds"], 2)) for r in result.recoveries],
        "replica_history": [a["replicas"] for a in result.attempts],
        # Per loss without notice: steps the lost group trained past what came back.
        "steps_lost": [
            a["losses"][-1][0] - (b["restored_from"] or 0)
            for a, b in pairs
            if a["ended_by"] == "node lost" and a["losses"]
        ],
        # Per restore: bytes its ranks read from object storage (none from peer memory).
        "storage_bytes": [
            b["restored_bytes"] if b["restored_via"] == "storage" else 0
            for _, b in pairs
            if b["restored_from"] is not None
        ],
        "restored_via": [b["restored_via"] for _, b in pairs],
        # Per group after the first: ranks that kept their processes (re-formed in place).
        "kept": [b.get("kept", 0) for _, b in pairs],
        "peer_memory": result.peer_memory,
    }


# --- the Ray Train v2 arm -------------------------------------------------------------------


def _raytrain_loop(config: dict[str, Any]) -> None:
    """The same model, data, optimizer and LR schedule as the Spotline job, under DDP."""
    import contextlib as cl

    import ray.train
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from spotline.config.schema import JobSpec
    from spotline.data import Sampler, open_dataset
    from spotline.models import build_sequential, model_def
    from spotline.train.trainer import build_optimizer, lr_lambda

    spec = JobSpec.model_validate_json(config["spec"])
    events = Path(config["events"])
    ctx = ray.train.get_context()
    world, rank = ctx.get_world_size(), ctx.get_world_rank()
    torch.set_num_threads(1)
    torch.manual_seed(spec.train.seed)
    # CPU compute: wrap for DDP over gloo by hand, as prepare_model would move the model
    # to a CUDA device.
    md = model_def(spec)
    model = DistributedDataParallel(build_sequential(md))
    opt = build_optimizer(model, spec)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(spec, world))
    step = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(Path(d) / "state.pt", weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step = state["step"]
    data = open_dataset(spec)
    sampler = Sampler(data.train, spec.model.seq_len, spec.micro_batch_size(), spec.data.seed)
    ga = spec.grad_accum(world)
    answered: set[str] = set()
    first = True
    while step < spec.train.steps:
        batches = sampler.micro_batches(step, rank, world, ga)
        for i, (x, y) in enumerate(batches):
            sync = cl.nullcontext() if i == ga - 1 else model.no_sync()
            with sync:
                (md.loss(model(x), y) / ga).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.train.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if first and rank == 0:  # once per worker group: each start runs this function
            _append(events, {"kind": "first_step", "t": time.time(), "step": step, "world": world})
            first = False
        if config.get("stop_file") and Path(config["stop_file"]).exists():
            return  # the caller ends the run (benchmarks/autoscale.py)
        info = ray.train.get_preemption_info()
        doomed = set(info.preempted_node_ids) - answered if info is not None else set()
        answered |= doomed
        if doomed or step % spec.checkpoint.interval_steps == 0 or step == spec.train.steps:
            with tempfile.TemporaryDirectory() as d:
                checkpoint = None
                if rank == 0:
                    torch.save(
                        {
                            "model": model.module.state_dict(),
                            "opt": opt.state_dict(),
                            "sched": sched.state_dict(),
                            "step": step,
                        },
                        Path(d) / "state.pt",
                    )
                    checkpoint = ray.train.Checkpoint.from_directory(d)
                ray.train.report({"step": step}, checkpoint=checkpoint)
            if doomed and rank == 0:
                _append(events, {"kind": "jit", "t": time.time(), "step": step})


def _append(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def run_raytrain(
    trace: dict[str, Any], preempt: bool, steps: int, mode: str, tmp: Path
) -> dict[str, Any]:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from spotline.config import load_spec

    n = trace["spot_nodes"]
    raw = _workload(mode, steps)
    raw["elastic"] = {"min_replicas": 1, "max_replicas": n}
    spec = load_spec(raw)
    events = tmp / mode / "events.jsonl"
    events.parent.mkdir(parents=True, exist_ok=True)
    cluster = SpotCluster(trace)
    try:
        trainer = TorchTrainer(
            _raytrain_loop,
            train_loop_config={"spec": spec.model_dump_json(), "events": str(events)},
            torch_config=TorchConfig(backend="gloo"),
            scaling_config=ScalingConfig(
                num_workers=(1, n),
                use_gpu=False,
                resources_per_worker={"CPU": spec.resources.cpus_per_worker, "spot_gpu": 1},
            ),
            run_config=RunConfig(
                name=f"goodput-{mode}",
                storage_path=str(tmp / mode / "storage"),
                failure_config=FailureConfig(max_failures=-1),
                checkpoint_config=CheckpointConfig(num_to_keep=3),
            ),
        )
        controller_errors: list[str] = []

        def fit_until_done():
            # A run whose controller gives up (e.g. on an abrupt node loss) is fit again
            # with the same name and storage, which resumes from its latest checkpoint:
            # what a user's retry loop does. The time it takes counts.
            from ray.train import ControllerError

            for _ in range(5):
                try:
                    return trainer.fit()
                except ControllerError as e:
                    controller_errors.append(str(e).strip().splitlines()[-1][:300])
                    print(f"[spot_goodput]   ray train controller error, fit again: {e}")
            raise RuntimeError(f"Ray Train failed 5 times: {controller_errors}")

        t0 = time.time()
        replay = TraceReplay(cluster, trace["events"] if preempt else [], t0)
        result = replay.run_job(fit_until_done)
        wall = time.time() - t0
    finally:
        cluster.close()
    marks = [json.loads(line) for line in events.read_text().splitlines()]
    done = int(result.metrics["step"]) if result.metrics else 0
    first_steps = [m["t"] for m in marks if m["kind"] == "first_step"]
    return {
        "system": mode,
        "steps": done,
        "wall_s": wall,
        "steps_per_min": done / wall * 60,
        "notice_to_commit_s": _latencies(
            [m["t"] for m in marks if m["kind"] == "jit"], replay.times("notice")
        ),
        "recovery_s": _latencies(first_steps, replay.times("loss")),
        "restarts": len(first_steps) - 1,
        "replica_history": [],
        "controller_errors": controller_errors,
    }


# --- main -----------------------------------------------------------------------------------


def _mean(xs: list[float]) -> float | None:
    return statistics.mean(xs) if xs else None


def _fmt(x: float | None, unit: str = "s") -> str:
    return "n/a" if x is None else f"{x:.1f}{unit}"


def ratio(rows: dict[str, dict[str, Any]], arm: str, base: str) -> float | None:
    """rows[arm]'s committed steps per minute over rows[base]'s; None without both."""
    if arm in rows and base in rows and rows[base]["steps_per_min"] > 0:
        return rows[arm]["steps_per_min"] / rows[base]["steps_per_min"]
    return None


def summarize(rows: dict[str, dict[str, Any]], trace: str, steps: int) -> dict[str, Any]:
    """The figures --json writes: the ratios, the latencies per arm, and every run."""
    return {
        "spotline_vs_nopreempt": ratio(rows, "spotline", "nopreempt"),
        "peer_vs_nopreempt": ratio(rows, "peer", "nopreempt"),
        "inplace_vs_nopreempt": ratio(rows, "inplace", "nopreempt"),
        "steps_lost_per_loss": {k: _mean(r.get("steps_lost", [])) for k, r in rows.items()},
        "storage_bytes_per_restore": {
            k: _mean(r.get("storage_bytes", [])) for k, r in rows.items()
        },
        "periodic_vs_nopreempt": ratio(rows, "periodic", "nopreempt"),
        "raytrain_vs_nopreempt": ratio(rows, "raytrain", "raytrain-nopreempt"),
        # Without preemption, Spotline against Ray Train: the same workload, same run.
        "nopreempt_vs_raytrain": ratio(rows, "nopreempt", "raytrain-nopreempt"),
        "notice_to_commit_s": {k: _mean(r["notice_to_commit_s"]) for k, r in rows.items()},
        "recovery_s": {k: _mean(r["recovery_s"]) for k, r in rows.items()},
        "runs": rows,
        "trace": trace,
        "steps": steps,
    }


def render(figures: dict[str, Any], trace_name: str) -> str:
    rows = figures["runs"]

    def r3(x: float | None) -> str:
        return "" if x is None else f"{x:.3f}"

    lines = [
        f"trace {trace_name}, {figures['steps']} steps per arm",
        f"{'system':<20}{'steps/min':>10}{'vs no-preempt':>15}"
        f"{'notice->commit':>16}{'loss->resume':>14}{'steps lost':>12}{'storage MB':>12}",
    ]
    for name, r in rows.items():
        base = "raytrain-nopreempt" if name.startswith("raytrain") else "nopreempt"
        rat = ratio(rows, name, base)
        lost = _mean(r.get("steps_lost", []))
        read = _mean(r.get("storage_bytes", []))
        lines.append(
            f"{name:<20}{r['steps_per_min']:>10.0f}{r3(rat):>15}"
            f"{_fmt(_mean(r['notice_to_commit_s'])):>16}{_fmt(_mean(r['recovery_s'])):>14}"
            f"{_fmt(lost, ''):>12}{_fmt(None if read is None else read / 1e6, ''):>12}"
        )
        peer = r.get("peer_memory")
        if peer:
            lines.append(
                f"{'':<20}peer copies every {peer['every_steps']} step(s) ({peer['chosen']}), "
                f"{_fmt(peer['cost_s'] and peer['cost_s'] * 1e3, ' ms')} each, "
                f"{r3(peer['share_of_training'])} of training; restores "
                f"{', '.join(r['restored_via'])}; ranks kept in place per restart "
                f"{r.get('kept')}"
            )
    nvr = figures["nopreempt_vs_raytrain"]
    lines.append(
        "no-preemption, spotline / ray train (steps/min): "
        + ("n/a (needs both nopreempt and raytrain-nopreempt)" if nvr is None else f"{nvr:.3f}")
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--steps", type=int, default=2400, help="steps every arm trains")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument(
        "--only", nargs="*", help="run only these arms (for debugging; ratios need both runs)"
    )
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    trace = yaml.safe_load(args.trace.read_text())
    arms = [
        ("nopreempt", run_spotline, False),
        ("spotline", run_spotline, True),
        ("peer", run_spotline, True),
        ("inplace", run_spotline, True),
        ("periodic", run_spotline, True),
        ("raytrain-nopreempt", run_raytrain, False),
        ("raytrain", run_raytrain, True),
    ]
    arms = [a for a in arms if not args.only or a[0] in args.only]
    if any(fn is run_raytrain for _, fn, _ in arms):
        try:
            import ray.train.torch  # noqa: F401
        except ImportError as e:
            print(
                f"spot_goodput.py: the Ray Train arms need ray[train] ({e}); "
                'pip install -e ".[bench]", or pick arms with --only',
                file=sys.stderr,
            )
            return 2
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="spotline-goodput-") as tmp:
        for name, fn, preempt in arms:
            print(f"[spot_goodput] running {name} ({args.steps} steps) ...", flush=True)
            rows[name] = fn(trace, preempt, args.steps, name, Path(tmp))
            r = rows[name]
            print(
                f"[spot_goodput]   {name}: {r['steps']} steps in {r['wall_s']:.0f}s, "
                f"{r['steps_per_min']:.0f} steps/min, restarts {r['restarts']}",
                flush=True,
            )

    figures = summarize(rows, str(args.trace), args.steps)
    print()
    print(render(figures, args.trace.name))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, default=str))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
