"""The Ray part of `scale.py`: the real worker group's calls on lightweight stand-in
worker actors, at the sizes this machine holds, extrapolated to 4,096 ranks.

Each stand-in answers the calls a `TrainWorker` does (`run`, `progress` with its
heartbeat and the report `scale_sim.rank_report` builds, `request`), with no DeepSpeed
and no CPU of its own (num_cpus=0). Per size it measures, on a fresh local Ray cluster
bound to 127.0.0.1:

- `poll_cpu_ms`: the driver's CPU (Ray's threads in it included) per `RayWorkerGroup.poll`;
- `poll_round_ms`: one `progress` call to every rank and every report taken in
  (`progress.collect`), as the poll makes them;
- `request_round_ms`: a `request` to every rank, answered (`_call_all`);
- `placement_s`: one placement group per replica of eight one-per-rank bundles, all
  placed (`ready()`), as the starter asks for them;
- `demand_ms`: the autoscaler demand of one bundle per rank sent to Ray's autoscaling
  coordinator (`RayDemand`'s sender).

Each figure's exponent is fitted over the sizes and extrapolated to 4,096 ranks.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

RANKS_PER_REPLICA = 8


class StandIn:
    """A rank that answers the real calls and trains nothing."""

    def __init__(self, rank: int, replicas: int):
        self.rank, self.replicas = rank, replicas
        self.stop = threading.Event()
        self.step = 0
        self.asked: list[tuple] = []

    def run(self, target: int, peer_every: int = 0) -> dict[str, Any]:
        self.stop.wait()
        return {"stopped_at": self.step, "reason": "stop"}

    def progress(self) -> dict[str, Any]:
        from scale_sim import rank_report

        self.step += 1
        steps = [(self.step, 1.0, 1.0, time.time())]
        return rank_report(self.rank, self.replicas, 16, steps, [], [], self.step)

    def request(self, save_at: int, stop_at: int, reason: str, peer_every: int = 0) -> None:
        self.asked.append((save_at, stop_at, reason, peer_every))

    def end(self) -> None:
        self.stop.set()


def _one(ranks: int) -> dict[str, float]:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from scale_sim import node_names, sim_spec
    from spotline.checkpoint import CheckpointStore
    from spotline.runtime.demand import RayDemand
    from spotline.runtime.group import RayWorkerGroup
    from spotline.runtime.progress import collect

    replicas = max(1, ranks // RANKS_PER_REPLICA)
    spec = sim_spec(ranks, "file:///tmp/spotline-scale-ray-unused")
    actor = ray.remote(num_cpus=0, max_concurrency=4)(StandIn)
    actors = [actor.remote(r, replicas) for r in range(ranks)]
    ray.get([a.request.remote(0, 0, "warm") for a in actors])  # every process is up
    group = RayWorkerGroup(spec, replicas, CheckpointStore("file:///tmp/unused"), "cpu")
    nodes = node_names(replicas)
    group.actors = actors
    group._info = [{"rank": r, "node_id": nodes[r % replicas]} for r in range(ranks)]
    group.run(10**9)
    out: dict[str, list[float]] = {k: [] for k in ("poll_cpu_ms", "poll_round_ms",
                                                   "request_round_ms")}  # fmt: skip
    for _ in range(3):
        group.poll(0.25)  # warm
    for _ in range(10):
        c0 = time.process_time()
        group.poll(0.25)
        out["poll_cpu_ms"].append((time.process_time() - c0) * 1e3)
        t0 = time.perf_counter()
        collect([a.progress.remote() for a in actors])
        out["poll_round_ms"].append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        group._call_all("request", "request", 0, 0, "scale", 0)
        out["request_round_ms"].append((time.perf_counter() - t0) * 1e3)
    figures = {k: statistics.median(v) for k, v in out.items()}
    places = []
    for _ in range(3):
        t0 = time.perf_counter()
        pgs = [placement_group([{"CPU": 0.001}] * RANKS_PER_REPLICA, strategy="PACK")
               for _ in range(replicas)]  # fmt: skip
        ray.get([pg.ready() for pg in pgs], timeout=120)
        places.append(time.perf_counter() - t0)
        for pg in pgs:
            remove_placement_group(pg)
    figures["placement_s"] = statistics.median(places)
    demand = RayDemand(spec, "gpu")
    send = demand._sender()
    bundles = [{"CPU": 4.0, "GPU": 1.0}] * ranks
    send(bundles)  # warm: the coordinator actor starts
    sends = []
    for _ in range(5):
        t0 = time.perf_counter()
        send(bundles)
        sends.append((time.perf_counter() - t0) * 1e3)
    figures["demand_ms"] = statistics.median(sends)
    demand.withdraw()
    for a in actors:
        a.end.remote()
    group.shutdown()
    return figures


def measure_ray(sizes: list[int], target: int = 4096) -> dict[str, Any]:
    import ray

    from scale import exponent
    from spotline.runtime.cluster import bind_to_loopback

    bind_to_loopback()
    runs = []
    for ranks in sizes:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            runs.append(_one(ranks))
        finally:
            ray.shutdown()
    figures = {}
    for name in runs[0]:
        values = [r[name] for r in runs]
        k = exponent(sizes, values)
        figures[name] = {
            "values": values,
            "exponent": k,
            "at_4096": values[-1] * (target / sizes[-1]) ** (k or 0.0),
            "extrapolated": True,
        }
    return {"sizes": sizes, "figures": figures}
