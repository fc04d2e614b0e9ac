"""Shared test fixtures.

S3: a real S3-protocol HTTP server (moto's, in a thread) bound to 127.0.0.1, so
the S3 tests run the same s3fs/aiobotocore/boto3 code users run. These fixtures
must never let a test reach a real AWS endpoint, a shared credentials file or an
instance-metadata service: every request goes to 127.0.0.1.
"""

from __future__ import annotations

import atexit
import compileall
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# `ray start` (the autoscaling tier's clusters) turns token authentication on, and a
# local `ray.init` runs in the same mode; Ray's core reads the mode once per process,
# at import, so it is set before anything imports Ray: any tier runs alone or together.
os.environ["RAY_AUTH_MODE"] = "token"

# The session's process ends with the session's status once every exit handler has run
# (Ray's shutdown, pytest's temporary folders), skipping the interpreter's teardown: a
# process that started and shut down several Ray clusters (the chaos modules each start
# their own) has died of SIGSEGV there, now and then, after every test passed and every
# result was written, with only its main Python thread left (a native thread; which one
# is not known). Registered before anything imports Ray, so that it runs after every
# handler registered later.
_SESSION: list[pytest.Session] = []


def _end_without_teardown() -> None:
    if _SESSION:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(_SESSION[0].exitstatus))


atexit.register(_end_without_teardown)

from spotline.runtime.cluster import bind_to_loopback  # noqa: E402

# Every Ray node a test starts (the shared local cluster, each node of a multi-node
# `Cluster`, a `ray start --head` subprocess) listens on 127.0.0.1 only.
bind_to_loopback()


def pytest_configure(config: pytest.Config) -> None:
    # A `unit` test that starts a process, Ray or DeepSpeed fails (see tier_guard.py).
    import tier_guard

    config.pluginmanager.register(tier_guard, "tier_guard")


def pytest_sessionstart(session: pytest.Session) -> None:
    if not _SESSION:  # not a session a test runs inside this one (pytester)
        _SESSION.append(session)
        if sys.flags.dont_write_bytecode:
            # Every Ray worker, controller and CLI process a test starts imports Spotline;
            # where the environment forbids writing bytecode on import
            # (PYTHONDONTWRITEBYTECODE), each of those hundreds of processes would
            # compile the package from source again (about 0.1 s of CPU each). Compiled
            # once here instead (a quarter of a second; then only a check of mtimes).
            compileall.compile_dir(Path(__file__).resolve().parent.parent / "platform", quiet=1)


# Faults a test injects into its own job's ranks (spotline.runtime.faults): one JSON
# list per job name in this directory, which every worker learns through Ray's job
# runtime_env. A hang is declared after 10 s without a step (production: 20 s), so a
# test that freezes a rank waits for that, not for the collective timeout. A group's
# peer copies are measured after 2 warm-up steps (production: 10), so that the tests'
# 30-step jobs price k within their first group.
FAULTS_DIR = Path(tempfile.mkdtemp(prefix="spotline-faults-"))
WORKER_ENV = {
    "SPOTLINE_TEST_FAULTS": str(FAULTS_DIR),
    "SPOTLINE_HANG_FLOOR_S": "10",
    "SPOTLINE_PEER_WARM_STEPS": "2",
}


def inject_faults(spec: Any, faults: list[dict[str, Any]]) -> None:
    """Give the ranks of the job of `spec` these faults (see spotline.runtime.faults).
    Its spec must be marked as a test's (`failure.test_faults: true`), as a job must be
    for its ranks to apply them."""
    assert spec.failure.test_faults, f"{spec.name}: set failure.test_faults to inject faults"
    (FAULTS_DIR / f"{spec.name}.json").write_text(json.dumps(faults))


# Every AWS variable that could make botocore find real credentials or a real endpoint.
_AWS_ENV_TO_CLEAR = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loopback_env() -> dict[str, str]:
    return {"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """Endpoint URL (http://127.0.0.1:PORT) of a moto S3 server running for the session.

    It serves from a thread of the test process (no process: the S3 tests stay in the
    `unit` tier), on a port the kernel picks and the server keeps."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def aws_isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No AWS credentials anywhere: env cleared, config files pointed at nothing, IMDS off."""
    for name in _AWS_ENV_TO_CLEAR:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for k, v in _loopback_env().items():
        monkeypatch.setenv(k, v)


@dataclass
class S3Bucket:
    """A fresh, empty bucket on the moto server, with test credentials in the environment."""

    name: str
    endpoint_url: str
    client: Any  # boto3 S3 client for direct inspection and tampering

    def uri(self, prefix: str = "ckpt") -> str:
        return f"s3://{self.name}/{prefix}" if prefix else f"s3://{self.name}"


@pytest.fixture
def s3_bucket(
    s3_server: str, aws_isolated_env: None, monkeypatch: pytest.MonkeyPatch
) -> Iterator[S3Bucket]:
    import boto3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    name = f"spotline-test-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    client.create_bucket(Bucket=name)
    yield S3Bucket(name=name, endpoint_url=s3_server, client=client)


# --- Ray -------------------------------------------------------------------------------


# What every worker of a test cluster has in its environment. The nodes' raylets hold
# it and their workers inherit it: as a runtime_env it would make Ray start each worker
# through its setup process (a second interpreter importing Ray), a second more per job.
CLUSTER_ENV = {
    **WORKER_ENV,
    # A tracker server a test points at that does not answer fails the call at once,
    # not after MLflow's minutes of retries.
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "1",
}


def init_local_ray() -> None:
    from unittest import mock

    import ray

    # A local `ray.init` starts the node's processes from this one, with its environment
    # (Ray takes no variables for them): they get CLUSTER_ENV, this process keeps its own.
    with mock.patch.dict(os.environ, CLUSTER_ENV):
        ray.init(
            # Always a cluster of this session's own: without an address Ray would attach
            # to any cluster its address file names (another run's, or a dead one).
            address="local",
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            logging_level="WARNING",
            # Metrics reach the Prometheus endpoint within a second (default 10 s), so a
            # test can scrape them while a short job runs.
            _system_config={"metrics_report_interval_ms": 1000},
        )


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """One local Ray cluster for every `ray` test: start-ups are the slow part.

    A multi-node `chaos` module borrows the process for its own cluster and starts
    this one again when it is done.
    """
    import ray

    init_local_ray()
    yield
    ray.shutdown()


def tiny_spec(tmp_path: Path, name: str, **overrides: Any):
    """A 2-stage x 2-replica GPT small enough to train tens of steps in seconds on CPU."""
    from spotline.config import load_spec

    raw = {
        "name": name,
        "model": {"n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 32},
        "data": {"max_bytes": 300_000},
        "parallel": {"pipeline_stages": 2, "micro_batches": 2},
        "elastic": {"min_replicas": 2, "max_replicas": 2},
        "train": {"steps": 30, "global_batch_size": 8, "warmup_steps": 5, "log_every": 10},
        "checkpoint": {
            "uri": f"file://{tmp_path}/ckpt",
            "interval_steps": 10,
            "keep_last": 3,
            "staging_dir": str(tmp_path / "staging"),
        },
        "resources": {"cpus_per_worker": 0.5},
        # A rank blocked on a dead peer raises within 2 minutes even if nothing else
        # noticed (hang detection normally ends it within seconds).
        "failure": {"collective_timeout_s": 120},
    }
    return load_spec(raw, overrides)


@pytest.fixture(scope="session")
def reference_run(ray_session, tmp_path_factory):
    """One uninterrupted tiny run that other runs compare their per-step losses to."""
    import spotline

    tmp = tmp_path_factory.mktemp("reference")
    spec = tiny_spec(tmp, "reference")
    result = spotline.Job(spec).run(verbose=False)
    return spec, result, tmp


def run_killing_a_rank(spec, after_commit: int, rank: int):
    """Run `spec` to its end while a thread SIGKILLs `rank` once `after_commit` is
    committed and passed; returns what `wait` returns (or raises what it raises), after
    checking the kill happened."""
    import spotline

    run = spotline.Job(spec).start()
    killed: dict = {}
    killer = threading.Thread(target=kill_rank_after_commit, args=(run, after_commit, rank, killed))
    killer.start()
    try:
        return run.wait(verbose=False)
    finally:
        killer.join()
        assert killed, "the worker was never killed"


def assert_resumed_exactly(result, ref, after_commit: int) -> None:
    """`result` lost one worker after `after_commit` was committed, resumed from that
    commit or a newer one, and every step either group trained equals the uninterrupted
    `ref`, bit for bit."""
    assert result.state == "finished"
    assert result.failures == 1
    first, second = result.attempts
    assert "worker process died" in first["error"]
    resumed_from = second["restored_from"]
    assert resumed_from is not None and resumed_from >= after_commit
    assert second["losses"][0][0] == resumed_from + 1
    for step, loss in [*first["losses"], *second["losses"]]:
        assert loss == ref.losses[step], (step, loss, ref.losses[step])
    assert result.losses == ref.losses


def kill_rank_after_commit(run, after_commit: int, rank: int, killed: dict) -> None:
    """SIGKILL `rank`'s process once `after_commit` is committed and the job is past it
    (run on a thread beside `run.wait()`); what was killed goes into `killed`."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        st = run.status()
        if after_commit in st["committed_steps"] and st["step"] > after_commit and st["workers"]:
            pid = next(w["pid"] for w in st["workers"] if w["rank"] == rank)
            killed["step"] = st["step"]
            killed["pid"] = pid
            os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.05)


# --- trackers: each read back with its own library ------------------------------------


def tensorboard_run(log_dir: Path) -> tuple[dict[str, list], dict[str, list]]:
    """({scalar tag: [(step, value)]}, {text tag: [(step, text)]}) of the event files in
    `log_dir`, as TensorBoard shows them (purged steps left out)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags["scalars"]}
    texts = {
        t.removesuffix("/text_summary"): [
            (e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode())
            for e in acc.Tensors(t)
        ]
        for t in tags["tensors"]
        if t.endswith("/text_summary")
    }
    return scalars, texts


def wandb_records(path: Path) -> list:
    """The records (wandb_internal_pb2.Record) of a .wandb transaction log: a LevelDB-style
    log of 32 KiB blocks after a 7-byte header, each record a CRC, a length, a type
    (full, first, middle, last) and a chunk of one serialized Record."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb transaction log"
    block, pos, out, buf = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        if len(chunk) < length:
            break  # the tail is still being written
        pos += 7 + length
        if kind == 0:
            continue
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            out.append(record)
    return out


def wandb_run(run_dir: Path, timeout_s: float = 60.0) -> dict[str, Any]:
    """What an offline wandb run directory holds: its id, config and history rows.

    wandb's service process finishes writing the transaction log a moment after
    `run.finish()` returns (seen: a read right after it found the log cut inside a
    record, or before the run record); this reads until the log ends with the run's
    exit record, or `timeout_s` passes, and returns what it read then."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = _wandb_log(run_dir)
        if out["exit_code"] is not None or time.monotonic() > deadline:
            return out
        time.sleep(0.1)


def _wandb_log(run_dir: Path) -> dict[str, Any]:
    import json

    (log,) = run_dir.glob("run-*.wandb")
    out: dict[str, Any] = {"id": None, "config": {}, "history": [], "exit_code": None}
    for r in wandb_records(log):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out["id"] = r.run.run_id
            for item in r.run.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in r.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            row = {
                (i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item
            }
            out["history"].append(row)
        elif kind == "exit":
            out["exit_code"] = r.exit.exit_code
    return out
