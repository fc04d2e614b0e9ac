"""The controller, the commit and recovery at 8 to 8,192 ranks, on simulated ranks.

The real code runs at full size against `scale_sim.SimGroup`, whose ranks publish every
report a real rank does, every poll (pp=8 x dp=N/8, eight ranks a node, a Llama 3.1
8B-shaped ZeRO-1 state index): the controller's loop and policies, its snapshot and
status, telemetry and the ledger, the hang and straggler books, cordons, the demand
bundles, the commit coordinator with signed receipts and manifests, retention, the
restore and reshard plans N -> N/2, and the peer-memory offer. Storage is file:// for
the loop, and both file:// and S3 (moto's server on 127.0.0.1) for the commit and
restore paths. Each size runs in a fresh process (its RSS is its own).

Per size: the controller's CPU per poll and per loop step (the simulated ranks' own
work subtracted), status() latency (the snapshot projected and pickled, as the
controller's actor returns it), last receipt -> committed manifest and the whole
commit with its files' check, sweep and retention, a commit from storage (a restarted controller
reading every receipt), the manifest's bytes, a restore's and a reshard's plan (the
controller's part: list, read and verify the manifest; and one rank's: parse it and
plan its reads), the peer-memory offer from every keeper's holdings, and the RSS.
Each figure's growth exponent is fitted over the sizes (numpy.polyfit on log-log),
and over the three largest. A figure with a goal at 4,096 ranks is printed with the goal
and, when 4,096 was run, whether its figure there met it.

`--ray` also measures the Ray part on as many stand-in worker actors as fit here
(the real group's poll, a request round, placement of one bundle per rank, the demand
request) and extrapolates each to 4,096 ranks from its fitted exponent.

    python benchmarks/scale.py --json /tmp/scale.json --png /tmp/scale.png --ray
    python benchmarks/scale.py --sizes 8,64 --no-s3          # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SIZES = (8, 64, 512, 4096, 8192)
QUICK = 512
"""Sizes up to this one are repeated (`--repeats`) and their spread given."""
GOALS = {  # at 4,096 ranks
    "poll_cpu_ms": 100.0,
    "status_ms": 200.0,
    "commit_s": 2.0,
    "commit_from_storage_s": 10.0,
    "restore_plan_s": 1.0,
    "manifest_bytes": 16e6,
    "controller_rss_mb": 2048.0,
}
STEADY_STEPS = 24
"""Loop steps measured in the steady state (six simulated seconds of training)."""


# --- one size, in its own process ---------------------------------------------------------


def _cpu_loop(ctl, group, steps: int) -> tuple[list[float], list[float]]:
    """Controller CPU (ms) of each of `steps` loop steps, and of each poll in them."""
    import time as t

    polls: list[float] = []
    real_poll = ctl.intake.poll

    def poll():
        c0, s0 = t.thread_time(), group.sim_cpu_s
        try:
            return real_poll()
        finally:
            polls.append((t.thread_time() - c0 - (group.sim_cpu_s - s0)) * 1e3)

    ctl.intake.poll = poll
    loop = []
    for _ in range(steps):
        c0, s0 = t.thread_time(), group.sim_cpu_s
        ctl.step()
        loop.append((t.thread_time() - c0 - (group.sim_cpu_s - s0)) * 1e3)
    ctl.intake.poll = real_poll
    return loop, polls


def measure_loop(world: int, work: Path) -> dict[str, Any]:
    """The controller's loop over `world` simulated ranks, on file://."""
    import psutil

    from scale_sim import (
        PP,
        SimClock,
        SimCluster,
        SimDemand,
        SimGroup,
        node_names,
        sim_spec,
        stage_params,
    )
    from spotline.checkpoint import CheckpointStore
    from spotline.controller import Controller
    from spotline.controller.clock import Clock
    from spotline.controller.state import Running

    spec = sim_spec(world, f"file://{work}/loop")
    stages = stage_params(spec)
    store = CheckpointStore(
        spec.resolved_checkpoint_uri(), signing_key_env=spec.checkpoint.signing_key_env
    )
    replicas = world // PP
    nodes = node_names(replicas)
    clock = SimClock()
    groups: list[SimGroup] = []

    def factory(n: int) -> SimGroup:
        groups.append(SimGroup(spec, n, store, clock, stages, nodes))
        return groups[-1]

    ctl = Controller(spec, store, factory, SimCluster(nodes),
                     clock=Clock(clock, clock.wall, clock.sleep), demand=SimDemand(spec, clock))  # fmt: skip
    for _ in range(10):
        if isinstance(ctl.state, Running):
            break
        ctl.step()
    assert isinstance(ctl.state, Running), ctl.state
    ctl.plan_view._ready.wait(120)  # its thread would share the loop's CPU
    group = groups[-1]
    # Warm: the straggler watch judges once every rank's window of steps is full.
    from scale_sim import STEP_S
    from spotline import constants

    warm = (spec.failure.straggler_window_steps + 3) * STEP_S / constants.SPOTLINE_POLL_INTERVAL_S
    _cpu_loop(ctl, group, int(warm))
    loop, polls = _cpu_loop(ctl, group, STEADY_STEPS)
    status = []
    for _ in range(5):
        t0 = time.perf_counter()
        pickle.dumps(ctl.door.status())
        status.append((time.perf_counter() - t0) * 1e3)
    # A checkpoint in the loop (file://): from the poll with the last upload to the commit.
    group.ranks.save_at = group.ranks.step + 1
    commits = []
    real = ctl.coordinator.receive

    def receive(results):
        t0 = time.perf_counter()
        out = real(results)
        if out:
            commits.append(time.perf_counter() - t0)
        return out

    ctl.coordinator.receive = receive
    for _ in range(16):
        ctl.step()
        if commits:
            break
    rss = psutil.Process().memory_info().rss / 2**20
    return {
        "poll_cpu_ms": statistics.median(polls),
        "loop_step_cpu_ms": statistics.median(loop),
        "status_ms": statistics.median(status),
        "loop_commit_file_s": commits[0] if commits else None,
        "controller_rss_mb": rss,
        "demand_bundles": ctl.demand.sent[-1] if ctl.demand.sent else None,
    }


class _Restoring:
    """A group of `replicas` replicas as the commit coordinator restores into it."""

    def __init__(self, stages, replicas: int, store):
        self.stages, self.replicas, self.attempt, self.store = stages, replicas, "restoring", store
        self.planned: dict | None = None

    def restore(self, manifest, source=None) -> int:
        from scale_sim import plan_rank

        text = manifest.to_json()  # what is sent (once) to the ranks
        self.planned = plan_rank(text, self.stages, self.replicas, 0, self.store)
        return manifest.step


def measure_storage(world: int, uri: str, endpoint: str | None, tag: str) -> dict[str, Any]:
    """Commit, commit from storage, manifest, restore and reshard plans at `uri`."""
    from scale_sim import PP, sim_spec, stage_params, write_step
    from spotline.checkpoint import CheckpointStore
    from spotline.checkpoint.coordinator import CommitCoordinator

    spec = sim_spec(world, uri, endpoint)
    stages = stage_params(spec)
    replicas = world // PP

    def store() -> CheckpointStore:  # a fresh one: a restarted controller's
        return CheckpointStore(spec.resolved_checkpoint_uri(), endpoint,
                               signing_key_env=spec.checkpoint.signing_key_env)  # fmt: skip

    events: list[str] = []
    coord = CommitCoordinator(spec, store(), lambda text, *a, **k: events.append(text))
    st = coord.store
    manifest_at: list[float] = []
    real_commit = st.commit

    def commit(manifest, check=True):
        real_commit(manifest, check)
        manifest_at.append(time.perf_counter())

    st.commit = commit
    out: dict[str, Any] = {}
    for step in (100, 200, 300):  # keep_last=2: the third commit deletes the first step
        results = write_step(spec, st, stages, replicas, step, "g0")
        coord.expect(step, "g0", world)
        manifest_at.clear()
        t0 = time.perf_counter()
        done = coord.receive(results)
        coord.retain()  # as the controller's loop does next: the files' check, keep_last
        t1 = time.perf_counter()
        assert done and manifest_at, events[-3:]
        out[f"commit_{tag}_s"] = manifest_at[0] - t0
        out[f"commit_total_{tag}_s"] = t1 - t0
    out[f"manifest_bytes_{tag}"] = st.fs.info(st.manifest_path(300))["size"]
    # A restarted controller finds step 400's receipts and nothing else.
    write_step(spec, st, stages, replicas, 400, "g1")
    fresh = CommitCoordinator(spec, store(), lambda text, *a, **k: events.append(text))
    t0 = time.perf_counter()
    done = fresh.commit_from_storage()
    out[f"commit_from_storage_{tag}_s"] = time.perf_counter() - t0
    assert [d.step for d in done] == [400], events[-3:]
    # After a failure the live controller restores (its listing of the steps known);
    # a resubmitted job's new controller lists and verifies every kept manifest first.
    for name, coord in (("restore", fresh), ("reshard", fresh), ("restore_cold", None)):
        coord = coord or CommitCoordinator(spec, store(), lambda text, *a, **k: events.append(text))
        shape = (
            _reshard(spec, replicas, coord.store)
            if name == "reshard"
            else _Restoring(stages, replicas, coord.store)
        )
        t0 = time.perf_counter()
        step, _ = coord.restore(shape, lambda s: None)
        out[f"{name}_plan_{tag}_s"] = time.perf_counter() - t0
        assert step == 400 and shape.planned, events[-3:]
    return out


def _reshard(spec, replicas: int, store) -> _Restoring:
    """N -> N/2: half the replicas (a one-replica job: half the stages)."""
    from scale_sim import PP, stage_params

    if replicas >= 2:
        return _Restoring(stage_params(spec), replicas // 2, store)
    half = spec.parallel.model_copy(update={"pipeline_stages": PP // 2})
    return _Restoring(stage_params(spec.model_copy(update={"parallel": half})), 1, store)


def measure_peer(world: int) -> dict[str, Any]:
    """The peer-memory offer: every keeper's holdings (own and buddy copies) in, the
    newest complete step's manifest out."""
    from scale_sim import PP, keeper_holdings, node_names, sim_spec, stage_params
    from spotline.controller.recovery import PeerRecovery
    from spotline.controller.snapshot import Attempt
    from spotline.runtime.peers import PeerMemory

    spec = sim_spec(world, "file:///unused", **{"recovery.peer_snapshots": True})
    replicas = world // PP
    held = keeper_holdings(spec, stage_params(spec), replicas, "g0", 500)

    class Keepers(PeerMemory):
        def _ask(self, method, args):  # the keepers' answers (the Ray part is apart)
            assert method == "holdings"
            return {n: [dict(c) for c in held[n]] for n in args}

    peers = Keepers(spec)
    peers._keepers = dict.fromkeys(node_names(replicas))
    rec = PeerRecovery(spec, peers, lambda *a, **k: None)
    t0 = time.perf_counter()
    offer = rec.offer([Attempt(replicas=replicas, attempt="g0")], {}, 0)
    took = time.perf_counter() - t0
    assert offer is not None and offer.step == 500
    return {"peer_offer_s": took}


def one_size(world: int, endpoint: str | None, s3_bucket: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"ranks": world}
    with tempfile.TemporaryDirectory(prefix=f"spotline-scale-{world}-") as tmp:
        work = Path(tmp)
        out.update(measure_loop(world, work))
        out.update(measure_storage(world, f"file://{work}/paths", None, "file"))
        if endpoint and s3_bucket:
            bucket = f"{s3_bucket}-{world}-{os.getpid()}"
            with _own_bucket(endpoint, bucket):
                out.update(measure_storage(world, f"s3://{bucket}/job", endpoint, "s3"))
        out.update(measure_peer(world))
    return out


# --- the sizes, the fit, the table --------------------------------------------------------


@contextlib.contextmanager
def _own_bucket(endpoint: str, bucket: str) -> Iterator[None]:
    """A bucket for one size's run, emptied and deleted after it. moto answers each
    listing by walking every key of the bucket, where S3 reads the prefix's keys only:
    in one bucket, each size's listings would also pay for every earlier size's keys."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket=bucket)
    try:
        yield
    finally:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                s3.delete_objects(Bucket=bucket, Delete={"Objects": keys})
        s3.delete_bucket(Bucket=bucket)


def run_sizes(sizes: list[int], repeats: int, endpoint: str | None, bucket: str | None) -> dict[int, list[dict]]:  # fmt: skip
    runs: dict[int, list[dict]] = {}
    for world in sizes:
        for _ in range(repeats if world <= QUICK else 1):
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, __file__, "--one", str(world), "--out", f.name]
                if endpoint:
                    cmd += ["--endpoint", endpoint, "--bucket", bucket]
                t0 = time.perf_counter()
                subprocess.run(cmd, check=True)
                got = json.loads(Path(f.name).read_text())
            print(f"  {world} ranks: {time.perf_counter() - t0:.0f}s", file=sys.stderr)
            runs.setdefault(world, []).append(got)
    return runs


def exponent(sizes: list[int], values: list[float]) -> float | None:
    """The growth exponent of `values` over `sizes` (slope of the log-log fit)."""
    import numpy as np

    pts = [(s, v) for s, v in zip(sizes, values, strict=True) if v is not None and v > 0]
    if len(pts) < 2:
        return None
    x, y = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    return float(np.polyfit(x, y, 1)[0])


def figures(runs: dict[int, list[dict]]) -> tuple[list[int], dict[str, dict]]:
    sizes = sorted(runs)
    names = [k for k in runs[sizes[0]][0] if k not in ("ranks", "demand_bundles")]
    out = {}
    for name in names:
        per = [[r[name] for r in runs[s] if r.get(name) is not None] for s in sizes]
        values = [statistics.median(v) if v else None for v in per]
        out[name] = {
            "values": values,
            "spread": [[min(v), max(v)] if len(v) > 1 else None for v in per],
            "exponent": exponent(sizes, values),
            "exponent_top": exponent(sizes[-3:], values[-3:]) if len(sizes) >= 3 else None,
        }
    # The figures the issue names, from the S3 run when there is one.
    for name, s3, local in (("commit_s", "commit_s3_s", "commit_file_s"),
                            ("commit_from_storage_s", "commit_from_storage_s3_s", "commit_from_storage_file_s"),
                            ("restore_plan_s", "restore_plan_s3_s", "restore_plan_file_s"),
                            ("reshard_plan_s", "reshard_plan_s3_s", "reshard_plan_file_s"),
                            ("manifest_bytes", "manifest_bytes_s3", "manifest_bytes_file")):  # fmt: skip
        src = s3 if s3 in out else local
        if src in out:
            out[name] = dict(out[src], source=src)
    return sizes, out


def table(sizes: list[int], figs: dict[str, dict]) -> str:
    head = (
        "| figure | "
        + " | ".join(str(s) for s in sizes)
        + " | exponent (all / top 3) | goal at 4096 |"
    )
    lines = [head, "|" + "---|" * (len(sizes) + 3)]
    for name, f in figs.items():
        cells = []
        for v, sp in zip(f["values"], f["spread"], strict=True):
            cell = "-" if v is None else _fmt(v)
            if sp:
                cell += f" [{_fmt(sp[0])}-{_fmt(sp[1])}]"
            cells.append(cell)
        e, top = f["exponent"], f["exponent_top"]
        exp = f"{e:.2f} / {top:.2f}" if e is not None and top is not None else "-"
        goal = f"< {_fmt(GOALS[name])}{_verdict(name, sizes, f['values'])}" if name in GOALS else ""
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {exp} | {goal} |")
    return "\n".join(lines)


def _verdict(name: str, sizes: list[int], values: list[float | None]) -> str:
    """': met' or ': NOT met' for the figure at 4,096 ranks against its goal; '' when
    4,096 was not run."""
    at = values[sizes.index(4096)] if 4096 in sizes else None
    if at is None:
        return ""
    return ": met" if at < GOALS[name] else ": NOT met"


def _fmt(v: float) -> str:
    if v >= 1e6:
        return f"{v / 1e6:.2f}M"
    if v >= 100:
        return f"{v:.0f}"
    if v >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def draw(sizes: list[int], figs: dict[str, dict], path: str, ray: dict | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 7))
    for name, f in figs.items():
        if "source" in f:
            continue  # drawn under its own name
        pts = [(s, v) for s, v in zip(sizes, f["values"], strict=True) if v]
        if pts:
            e = f["exponent"]
            ax.plot(
                *zip(*pts, strict=True),
                marker="o",
                label=f"{name} (k={e:.2f})" if e is not None else name,
            )
    for name, f in (ray or {}).get("figures", {}).items():
        pts = list(zip(ray["sizes"], f["values"], strict=True))
        line = ax.plot(
            *zip(*pts, strict=True),
            marker="s",
            linestyle="--",
            label=f"ray {name} (k={f['exponent']:.2f})",
        )
        ax.plot([ray["sizes"][-1], 4096], [f["values"][-1], f["at_4096"]], linestyle=":",
                color=line[0].get_color())  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks (pp=8 x dp=N/8)")
    ax.set_ylabel("value (units in the figure's name)")
    ax.set_title("Spotline at scale: each figure against the ranks (dotted: extrapolated)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--repeats", type=int, default=3, help=f"runs of each size up to {QUICK}")
    p.add_argument("--no-s3", action="store_true", help="file:// only (no moto server)")
    p.add_argument("--ray", action="store_true", help="also the Ray part on stand-in actors")
    p.add_argument("--ray-sizes", default="8,32,64")
    p.add_argument("--json")
    p.add_argument("--png")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.add_argument("--bucket", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        Path(args.out).write_text(json.dumps(one_size(args.one, args.endpoint, args.bucket)))
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    moto = endpoint = bucket = None
    work = Path(tempfile.mkdtemp(prefix="spotline-scale-"))
    try:
        if not args.no_s3:
            from checkpoint import isolate_aws_env, start_moto

            isolate_aws_env(work)
            moto, endpoint = start_moto(work)
            bucket = "spotline-scale"  # each size's run makes its own, named from this
        runs = run_sizes(sizes, args.repeats, endpoint, bucket)
    finally:
        if moto is not None:
            from checkpoint import stop_moto

            stop_moto(moto)
    sizes, figs = figures(runs)
    ray = None
    if args.ray:
        from scale_ray import measure_ray

        ray = measure_ray([int(s) for s in args.ray_sizes.split(",")])
    print(table(sizes, figs))
    if ray:
        print()
        print(ray_table(ray))
    print(f"\nload: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} cores")
    if args.png:
        draw(sizes, figs, args.png, ray)
        print(f"plot: {args.png}")
    if args.json:
        doc = {"sizes": sizes, "figures": figs, "runs": {str(k): v for k, v in runs.items()},
               "ray": ray, "load_1min": os.getloadavg()[0], "cores": os.cpu_count()}  # fmt: skip
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


def ray_table(ray: dict) -> str:
    sizes = ray["sizes"]
    lines = ["| Ray part | " + " | ".join(str(s) for s in sizes) + " | exponent | at 4096 (extrapolated) |",
             "|" + "---|" * (len(sizes) + 3)]  # fmt: skip
    for name, f in ray["figures"].items():
        cells = " | ".join(_fmt(v) for v in f["values"])
        lines.append(
            f"| {name} | {cells} | {f['exponent']:.2f} | {_fmt(f['at_4096'])} (extrapolated) |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
