"""Simulated ranks for `scale.py`: a worker group of thousands of ranks in one process.

`SimGroup` is the real `RayWorkerGroup` with its Ray calls replaced: every poll, each
simulated rank publishes the report a `TrainWorker.progress()` returns (its heartbeat,
compute, bubble figures, steps, saves, finished uploads), and the group folds them with
the real group's own code (`_fold`, `_beats`), so the controller sees what a real
group of that size hands it. A save writes each rank's files and signed receipt into
the real store (file:// or S3), as the ranks' uploads do, and reports every rank's
`UploadResult` a poll later with an index shaped like ZeRO-1's: each rank's slice of
its stage's flat fp32 buffer, its Adam moments, and on replica 0 the stage's 16-bit
weights, with chunk hashes.

What the ranks do themselves (building their reports, writing their files) is charged
to `SimGroup.sim_cpu_s`, which the harness subtracts from the controller's CPU.
The Ray part (deserialising the reports, the calls themselves) is measured apart, on
real actors (`scale.py --ray`). Only the standard library and Spotline are imported.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from spotline.checkpoint.layout import (
    CHUNK_BYTES,
    FORMAT,
    FP32,
    META_FILE,
    MOMENTS,
    STATE_FILE,
    WEIGHT,
)
from spotline.checkpoint.manifest import FileEntry, Receipt
from spotline.checkpoint.peer import PeerCopy, rank_prefix
from spotline.checkpoint.transfer import UploadResult, job_identity
from spotline.checkpoint.uploads import NODE_FORMAT, NODE_PREFIX
from spotline.config import load_spec
from spotline.heap import collection_held
from spotline.runtime.cluster import CordonList
from spotline.runtime.demand import RayDemand, demand_bundles
from spotline.runtime.group import RayWorkerGroup

PP = 8
"""Pipeline stages of every simulated shape (dp = ranks / PP)."""
RANKS_PER_NODE = 8
"""Ranks on one node: one replica's eight stages."""
STEP_S = 1.0
"""Simulated seconds per training step (a poll every SPOTLINE_POLL_INTERVAL_S)."""
WRITE_THREADS = 32
"""Threads the harness writes the simulated ranks' files and receipts with."""
SIGNING_ENV = "SPOTLINE_SCALE_SIGNING_KEY"


def sim_spec(world: int, uri: str, endpoint: str | None = None, **over: Any):
    """The job of `world` simulated ranks: Llama 3.1 8B-shaped, pp=8 x dp=world/8,
    ZeRO-1, bf16, signed manifests and receipts."""
    replicas = world // PP
    os.environ.setdefault(SIGNING_ENV, "scale-benchmark-signing-key-0123456789")
    raw = {
        "name": f"scale-{world}",
        "model": {"kind": "llama", "preset": "llama-8b", "vocab_size": 128256, "seq_len": 4096},
        "parallel": {"pipeline_stages": PP, "micro_batches": 16, "zero_stage": 1,
                     "precision": "bf16"},
        "elastic": {"min_replicas": max(1, replicas // 2), "max_replicas": replicas},
        "train": {"steps": 1_000_000, "global_batch_size": 16 * replicas, "log_every": 10},
        "checkpoint": {"uri": uri, "interval_steps": 10_000, "keep_last": 2,
                       "signing_key_env": SIGNING_ENV,
                       **({"endpoint_url": endpoint} if endpoint else {})},
        "failure": {"max_failures": 3},
        "recovery": {"peer_snapshots": False},
        "resources": {"device": "gpu", "cpus_per_worker": 4, "device_memory_gb": 141},
    }  # fmt: skip
    return load_spec(raw, over)


# --- the state each rank saves ----------------------------------------------------------


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def stage_params(spec) -> list[list[Param]]:
    """Each stage's parameters (stable names, shapes), built on the meta device."""
    import torch

    from spotline.models import model_def
    from spotline.planning.partition import stage_bounds

    model = model_def(spec)
    bounds = stage_bounds(model, spec.parallel.pipeline_stages)
    with torch.device("meta"):
        layers = [
            [Param(f"{i}.{n}", tuple(p.shape)) for n, p in ld.build().named_parameters()]
            for i, ld in enumerate(model.layers)
        ]
    return [
        [p for layer in layers[a:b] for p in layer]
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _entry(p: Param, kind: str, start: int, numel: int, dtype: str, rank: int, file: str) -> dict:
    nbytes = numel * (2 if dtype == "bfloat16" else 4)
    key = f"{p.name}/{kind}/{start}"
    chunks = max(1, -(-nbytes // CHUNK_BYTES))
    return {
        "key": key, "param": p.name, "kind": kind, "start": start, "numel": numel,
        "shape": list(p.shape), "dtype": dtype, "rank": rank, "file": file, "offset": 0,
        "nbytes": nbytes, "sha256": _hash(key), "chunk_bytes": CHUNK_BYTES,
        "chunk_sha256": [_hash(f"{key}#{i}") for i in range(chunks)],
    }  # fmt: skip


def owned_slices(params: list[Param], replicas: int, replica: int) -> list[tuple[Param, int, int]]:
    """(param, first, last) elements a ZeRO-1 rank owns: its equal slice of its stage's
    flat buffer (DeepSpeed's partition of one parameter group)."""
    total = sum(p.numel for p in params)
    part = -(-total // replicas)
    lo, hi = replica * part, min(total, (replica + 1) * part)
    out, at = [], 0
    for p in params:
        a, b = max(lo, at), min(hi, at + p.numel)
        if a < b:
            out.append((p, a - at, b - at))
        at += p.numel
    return out


def rank_index(stages: list[list[Param]], replicas: int, rank: int, prefix: str) -> list[dict]:
    """A rank's index entries as `train.state.snapshot` + `layout.write_rank` make them."""
    stage, replica = rank // replicas, rank % replicas
    file = f"{prefix}/{STATE_FILE}"
    out = [
        _entry(p, kind, lo, hi - lo, "float32", rank, file)
        for p, lo, hi in owned_slices(stages[stage], replicas, replica)
        for kind in (FP32, *MOMENTS)
    ]
    if replica == 0:  # the stage's bf16 weights, whole
        out += [_entry(p, WEIGHT, 0, p.numel, "bfloat16", rank, file) for p in stages[stage]]
    return out


def rank_meta(world: int, replicas: int, rank: int, step: int) -> dict:
    """What a rank's meta file says of the job (its `RankSnapshot.meta`, RNG left out)."""
    return {
        "format": "spotline.sharded/1", "adam_step": float(step), "optim_keys": list(MOMENTS),
        "lr_scheduler": {"last_epoch": step, "base_lrs": [3e-4]}, "global_steps": step,
        "global_samples": step * 16 * replicas, "batch_schedule": None, "partition": None,
        "topology": {"pipeline_stages": PP, "replicas": replicas, "zero_stage": 1, "rank": rank},
        "optimizer": "zero1",
    }  # fmt: skip


# --- the ranks ----------------------------------------------------------------------------


class SimRanks:
    """Every rank's training as the controller sees it: steps, heartbeats, compute,
    bubble figures, saves and finished uploads."""

    def __init__(self, spec, replicas: int, attempt: str, store, stages: list[list[Param]]):
        self.spec, self.replicas, self.attempt, self.store = spec, replicas, attempt, store
        self.world = PP * replicas
        self.stages = stages
        self.step = 0
        self.t0 = 0.0
        self.save_at = 0
        self.uploads: list[UploadResult] = []
        self.saves: list[tuple[int, float, int]] = []
        self.steps: list[tuple[int, float, float, float]] = []  # trained, not yet reported
        self.write_storage = True

    def train(self, now: float) -> None:
        """The ranks' own work until `now`, in their processes: steps, and a save (its
        files written to storage) when one is due."""
        while (self.step + 1) * STEP_S <= now - self.t0:
            self.step += 1
            wall = time.time()
            self.steps.append((self.step, 10.0 / (1 + self.step), STEP_S, wall))
            if 0 < self.save_at <= self.step:
                self.save(self.step)
                self.save_at = 0

    def publish(self, now: float) -> list[dict[str, Any]]:
        """Every rank's report since the last poll (`TrainWorker.progress()`'s dict)."""
        self.train(now)
        steps, self.steps = self.steps, []
        saves, self.saves = self.saves, []
        uploads, self.uploads = self.uploads, []
        by_rank: dict[int, list] = {}
        for u in uploads:
            by_rank.setdefault(u.rank, []).append(u)
        m = self.spec.parallel.micro_batches
        return [
            rank_report(rank, self.replicas, m, steps, saves, by_rank.get(rank, []), self.step)
            for rank in range(self.world)
        ]

    def save(self, step: int) -> None:
        """Every rank saves `step`: its files and receipt go to storage now, and its
        upload result comes with the next report."""
        self.saves.append((step, 0.05, 1 << 20))
        self.uploads = write_step(self.spec, self.store, self.stages, self.replicas, step,
                                  self.attempt, write=self.write_storage)  # fmt: skip


def rank_report(rank: int, replicas: int, m: int, steps: list, saves: list, uploads: list,
                at: int) -> dict[str, Any]:  # fmt: skip
    """One rank's report as `TrainWorker.progress()` returns it: the `steps` trained
    since the last one, its saves and finished uploads, its heartbeat at step `at` + 1,
    its compute and bubble figures (the timelines, on the ranks that send them)."""
    stage, replica = rank // replicas, rank % replicas
    bubbles = None
    if steps:
        n = len(steps)
        bubbles = {
            "steps": n, "step_s": n * STEP_S, "wait_s": 0.1 * n, "compute_s": 0.8 * n,
            "passes_s": 0.8 * n, "windows": 2 * n, "window_s": 0.05 * n, "dropped": 0,
            "bubble_fraction": 0.1, "stage": stage, "replica": replica, "rank": rank,
            "filled_s": 0.0, "overrun_s": 0.0, "open_s": 0.0, "beyond_s": 0.0,
        }  # fmt: skip
        if timeline_from(stage, replica):
            bubbles["steps_timeline"] = [
                {"step": s, "start_ns": int(w * 1e9),
                 "instrs": [("ForwardPass" if i % 2 else "BackwardPass", i % m, i * 1e-3,
                             i * 1e-3 + 5e-4) for i in range(2 * m + 4)]}
                for s, _, _, w in steps[-4:]
            ]  # fmt: skip
    return {
        "rank": rank, "steps": list(steps), "saves": list(saves), "notices": [],
        "memory": None, "peer": [], "skipped": [], "uploads": uploads, "peer_sent": [],
        "uploading": False, "bubbles": bubbles,
        "beat": {"step": at + 1, "phase": "forward micro-batch 3", "phase_s": 0.01},
        "compute": {"steps": len(steps), "compute_s": 0.8 * len(steps)},
        "lr": 3e-4,
        "batch": {"schedule": "constant", "global_batch_size": 16 * replicas,
                  "micro_batches": m, "noise_scale": None, "history": [[0, 16 * replicas]]},
        "data_stall_s": 0.0,
    }  # fmt: skip


def placeholder(rank: int, name: str, meta: dict) -> bytes:
    """The bytes the harness stores for a rank's file: its meta file as a rank writes
    it (RNG states and entries left out), a line for its state (whose real size is in
    the index)."""
    if name == META_FILE:
        return json.dumps({"format": FORMAT, "meta": meta, "entries": []}).encode()
    return f"{name} of rank {rank}\n".encode()


def write_step(spec, store, stages, replicas: int, step: int, attempt: str, *,
               write: bool = True, receipts: bool = True,
               bundle: bool = True) -> list[UploadResult]:  # fmt: skip
    """Every rank's files and signed receipt of `step` under `attempt` in `store` (its
    state and meta files hold a placeholder: sizes in the index are the real ones), and
    each node's receipts as one object, as its leader writes them; the `UploadResult`s
    the ranks would report."""
    world = PP * replicas
    identity = job_identity(spec)
    key = store.signing_key()
    bodies: dict[int, bytes] = {}

    def rank(r: int) -> UploadResult:
        prefix = rank_prefix(attempt, r)
        meta = rank_meta(world, replicas, r, step)
        files = []
        for name in (STATE_FILE, META_FILE):
            data = placeholder(r, name, meta)
            rel = f"{prefix}/{name}"
            files.append(FileEntry(rel, len(data), hashlib.sha256(data).hexdigest()))
            if write:
                put(store, f"{store.step_path(step)}/{rel}", data)
        index = rank_index(stages, replicas, r, prefix)
        receipt = Receipt(**identity, step=step, attempt=attempt, rank=r, world_size=world,
                          files=files, index=index, meta=meta)  # fmt: skip
        if write and receipts:
            bodies[r] = receipt.to_json(key).encode()
            put(store, f"{store.step_path(step)}/_receipts/{attempt}/rank_{r:05d}.json", bodies[r])
        return UploadResult(step, r, attempt, world, files, index, 1.0, meta=meta)

    def node(first: int) -> None:
        ours = [bodies[r] for r in range(first, min(first + RANKS_PER_NODE, world))]
        doc = {"format": NODE_FORMAT, "receipts": [b.decode() for b in ours]}
        path = f"{store.step_path(step)}/_receipts/{attempt}/{NODE_PREFIX}{first:05d}.json"
        put(store, path, json.dumps(doc).encode())

    with ThreadPoolExecutor(WRITE_THREADS) as pool:
        results = list(pool.map(rank, range(world)))
        if write and receipts and bundle:
            list(pool.map(node, range(0, world, RANKS_PER_NODE)))
    return results


def put(store, path: str, data: bytes) -> None:
    """Write one object as a rank's upload would, without the fsyncs (the harness's
    own writes are not what is measured)."""
    if store.is_local:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    else:
        store.fs.pipe_file(path, data)


def timeline_from(stage: int, replica: int) -> bool:
    """Whether a rank sends its steps' timelines: as `bubbles.recorder` decides."""
    from spotline.bubbles.recorder import sends_timeline

    return sends_timeline(replica)


# --- the group, the cluster, the demand -----------------------------------------------------


class SimGroup(RayWorkerGroup):
    """`RayWorkerGroup` over simulated ranks: its own folding of the reports, no Ray."""

    def __init__(self, spec, replicas: int, store, clock, stages: list[list[Param]], nodes):
        super().__init__(spec, replicas, store, "gpu", clock=clock)
        self.sim_clock = clock
        self.actors = [None] * self.world_size
        self._info = [
            {"rank": r, "pid": 1000 + r, "node_id": nodes[r % replicas]}
            for r in range(self.world_size)
        ]
        self.ranks = SimRanks(spec, replicas, self.attempt, store, stages)
        self.stages = stages
        self.sim_cpu_s = 0.0
        self.restores: list[Any] = []
        self._partition = {"method": "even", "bounds": None}

    def start(self, partition=None, init=True, survivors=None) -> None:
        pass

    def advance(self, timeout_s: float = 0.0) -> bool:
        return True

    def restore(self, manifest, source=None) -> int:
        """What reaches the ranks: the manifest, sent once; rank 0 of this shape plans
        its reads from it (every rank does the same for its own slice, in parallel)."""
        t0 = time.thread_time()
        text = manifest.to_json()
        self.restores.append(plan_rank(text, self.stages, self.replicas, 0))
        self.sim_cpu_s += time.thread_time() - t0
        self.ranks.step = manifest.step
        return manifest.step

    def run(self, target: int, peer_every: int = 0) -> None:
        self._runs = [None] * self.world_size
        now = time.monotonic()
        self._heard = {rank: (now, None) for rank in range(self.world_size)}
        self._finished, self._drained, self._final_polls = {}, set(), set()
        self.ranks.t0 = self.sim_clock() - self.ranks.step * STEP_S

    def request(self, save_at=0, stop_at=0, reason="", peer_every=0) -> None:
        if save_at:
            self.ranks.save_at = max(self.ranks.save_at, save_at)

    def poll(self, timeout_s: float):
        self.sim_clock.sleep(timeout_s)  # the real poll waits about this long
        t0 = time.thread_time()
        self.ranks.train(self.sim_clock())  # the ranks' own work, saves written
        self.sim_cpu_s += time.thread_time() - t0
        # As the real poll takes its ranks' reports in: with automatic collection held.
        with collection_held():
            t0 = time.thread_time()
            reports = self.ranks.publish(self.sim_clock())
            self.sim_cpu_s += time.thread_time() - t0
            return self._progress(reports)

    def wait_uploads(self, timeout_s: float) -> bool:
        return True

    def heldout_loss(self) -> float:
        return 1.0

    def peak_flops(self) -> float | None:
        return 989e12

    def hand_over(self, leaving, grace_s):
        from spotline.runtime.survivors import Survivors

        return Survivors()

    def shutdown(self) -> None:
        self.actors = []


def plan_rank(manifest_json: str, stages: list[list[Param]], replicas: int, rank: int,
              store=None) -> dict:  # fmt: skip
    """What one rank of `replicas` replicas does before it reads a byte of state, as
    `Trainer.fetch` and `train.state.load` do it: parse the manifest it is sent, read
    the meta it needs from `store` (none when None), and plan its reads
    (`reshard.Plan`, checked against the whole index). Returns the plan's size."""
    import torch

    from spotline.checkpoint.manifest import Manifest
    from spotline.checkpoint.reshard import Plan, checkpoint_meta

    manifest = Manifest.from_json(manifest_json)
    if store is not None:
        same = manifest.topology.get("replicas") == replicas
        checkpoint_meta(manifest, store, rank if same else None)
    plan = Plan(manifest.extra["index"])
    stage, replica = rank // replicas, rank % replicas
    for p in stages[stage]:
        plan.param(p.name, p.shape)
    for p, lo, hi in owned_slices(stages[stage], replicas, replica):
        for kind in (FP32, *MOMENTS):
            plan.need(p.name, kind, lo, hi)
    for p in stages[stage]:
        plan.whole(p.name, torch.bfloat16)
    pieces = plan.pieces()
    return {"ranges": len(plan.ranges), "pieces": sum(len(v) for v in pieces.values())}


class SimCluster:
    """Nodes of one replica each (eight ranks); capacity is every node not cordoned."""

    def __init__(self, nodes: list[str]):
        self.nodes = set(nodes)
        self.drained: list[str] = []
        self.cordoned = CordonList()

    def capacity(self, held_workers=0, exclude=frozenset(), lifted=frozenset()) -> int:
        return len(self.nodes - set(self.cordoned) - set(exclude))

    def gone(self, node_ids):
        return set(node_ids) - self.nodes

    def drain(self, node_id, deadline, reason):
        self.drained.append(node_id)
        return True

    def watch(self) -> None:
        pass

    def close(self) -> None:
        pass


class SimDemand(RayDemand):
    """The real demand, its bundles from the spec; what it sends is kept, not sent."""

    def __init__(self, spec, clock):
        super().__init__(spec, "gpu", clock=clock)
        self.sent: list[int] = []

    def _bundles_now(self):
        return demand_bundles(self.spec, "gpu", [])

    def _sender(self):
        return lambda bundles: self.sent.append(len(bundles))

    def withdraw(self) -> None:
        pass


class SimClock:
    """Simulated time: it passes when the loop sleeps or a poll waits."""

    def __init__(self):
        self.now = 0.0
        self.base = time.time()

    def __call__(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.base + self.now

    def sleep(self, s: float) -> None:
        self.now += s


# --- peer memory ------------------------------------------------------------------------------


def keeper_holdings(spec, stages, replicas: int, attempt: str, step: int) -> dict[str, list]:
    """What each node's state keeper holds after a peer copy of `step`: its own ranks'
    copies and its buddy node's (the node before it in the ring), as `holdings` returns."""
    world = PP * replicas
    copies = []
    for r in range(world):
        prefix = rank_prefix(attempt, r)
        meta = rank_meta(world, replicas, r, step)
        data = {n: placeholder(r, n, meta) for n in (STATE_FILE, META_FILE)}
        files = [FileEntry(f"{prefix}/{n}", len(b), hashlib.sha256(b).hexdigest())
                 for n, b in data.items()]  # fmt: skip
        copies.append(
            PeerCopy(
                attempt,
                step,
                r,
                world,
                files,
                rank_index(stages, replicas, r, prefix),
                meta=rank_meta(world, replicas, r, step),
            ).to_dict()  # fmt: skip
        )
    nodes = node_names(replicas)
    held: dict[str, list] = {n: [] for n in nodes}
    for r, c in enumerate(copies):
        node = r % replicas
        held[nodes[node]].append(c)
        if replicas > 1:
            held[nodes[(node + 1) % replicas]].append(c)
    return held


def node_names(replicas: int) -> list[str]:
    return [f"{i:04x}" + "0" * 52 for i in range(replicas)]
