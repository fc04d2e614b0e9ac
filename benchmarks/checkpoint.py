"""Spotline's checkpoint path: what blocks training, what is written, how fast it
uploads, and what a restore reads.

For each replica count D in --replicas (default 1, 2, 4), one after another, a fresh
process group of D ranks (torch.multiprocessing, spawn, no Ray; pipeline_stages 1,
ZeRO-1, fp32, one CPU thread budget of cores / D per rank) builds the same `Trainer`
Spotline's workers use, for a Llama of --n-layers x --d-model (default 24 x 1024: 308M
parameters), trains one step so that Adam's moments exist, and then, --repeats times:

1. blocked   `Trainer.snapshot()`: the host copy of what the rank owns, the only part
             of a Spotline save that blocks training (no collective).
   sync      that snapshot + `Trainer.write(snap, dir)` + `CheckpointStore.upload_dir`:
             a synchronous save and upload of the same state.
             blocked_fraction = blocked / sync.
2. bytes     every file all ranks wrote (state.safetensors and meta.json) over
             `spotline.planning.checkpoint_time.checkpoint_bytes(spec)`, the fp32 master and both Adam
             moments of every parameter: bytes_ratio.
3. upload    MB/s of Spotline's `upload_dir` (the upload part of 1, sha256 of every
             file and the commit-ready file entries included) against a bare boto3
             `upload_file` (multipart, TransferConfig with the same part size and 10
             threads per file) of the same files, to the same moto S3 server on
             127.0.0.1; the two take turns going first: upload_vs_boto3 (goal >= 0.8).
4. restore   the uploads are committed as one manifest, built as the commit coordinator
             builds it, and every rank runs `Trainer.fetch(manifest, store)`: bytes_read
             per rank over the checkpoint's bytes. restore_bytes_per_rank_ratio is the
             mean over ranks (the max is printed too). An fp32 ZeRO-1 rank needs every
             parameter's fp32 weights (its module holds the whole model) and its share
             of the moments: (4 + 8/D) / 12 of the checkpoint at best.
             By default the restore reads a file:// store holding the same files under
             the same paths (the uploads are staged in its layout): moto's server reads
             a whole object for every ranged GET, which at this size takes hours and
             says nothing about Spotline. --restore-from s3 reads from moto instead
             (fine for small models). The bytes read do not depend on the store.
5. blocked_s_by_replicas: blocked seconds at each D. The host copy has no collective
   and each rank copies only its ZeRO share, so it should not grow with D.

A per-save figure of a group is its slowest rank's (the next step's collective waits
for it); throughput is all ranks' bytes over the slowest rank's seconds. Figures 1-4
are printed for every D; the JSON's top-level figures are those of the largest D.
With --repeats R the table shows medians [min-max] over the repeats; --json keeps
every sample.

    python benchmarks/checkpoint.py [--d-model 1024 --n-layers 24] [--replicas 1,2,4]
                                    [--repeats 3] [--json PATH]

Memory: every rank holds the fp32 weights and gradients (8 bytes/param) plus its ZeRO
share of master and moments (12/D), then its snapshot (12/D) or its restore buffers
(4 + 8/D); moto assembles each multipart object in memory twice. Before starting, the
script estimates the peak at the largest D against the memory available; without an
explicit --n-layers it lowers the default depth until the estimate fits, and says so.

Only the standard library is imported at the top: the ranks are spawned, and import
this script again as their __main__.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ranks import BenchmarkError, free_port, log_tail, redirect_output, spawn_ranks

MB = 1e6
GB = 1e9
MOTO_START_TIMEOUT_S = 60.0
# Parts in flight per file, and the part size: Spotline's defaults, which are boto3's.
UPLOAD_THREADS = 10
DEFAULT_PART_MB = 8
# Memory estimate: what a rank process holds besides model state (torch, DeepSpeed,
# the corpus, the allocator's slack), and the moto server's own.
RANK_BASE_BYTES = 0.8 * GB
MOTO_BASE_BYTES = 0.3 * GB
MEMORY_HEADROOM = 0.9  # of MemAvailable
# Every AWS variable that could point botocore at real credentials or a real endpoint.
AWS_ENV_TO_CLEAR = (
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
)


def stats(xs: list[float]) -> dict[str, Any]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "samples": xs}


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS and VmHWM (peak) of a process, in bytes; empty where /proc has none."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# --- the moto S3 server ------------------------------------------------------------------


def isolate_aws_env(work: Path) -> None:
    """Test credentials only, no profile, config file or instance metadata: every S3
    request of this script and its ranks goes to the local server."""
    for name in AWS_ENV_TO_CLEAR:
        os.environ.pop(name, None)
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
        AWS_SHARED_CREDENTIALS_FILE=str(work / "no-aws-credentials"),
        AWS_CONFIG_FILE=str(work / "no-aws-config"),
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )


def start_moto(work: Path) -> tuple[subprocess.Popen, str]:
    """`python -m moto.server` on 127.0.0.1 (its spooled objects under `work`)."""
    try:
        import moto.server  # noqa: F401
    except ImportError as e:
        raise BenchmarkError(
            f"this benchmark uploads to a local moto S3 server, and moto is not installed "
            f"({e}); run: pip install 'moto[server]>=5' boto3 (or pip install -e '.[test]')"
        ) from None
    port = free_port()
    log_path = work / "moto.log"
    tmp = work / "moto-tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TMPDIR": str(tmp)},
        )
    url = f"http://127.0.0.1:{port}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + MOTO_START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise BenchmarkError(
                f"moto S3 server exited with code {proc.returncode} before answering:\n"
                + log_tail(log_path)
            )
        try:
            opener.open(url + "/", timeout=1).close()
            return proc, url
        except urllib.error.HTTPError:
            return proc, url  # it answered, even if with an error status
        except OSError:
            if time.monotonic() > deadline:
                stop_moto(proc)
                raise BenchmarkError(
                    f"moto S3 server on {url} did not answer within {MOTO_START_TIMEOUT_S:g} s:\n"
                    + log_tail(log_path)
                ) from None
            time.sleep(0.1)


def stop_moto(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# --- one rank ------------------------------------------------------------------------------


def _manifest(spec: Any, replicas: int, step: int, attempt: str, ranks: list[dict]) -> Any:
    """The manifest the commit coordinator builds from the ranks' upload results."""
    from spotline.checkpoint.coordinator import build_manifest
    from spotline.checkpoint.transfer import UploadResult

    results = [
        UploadResult(step, r["rank"], attempt, replicas, r["files"], r["index"], 0.0) for r in ranks
    ]
    return build_manifest(spec, step, attempt, replicas, results)


def in_turns(dist: Any, rank: int, world: int, together: bool, fn: Callable[[], None]) -> None:
    """fn() on every rank at once (`together`), or on one rank at a time, rank 0 first;
    each call starts at a barrier."""
    for k in [rank] if together else range(world):
        dist.barrier()
        if k == rank:
            fn()


class _RankBench:
    """One rank's saves, uploads and restores, after its Trainer trained a step."""

    def __init__(self, cfg: dict[str, Any], trainer: Any, rank: int):
        import boto3
        from boto3.s3.transfer import TransferConfig

        from spotline.checkpoint import CheckpointStore

        self.cfg, self.trainer, self.rank = cfg, trainer, rank
        self.world = cfg["replicas"]
        part = cfg["part_bytes"]
        self.s3 = CheckpointStore(
            cfg["s3_uri"], endpoint_url=cfg["endpoint"], multipart_chunksize=part
        )
        # The uploads are staged in a file:// store's own layout, so that store holds the
        # same files under the same paths as S3 and can serve the restore.
        self.local_store = CheckpointStore(f"file://{Path(cfg['work']) / 'store'}")
        self.restore_store = self.s3 if cfg["restore_from"] == "s3" else self.local_store
        self.client = boto3.client("s3", endpoint_url=cfg["endpoint"], region_name="us-east-1")
        self.transfer = TransferConfig(
            multipart_threshold=part,  # as Spotline's upload: files above one part go multipart
            multipart_chunksize=part,
            max_concurrency=UPLOAD_THREADS,
            use_threads=True,
        )
        self.step = trainer.step
        root = self.local_store.uri.removeprefix("file://")
        self.step_dir = Path(root) / CheckpointStore.step_name(self.step)
        self.rss: dict[str, int] = {}

    def _turns(self, fn: Callable[[], None]) -> None:
        import torch.distributed as dist

        in_turns(dist, self.rank, self.world, self.cfg["concurrent_io"], fn)

    def repeat(self, r: int) -> tuple[list[dict], list[dict]] | None:
        """One save (snapshot, write, both uploads), commit and restore; rank 0 gets
        (every rank's save figures, every rank's restore figures)."""
        import torch.distributed as dist

        from spotline.checkpoint.transfer import attempt_dir
        from spotline.train.trainer import Trainer

        attempt = f"bench{r}"
        prefix = f"{attempt_dir(attempt)}/rank_{self.rank:05d}"
        local = self.step_dir / prefix
        shutil.rmtree(local, ignore_errors=True)
        mine: dict[str, Any] = {"rank": self.rank}

        dist.barrier()  # every rank copies at once, as at a training step boundary
        t0 = time.perf_counter()
        snap = self.trainer.snapshot()
        mine["blocked_s"] = time.perf_counter() - t0
        mine["snapshot_bytes"] = snap.nbytes
        self.rss["after_snapshot"] = _proc_status().get("VmRSS", 0)
        t0 = time.perf_counter()
        index = Trainer.write(snap, local).entries
        mine["write_s"] = time.perf_counter() - t0
        del snap
        gc.collect()

        # The two clients take turns going first.
        order = ("spotline", "boto3") if r % 2 == 0 else ("boto3", "spotline")
        for who in order:
            self._turns(lambda who=who: self._upload(who, local, prefix, r, mine))
        mine["upload_order"] = list(order)
        mine["sync_s"] = mine["blocked_s"] + mine["write_s"] + mine["spotline_upload_s"]
        # As the uploader does: index entries name files relative to the step root.
        for e in index:
            e["file"] = f"{prefix}/{e['file']}"
        mine["index"] = index

        saves: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(mine, saves, dst=0)
        if self.rank == 0:
            assert saves is not None
            manifest = _manifest(self.trainer.spec, self.world, self.step, attempt, saves)
            self.s3.commit(manifest)
            if self.restore_store is not self.s3:
                self.restore_store.commit(manifest)
            for s in saves:
                s["files"] = [(f.path, f.size) for f in s["files"]]
                del s["index"]
        dist.barrier()

        manifest = self.restore_store.load_manifest(self.step)
        restore: dict[str, Any] = {"rank": self.rank}

        def fetch() -> None:
            t0 = time.perf_counter()
            fetched = self.trainer.fetch(manifest, self.restore_store)
            restore.update(restore_s=time.perf_counter() - t0, bytes_read=fetched.bytes_read)
            self.rss["after_restore"] = _proc_status().get("VmRSS", 0)

        self._turns(fetch)
        gc.collect()
        restores: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(restore, restores, dst=0)

        dist.barrier()
        shutil.rmtree(local, ignore_errors=True)
        dist.barrier()
        if self.rank != 0:
            return None
        assert saves is not None and restores is not None
        shutil.rmtree(self.step_dir, ignore_errors=True)
        self.s3.fs.rm(f"{self.cfg['bucket']}/{self.cfg['group_prefix']}", recursive=True)
        return saves, restores

    def _upload(self, who: str, local: Path, prefix: str, r: int, mine: dict) -> None:
        t0 = time.perf_counter()
        if who == "spotline":
            mine["files"] = self.s3.upload_dir(local, self.step, prefix=prefix)
        else:
            for path in sorted(p for p in local.rglob("*") if p.is_file()):
                key = f"{self.cfg['boto3_prefix']}/r{r}/{prefix}/{path.relative_to(local)}"
                self.client.upload_file(str(path), self.cfg["bucket"], key, Config=self.transfer)
        mine[f"{who}_upload_s"] = time.perf_counter() - t0


def _rank(rank: int, cfg_json: str, results: Any) -> None:
    """One rank of a group: train a step, then save, upload and restore --repeats times.
    Rank 0 puts the group's figures on `results`."""
    cfg = json.loads(cfg_json)
    redirect_output(Path(cfg["work"]) / f"rank_{rank}.log")
    import torch
    import torch.distributed as dist

    from spotline.config.schema import JobSpec
    from spotline.train.process import Topology, init_distributed
    from spotline.train.trainer import Trainer

    spec = JobSpec.model_validate_json(cfg["spec"])
    d = cfg["replicas"]
    topo = Topology(1, d, rank)
    init_distributed(topo, "127.0.0.1", cfg["port"])
    try:
        t0 = time.perf_counter()
        trainer = Trainer(spec, topo, threads=cfg["threads"])
        init_s = time.perf_counter() - t0
        rss = {"after_init": _proc_status().get("VmRSS", 0)}
        t0 = time.perf_counter()
        trainer.train_step()  # so that Adam's moments exist
        step_s = time.perf_counter() - t0
        rss["after_step"] = _proc_status().get("VmRSS", 0)

        bench = _RankBench(cfg, trainer, rank)
        repeats = [bench.repeat(r) for r in range(cfg["repeats"])]
        memory = {"rank": rank, "peak_rss": _proc_status().get("VmHWM", 0), "rss": rss | bench.rss}
        peaks: list[Any] | None = [None] * d if rank == 0 else None
        dist.gather_object(memory, peaks, dst=0)
        if rank == 0:
            results.put(
                {
                    "replicas": d,
                    "init_s": init_s,
                    "first_step_s": step_s,
                    "torch_threads": torch.get_num_threads(),
                    "ranks_memory": peaks,
                    "repeats": [
                        [s | b for s, b in zip(saves, restores, strict=True)]
                        for saves, restores in repeats
                    ],
                }
            )
    finally:
        dist.destroy_process_group()


def run_group(cfg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Spawn the D ranks of one group and wait for rank 0's figures."""
    work = Path(cfg["work"])
    work.mkdir(parents=True, exist_ok=True)
    killed = " (killed: out of memory? try a smaller --n-layers/--d-model)"
    where = f"D={cfg['replicas']}"
    return spawn_ranks(_rank, (json.dumps(cfg),), cfg["replicas"], work, timeout_s, where, killed)


# --- the spec and its size -----------------------------------------------------------------


def build_spec(args: argparse.Namespace, n_layers: int, replicas: int, uri: str, endpoint: str):
    """A Llama on the byte tokenizer and a small stdlib corpus. The global batch is the
    least common multiple of the replica counts, one sequence per micro-batch, so every
    D runs the same batch."""
    from spotline.config import load_spec

    ds = args.replicas
    batch = math.lcm(*ds)
    return load_spec(
        {
            "name": "checkpoint-bench",
            "model": {
                "kind": "llama",
                "n_layers": n_layers,
                "d_model": args.d_model,
                "n_heads": args.n_heads or max(1, args.d_model // 64),
                "seq_len": args.seq_len,
            },
            "data": {"corpus": "stdlib", "max_bytes": 1_000_000},
            "parallel": {
                "pipeline_stages": 1,
                "micro_batches": batch // max(ds),
                "zero_stage": 1,
                "precision": "fp32",
            },
            "elastic": {"min_replicas": min(ds), "max_replicas": max(ds)},
            "train": {"steps": 10, "global_batch_size": batch, "warmup_steps": 0},
            "checkpoint": {"uri": uri, "endpoint_url": endpoint},
            "resources": {"device": "cpu", "cpus_per_worker": cores() / replicas},
        }
    )


def param_count(spec: Any) -> int:
    from spotline.models import layer_param_counts, model_def

    return sum(layer_param_counts(model_def(spec)))


def peak_bytes(params: int, d: int, part_bytes: int, together: bool) -> float:
    """Estimated peak host memory of a group of d ranks and the moto server (bytes).

    Fitted to this script's own measurements (rank RSS per phase, moto's peak RSS):
    each uploading rank holds about 2.5 x threads x part in flight, and moto about 3.5
    x that, plus about 3.5 x each object it assembles (8 MiB parts: a 420 MB object
    peaked at 3.1 x and kept 1.1 x; with 50 MiB parts s3fs's uploads took moto to
    7 x).
    """
    share = 12 * params / d  # ZeRO-1: this rank's fp32 master + two moments
    engine = d * (8 * params + share + RANK_BASE_BYTES)  # fp32 weights + grads, whole
    busy = d if together else 1  # ranks uploading or restoring at once
    in_flight = UPLOAD_THREADS * part_bytes
    phase = max(
        d * share,  # every rank's snapshot, until written
        busy * (6 * in_flight + 3.5 * share),  # uploads
        busy * (4 * params + 8 * params / d),  # restore: all fp32 weights + own moments
    )
    return engine + phase + MOTO_BASE_BYTES


def fit_layers(args: argparse.Namespace, budget: float | None) -> tuple[int, str | None]:
    """(n_layers, note): the requested depth, or with no --n-layers the largest depth up
    to the default whose estimated peak fits `budget`."""
    part = args.part_mb * 2**20
    d = max(args.replicas)

    def need(layers: int) -> tuple[int, float]:
        p = param_count(build_spec(args, layers, d, "s3://bench/x", "http://127.0.0.1:1"))
        return p, peak_bytes(p, d, part, args.concurrent_io)

    layers = args.n_layers or args.default_layers
    params, peak = need(layers)
    if budget is None or peak <= budget or args.no_memory_check:
        return layers, None
    if args.n_layers:
        raise BenchmarkError(
            f"--n-layers {layers} x --d-model {args.d_model} ({params / 1e6:.0f}M params) "
            f"needs about {peak / GB:.1f} GB at D={d}, and {budget / GB:.1f} GB are available "
            f"({MEMORY_HEADROOM:.0%} of MemAvailable); lower --n-layers or --d-model, drop "
            "the largest of --replicas, or pass --no-memory-check"
        )
    for fewer in range(layers - 1, 0, -1):
        p, pk = need(fewer)
        if pk <= budget:
            return fewer, (
                f"the default {layers} layers ({params / 1e6:.0f}M params) need about "
                f"{peak / GB:.1f} GB at D={d} and {budget / GB:.1f} GB are available: "
                f"measured {fewer} layers ({p / 1e6:.0f}M params, about {pk / GB:.1f} GB) instead"
            )
    raise BenchmarkError(
        f"not even one layer of d_model {args.d_model} fits in {budget / GB:.1f} GB at D={d}"
    )


# --- figures ---------------------------------------------------------------------------------


def derive(group: dict[str, Any], state_bytes: int) -> dict[str, Any]:
    """Per-repeat figures of one group, each over its ranks."""
    d = group["replicas"]
    out: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        out.setdefault(key, []).append(value)

    for ranks in group["repeats"]:
        total = sum(size for r in ranks for _, size in r["files"])
        meta = sum(size for r in ranks for path, size in r["files"] if path.endswith("meta.json"))
        blocked = max(r["blocked_s"] for r in ranks)
        sync = max(r["sync_s"] for r in ranks)
        ours = total / max(r["spotline_upload_s"] for r in ranks)
        theirs = total / max(r["boto3_upload_s"] for r in ranks)
        read = [r["bytes_read"] for r in ranks]
        add("blocked_s", blocked)
        add("sync_s", sync)
        add("write_s", max(r["write_s"] for r in ranks))
        add("spotline_upload_s", max(r["spotline_upload_s"] for r in ranks))
        add("boto3_upload_s", max(r["boto3_upload_s"] for r in ranks))
        add("blocked_fraction", blocked / sync)
        add("checkpoint_bytes", total)
        add("meta_bytes", meta)
        add("snapshot_bytes", sum(r["snapshot_bytes"] for r in ranks))
        add("bytes_ratio", total / state_bytes)
        add("spotline_upload_bytes_per_s", ours)
        add("boto3_upload_bytes_per_s", theirs)
        add("upload_vs_boto3", ours / theirs)
        add("restore_bytes_read_mean", statistics.fmean(read))
        add("restore_bytes_read_max", max(read))
        add("restore_bytes_per_rank_ratio", statistics.fmean(read) / total)
        add("restore_bytes_per_rank_max_ratio", max(read) / total)
        add("restore_s", max(r["restore_s"] for r in ranks))
    figures: dict[str, Any] = {k: stats(v) for k, v in out.items()}
    figures["restore_floor_ratio"] = (4 + 8 / d) / 12
    figures["peak_rss_per_rank_bytes"] = max(m["peak_rss"] for m in group["ranks_memory"])
    return figures


def _fmt(x: float) -> str:
    if x == 0 or 0.01 <= abs(x) < 1e5:
        return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"
    return f"{x:.2e}"


def render(
    by_d: dict[int, dict[str, Any]],
    groups: dict[int, dict[str, Any]],
    info: dict[str, Any],
    args: argparse.Namespace,
    ctx: dict[str, Any],
) -> str:
    ds = sorted(by_d)
    spread = args.repeats > 1

    def cell(d: int, key: str, scale: float = 1.0) -> str:
        v = by_d[d][key]
        if not isinstance(v, dict):
            return _fmt(v * scale)
        med = _fmt(v["median"] * scale)
        if not spread or v["min"] == v["max"]:
            return med
        return f"{med} [{_fmt(v['min'] * scale)}-{_fmt(v['max'] * scale)}]"

    src = "file:// copy" if args.restore_from == "file" else "moto S3"
    rows: list[tuple[str, str, float]] = [
        ("blocked s/save (snapshot)", "blocked_s", 1),
        ("sync save+upload s/save", "sync_s", 1),
        ("  of which write s", "write_s", 1),
        ("  of which spotline upload s", "spotline_upload_s", 1),
        ("blocked fraction", "blocked_fraction", 1),
        ("checkpoint MB (all files)", "checkpoint_bytes", 1 / MB),
        ("  of which meta.json MB", "meta_bytes", 1 / MB),
        ("bytes ratio (vs fp32 + 2 moments)", "bytes_ratio", 1),
        ("upload MB/s spotline upload_dir", "spotline_upload_bytes_per_s", 1 / MB),
        ("upload MB/s boto3 upload_file", "boto3_upload_bytes_per_s", 1 / MB),
        ("upload spotline / boto3", "upload_vs_boto3", 1),
        ("restore MB read per rank, mean", "restore_bytes_read_mean", 1 / MB),
        ("restore MB read per rank, max", "restore_bytes_read_max", 1 / MB),
        ("restore bytes/rank ratio, mean", "restore_bytes_per_rank_ratio", 1),
        ("restore bytes/rank ratio, max", "restore_bytes_per_rank_max_ratio", 1),
        ("  floor for fp32 ZeRO-1: (4+8/D)/12", "restore_floor_ratio", 1),
        (f"restore s (slowest rank, {src})", "restore_s", 1),
        ("peak RSS GB per rank", "peak_rss_per_rank_bytes", 1 / GB),
    ]
    cells = [[cell(d, key, scale) for d in ds] for _, key, scale in rows]
    width = max(len(label) for label, _, _ in rows)
    col = max(12, *(len(c) for row in cells for c in row))
    head = (
        f"{info['name']}: Llama {info['n_layers']} x {info['d_model']} "
        f"({info['params'] / 1e6:.1f}M params, state {info['state_bytes'] / MB:.0f} MB), pp=1, "
        f"ZeRO-1, fp32, seq {args.seq_len}; "
        + (f"median [min-max] of {args.repeats} repeats" if spread else "1 repeat")
    )
    lines = [head]
    if info.get("fit_note"):
        lines.append(f"note: {info['fit_note']}")
    lines.append(f"{'':<{width}}  " + "  ".join(f"{f'D={d}':>{col}}" for d in ds))
    lines += [
        f"{label:<{width}}  " + "  ".join(f"{c:>{col}}" for c in row)
        for (label, _, _), row in zip(rows, cells, strict=True)
    ]
    top = max(ds)
    blocked = {str(d): round(by_d[d]["blocked_s"]["median"], 4) for d in ds}
    lines.append(
        f"at D={top}: blocked_fraction {_fmt(by_d[top]['blocked_fraction']['median'])}, "
        f"bytes_ratio {_fmt(by_d[top]['bytes_ratio']['median'])}, upload_vs_boto3 "
        f"{_fmt(by_d[top]['upload_vs_boto3']['median'])}, restore_bytes_per_rank_ratio "
        f"{_fmt(by_d[top]['restore_bytes_per_rank_ratio']['median'])}; "
        f"blocked_s_by_replicas {blocked}"
    )
    threads = ", ".join(f"D={d}: {groups[d]['torch_threads']}" for d in ds)
    lines.append(
        f"machine: {ctx['cores']} cores ({ctx['machine']}, load avg "
        f"{ctx['load_avg_1min_at_start']} at start), {ctx['mem_available_gb_at_start']} GB "
        f"available at start; python {ctx['python']}, torch {ctx['torch']}, deepspeed "
        f"{ctx['deepspeed']}, s3fs {ctx['s3fs']}, boto3 {ctx['boto3']}, moto {ctx['moto']} "
        f"(server peak RSS {ctx.get('moto_peak_rss_gb', '?')} GB); torch threads per rank "
        f"{threads}; part size {args.part_mb} MiB, {UPLOAD_THREADS} threads per file"
    )
    return "\n".join(lines)


def machine_context() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    def ver(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    avail = _mem_available()
    # Versions from package metadata: importing deepspeed here would print its banner.
    return {
        "cores": cores(),
        # Taken before the first run: other work on the machine makes the figures noisy.
        "load_avg_1min_at_start": round(os.getloadavg()[0], 2),
        "mem_available_gb_at_start": None if avail is None else round(avail / GB, 1),
        "machine": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(),
        **{n: ver(n) for n in ("torch", "deepspeed", "s3fs", "boto3", "moto")},
    }


# --- orchestration --------------------------------------------------------------------------


def _replica_list(text: str) -> list[int]:
    try:
        ds = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--replicas takes comma-separated counts such as 1,2,4 (got {text!r})"
        ) from None
    if not ds or ds[0] < 1:
        raise argparse.ArgumentTypeError(f"--replicas counts must be >= 1 (got {text!r})")
    return ds


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="checkpoint.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--d-model", type=int, default=1024, help="Llama width")
    p.add_argument(
        "--n-layers",
        type=int,
        help="Llama depth (default 24; lowered to fit memory unless given)",
    )
    p.add_argument("--n-heads", type=int, help="attention heads (default d_model / 64)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument(
        "--replicas",
        type=_replica_list,
        default=[1, 2, 4],
        help="data-parallel group sizes, measured one after another (default 1,2,4)",
    )
    p.add_argument("--repeats", type=int, default=3, help="saves + restores per group")
    p.add_argument(
        "--part-mb",
        type=int,
        default=DEFAULT_PART_MB,
        help="multipart part size, MiB, both clients (>= 5)",
    )
    p.add_argument(
        "--restore-from",
        choices=("file", "s3"),
        default="file",
        help="store the restore reads: a file:// copy (default) or moto S3",
    )
    p.add_argument(
        "--concurrent-io",
        action="store_true",
        help="all ranks upload and restore at once (default: one rank at a time, as ranks\n"
        "on separate nodes with their own links; moto then holds one object at a time)",
    )
    p.add_argument("--no-memory-check", action="store_true", help="skip the memory estimate")
    p.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds one group (one D) may take"
    )
    p.add_argument("--workdir", help="staging, logs and moto's files (default: a temp dir)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    args.default_layers = 24
    for name, least in (("d_model", 1), ("seq_len", 2), ("repeats", 1), ("part_mb", 5)):
        if getattr(args, name) < least:
            p.error(f"--{name.replace('_', '-')} must be >= {least} (got {getattr(args, name)})")
    if args.n_layers is not None and args.n_layers < 1:
        p.error(f"--n-layers must be >= 1 (got {args.n_layers})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from spotline.config import SpecError
    from spotline.planning.checkpoint_time import checkpoint_bytes

    ctx = machine_context()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="spotline-bench-ckpt-"))
    work.mkdir(parents=True, exist_ok=True)
    moto = None
    groups: dict[int, dict[str, Any]] = {}
    try:
        avail = _mem_available()
        n_layers, note = fit_layers(args, None if avail is None else avail * MEMORY_HEADROOM)
        if note:
            print(f"checkpoint.py: {note}", file=sys.stderr, flush=True)
        isolate_aws_env(work)
        moto, endpoint = start_moto(work)
        import boto3

        bucket = f"spotline-bench-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
            Bucket=bucket
        )
        info: dict[str, Any] = {}
        for d in args.replicas:
            group_prefix = f"d{d}"
            uri = f"s3://{bucket}/{group_prefix}/spotline"
            spec = build_spec(args, n_layers, d, uri, endpoint)
            if not info:
                info = {
                    "name": spec.name,
                    "n_layers": n_layers,
                    "d_model": args.d_model,
                    "n_heads": spec.model.n_heads,
                    "seq_len": args.seq_len,
                    "vocab_size": spec.vocab_size(),
                    "params": param_count(spec),
                    "state_bytes": checkpoint_bytes(spec),
                    "global_batch_size": spec.train.global_batch_size,
                    "fit_note": note,
                    "estimated_peak_gb": round(
                        peak_bytes(
                            param_count(spec),
                            max(args.replicas),
                            args.part_mb * 2**20,
                            args.concurrent_io,
                        )
                        / GB,
                        1,
                    ),
                }
            print(
                f"D={d}: {d} rank(s), {info['params'] / 1e6:.1f}M params ...",
                file=sys.stderr,
                flush=True,
            )
            cfg = {
                "work": str(work / f"d{d}"),
                "spec": spec.model_dump_json(),
                "replicas": d,
                "port": free_port(),
                "threads": max(1, cores() // d),
                "repeats": args.repeats,
                "part_bytes": args.part_mb * 2**20,
                "endpoint": endpoint,
                "bucket": bucket,
                "s3_uri": uri,
                "group_prefix": group_prefix,
                "boto3_prefix": f"{group_prefix}/boto3",
                "restore_from": args.restore_from,
                "concurrent_io": args.concurrent_io,
            }
            groups[d] = run_group(cfg, args.timeout)
            shutil.rmtree(work / f"d{d}", ignore_errors=True)
        peak = _proc_status(moto.pid).get("VmHWM")
        ctx["moto_peak_rss_gb"] = None if peak is None else round(peak / GB, 2)
    except (BenchmarkError, SpecError) as e:
        print(f"checkpoint.py: {e}", file=sys.stderr)
        return 1
    finally:
        if moto is not None:
            stop_moto(moto)
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)

    by_d = {d: derive(g, info["state_bytes"]) for d, g in groups.items()}
    print(render(by_d, groups, info, args, ctx))
    if args.json:
        top = max(by_d)
        out = {
            **{
                k: by_d[top][k]["median"]
                for k in (
                    "blocked_fraction",
                    "bytes_ratio",
                    "upload_vs_boto3",
                    "restore_bytes_per_rank_ratio",
                    "restore_bytes_per_rank_max_ratio",
                )
            },
            "blocked_s_by_replicas": {str(d): by_d[d]["blocked_s"]["median"] for d in by_d},
            "headline_replicas": top,
            "spreads": {
                k: {x: by_d[top][k][x] for x in ("min", "median", "max")}
                for k in ("blocked_fraction", "bytes_ratio", "upload_vs_boto3")
                + ("restore_bytes_per_rank_ratio",)
            }
            | {
                "blocked_s_by_replicas": {
                    str(d): {x: by_d[d]["blocked_s"][x] for x in ("min", "median", "max")}
                    for d in by_d
                }
            },
            "by_replicas": {str(d): f for d, f in by_d.items()},
            "groups": {
                str(d): {k: v for k, v in g.items() if k != "repeats"} | {"repeats": g["repeats"]}
                for d, g in groups.items()
            },
            "model": info,
            "config": {
                "replicas": args.replicas,
                "repeats": args.repeats,
                "part_mb": args.part_mb,
                "upload_threads_per_file": UPLOAD_THREADS,
                "restore_from": args.restore_from,
                "pipeline_stages": 1,
                "zero_stage": 1,
                "precision": "fp32",
            },
            "machine": ctx,
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
