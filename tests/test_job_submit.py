"""`ray job submit` against a real `ray start --head` cluster, and `Job.submit()`.

The head runs in its own process group on free loopback ports, next to (not
instead of) the shared test cluster, and is torn down without `ray stop`, which
would stop every Ray process on the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import _free_port
from spotline.checkpoint import CheckpointStore
from spotline.compat.ray import session_dir

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parent.parent


def _client_env() -> dict[str, str]:
    # `ray start` turns on token authentication; clients opt in with RAY_AUTH_MODE=token
    # and find the token in ~/.ray/auth_token, as the README says.
    return {**os.environ, "RAY_AUTH_MODE": "token", "NO_PROXY": "127.0.0.1,localhost"}


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("head")
    # Every fixed default port of a head (the agent's 52365, metrics...) may already be
    # taken by the shared test cluster on this machine: pick free ones.
    gcs, dash, agent, agent_grpc, metrics, rt_env, client = (_free_port() for _ in range(7))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    # A short temp dir: Ray's unix sockets live under it and have a path-length limit.
    temp_dir = f"/tmp/sl-head-{os.getpid()}"
    cmd = [
        shutil.which("ray") or "ray", "start", "--head", "--block",
        f"--port={gcs}", "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--include-dashboard=true",
        f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={rt_env}",
        f"--ray-client-server-port={client}",
        "--num-cpus=2", f"--temp-dir={temp_dir}", "--disable-usage-stats",
    ]  # fmt: skip
    log = open(tmp / "head.log", "w")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    address = f"http://127.0.0.1:{dash}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        # Ready means a job can run end to end: the dashboard's job agent starts last.
        # `ray job submit` reads the cluster's token (~/.ray/auth_token) in token mode.
        probe = subprocess.run(
            [shutil.which("ray") or "ray", "job", "submit", "--address", address,
             "--", sys.executable, "-c", "print('ready')"],
            capture_output=True, text=True, env=_client_env(),
        )  # fmt: skip
        if probe.returncode == 0 and "ready" in probe.stdout:
            break
        time.sleep(1)
        assert proc.poll() is None, (tmp / "head.log").read_text()
    else:
        pytest.fail(f"ray head did not come up:\n{(tmp / 'head.log').read_text()}")
    yield address
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(5)  # `ray start --block` may sit out SIGTERM: the group is killed then
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    log.close()
    shutil.rmtree(temp_dir, ignore_errors=True)


def _tiny_sets(tmp: Path, name: str) -> list[str]:
    return [
        f"name={name}",
        "model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=32",
        "data.max_bytes=200000",
        "elastic.min_replicas=1", "elastic.max_replicas=1",
        "train.steps=6", "train.global_batch_size=8", "train.log_every=2",
        "checkpoint.interval_steps=3",
        f"checkpoint.uri=file://{tmp}/ckpt",
        f"checkpoint.staging_dir={tmp}/staging",
    ]  # fmt: skip


def test_ray_job_submit_cli_runs_jobs_train(ray_head, tmp_path):
    sets = [a for s in _tiny_sets(tmp_path, "submitted") for a in ("--set", s)]
    cmd = [
        shutil.which("ray") or "ray", "job", "submit", "--address", ray_head,
        "--working-dir", str(REPO), "--",
        sys.executable, "jobs/train.py", "--config", "configs/quickstart.yaml", *sets,
    ]  # fmt: skip
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=_client_env()
    )
    logs = out.stdout + out.stderr
    assert out.returncode == 0, logs
    assert "Spotline job submitted: finished" in logs
    assert "held-out loss" in logs
    assert CheckpointStore(f"file://{tmp_path}/ckpt").committed_steps() == [3, 6]


def test_job_submit_sdk(ray_head, tmp_path):
    # In a fresh interpreter: the auth mode is read once per process, and this test
    # process already talks to the shared (token-less) test cluster.
    script = f"""
import spotline
job = spotline.Job.from_yaml("configs/quickstart.yaml", {_tiny_sets(tmp_path, "sdk-submit")!r})
handle = job.submit({ray_head!r}, working_dir={str(REPO)!r})
print("STATUS", handle.wait(timeout_s=600))
print(handle.logs())
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=700,
        cwd=REPO, env=_client_env(),
    )  # fmt: skip
    logs = out.stdout + out.stderr
    assert out.returncode == 0, logs
    assert "STATUS SUCCEEDED" in logs, logs
    assert "Spotline job sdk-submit: finished" in logs
    manifest = CheckpointStore(f"file://{tmp_path}/ckpt").load_manifest(6)
    assert json.loads(manifest.to_json())["topology"]["replicas"] == 1


def _encodings(secret: str) -> list[str]:
    """The secret, and how it reads inside any base64 blob (three alignments, both
    alphabets): what a grep must not find anywhere."""
    import base64

    raw = secret.encode()
    out = [secret]
    for k in range(3):
        for enc in (base64.b64encode, base64.urlsafe_b64encode):
            text = enc(b"\0" * k + raw).decode()
            # Characters that depend on the secret alone, away from both edges.
            out.append(text[(4 * k + 2) // 3 + 1 : (4 * (k + len(raw))) // 3 - 1])
    return out


def _grep_tree(root: Path, needles: list[str]) -> list[str]:
    hits = []
    for path in root.rglob("*"):
        if path.is_file():
            try:
                text = path.read_bytes().decode("utf-8", errors="replace")
            except OSError:
                continue
            hits += [f"{path}: {n[:6]}..." for n in needles if n in text]
    return hits


def test_secrets_never_reach_logs_artifacts_manifests_or_the_entrypoint(
    ray_session, ray_head, s3_bucket, tmp_path
):
    """A job with credentials in checkpoint.storage_options, run here and submitted."""
    from ray.job_submission import JobSubmissionClient

    import spotline
    from conftest import tiny_spec

    secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCY" + os.urandom(6).hex()
    key_id = "AKIA" + os.urandom(8).hex().upper()
    needles = _encodings(secret) + _encodings(key_id)
    over = {
        "elastic.min_replicas": 1,
        "elastic.max_replicas": 1,
        "train.steps": 4,
        "checkpoint.interval_steps": 2,
        "checkpoint.endpoint_url": s3_bucket.endpoint_url,
        # moto takes any keys; these are the ones that must never show.
        "checkpoint.storage_options": {"key": key_id, "secret": secret},
    }
    # 1. Run in this driver, on the shared test cluster.
    run_spec = tiny_spec(tmp_path, "secret-run", **over, **{"checkpoint.uri": s3_bucket.uri("run")})
    result = spotline.Job(run_spec).run(verbose=True)
    assert result.committed_steps == [2, 4]
    # 2. Submitted to the head, with the same credentials.
    sub = tiny_spec(tmp_path, "secret-sub", **over, **{"checkpoint.uri": s3_bucket.uri("sub")})
    script = f"""
import json, spotline
spec = spotline.JobSpec.model_validate_json({sub.model_dump_json()!r})
handle = spotline.Job(spec).submit({ray_head!r}, working_dir={str(REPO)!r})
print("STATUS", handle.wait(timeout_s=600))
print(handle.logs())
from ray.job_submission import JobSubmissionClient
print("ENTRYPOINT", JobSubmissionClient({ray_head!r}).get_job_info(handle.submission_id).entrypoint)
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=700,
        cwd=REPO, env=_client_env(),
    )  # fmt: skip
    logs = out.stdout + out.stderr
    assert "STATUS SUCCEEDED" in logs, logs[-3000:]
    assert "ENTRYPOINT python jobs/train.py --spec-b64" in logs
    # Everything a user, an operator or an attacker with the bucket could read.
    texts = {"driver output": json.dumps(result.__dict__, default=str), "submit output": logs}
    for prefix in ("run/", "sub/"):
        listing = s3_bucket.client.list_objects_v2(Bucket=s3_bucket.name, Prefix=prefix)
        for obj in listing["Contents"]:
            body = s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=obj["Key"])["Body"]
            texts[obj["Key"]] = body.read().decode("utf-8", errors="replace")
    assert any(k.endswith("manifest.json") for k in texts)
    assert any(k.endswith("summary.json") for k in texts)
    found = [f"{where}: {n[:6]}..." for where, t in texts.items() for n in needles if n in t]
    # Ray's own session logs: the shared cluster's and the head's.
    session = Path(session_dir())
    found += _grep_tree(session / "logs", needles)
    found += _grep_tree(Path(f"/tmp/sl-head-{os.getpid()}"), needles)
    client = JobSubmissionClient(ray_head)
    for job in client.list_jobs():
        found += [f"job list entrypoint: {n[:6]}..." for n in needles if n in job.entrypoint]
    assert not found, found


def test_a_custom_model_from_outside_the_package_trains_through_ray_job_submit(ray_head, tmp_path):
    """tests/custom_model.py is the user's code: it reaches the driver and every worker
    through the job's working_dir, and its config is validated by its own model."""
    sets = [a for s in _tiny_sets(tmp_path, "custom") for a in ("--set", s)]
    model = [
        "--set", "model={kind: custom, provider: 'tests.custom_model:PROVIDER', "
        "config: {width: 24, depth: 2}, seq_len: 32}",
    ]  # fmt: skip
    cmd = [
        shutil.which("ray") or "ray", "job", "submit", "--address", ray_head,
        "--working-dir", str(REPO), "--",
        sys.executable, "jobs/train.py", "--config", "configs/quickstart.yaml", *sets, *model,
    ]  # fmt: skip
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=_client_env()
    )
    logs = out.stdout + out.stderr
    assert out.returncode == 0, logs[-3000:]
    assert "Spotline job custom: finished" in logs
    m = CheckpointStore(f"file://{tmp_path}/ckpt").load_manifest(6)
    assert m.extra["spec"]["model.provider"] == "tests.custom_model:PROVIDER"
    assert m.extra["spec"]["model.config.width"] == 24
    # Its own config model refuses a bad field, before any worker starts.
    bad = [*cmd[:-2], "--set", "model.config.width=-1"]
    out = subprocess.run(
        bad, capture_output=True, text=True, timeout=300, cwd=REPO, env=_client_env()
    )
    assert out.returncode != 0
    assert "model.config.width" in out.stdout + out.stderr
