"""Credentials in a spec reach the actors that need them and nothing Ray records.

Ray's GCS keeps each actor's creation task, constructor arguments included, for the
life of the cluster. These tests read what the GCS holds (its actor table, and the
GCS server process's memory) while actors given a spec with storage_options run.
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import pytest

import spotline
from conftest import tiny_spec
from spotline.checkpoint import CheckpointStore
from spotline.config import load_spec

pytestmark = pytest.mark.ray


def _credentials() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:10].upper()
    return f"AKIATEST{tag}", f"sEcReT/{tag}/{uuid.uuid4().hex}"


def _gcs_holds(needles: list[str]) -> dict[str, bool]:
    """Which of `needles` Ray's GCS holds: its actor table, and its server's memory."""
    from spotline.compat.ray import gcs_actor_records, gcs_server_pid

    records = gcs_actor_records()
    pid = gcs_server_pid()
    found = {n: n.encode() in records for n in needles}
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) (\S+)", line)
            lo, hi = int(m[1], 16), int(m[2], 16)
            if "r" not in m[3] or hi - lo > 1 << 30:
                continue
            try:
                mem.seek(lo)
                data = mem.read(hi - lo)
            except (OSError, ValueError, OverflowError):
                continue  # a guard page or a device mapping
            for n in needles:
                found[n] = found[n] or n.encode() in data
    return found


def test_sealed_job_gives_an_actor_its_secrets_and_the_gcs_none(ray_session, tmp_path) -> None:
    import ray

    from spotline.runtime.sealed import SealedJob

    class Probe:
        """An actor started the way Spotline starts its own: from a SealedJob."""

        def __init__(self, job: SealedJob, marker: str) -> None:
            self.spec, self.store = job.open()

        def credentials(self) -> list:
            c, d = self.spec.checkpoint.storage_options, self.spec.data.storage_options
            store_options = self.store.__getstate__()["args"][2]
            return [c["key"], c["secret"], d["secret"], store_options]

    key, secret = _credentials()
    _, data_secret = _credentials()
    profile = f"profile-{uuid.uuid4().hex}"  # not secret by its name, but an option
    marker = f"plain-argument-{uuid.uuid4().hex}"  # a top-level argument: the GCS keeps it
    spec = load_spec(
        {
            "name": "sealed",
            "checkpoint": {
                "uri": "s3://bucket/ckpt",
                "endpoint_url": "http://127.0.0.1:9",
                "storage_options": {"key": key, "secret": secret, "profile": profile},
            },
            "data": {"storage_options": {"secret": data_secret}},
        }
    )
    store = CheckpointStore(
        "s3://bucket/ckpt", "http://127.0.0.1:9", spec.checkpoint.storage_options
    )
    job = SealedJob(spec, store)
    probe = ray.remote(Probe).options(num_cpus=0).remote(job, marker)
    options = {"key": key, "secret": secret, "profile": profile}
    assert ray.get(probe.credentials.remote()) == [key, secret, data_secret, options]
    held = _gcs_holds([marker, key, secret, data_secret, profile])
    assert held[marker], "the scan finds what the GCS keeps"
    assert not any(held[s] for s in (key, secret, data_secret, profile)), held
    ray.kill(probe)


def test_a_job_with_storage_options_leaves_them_out_of_the_gcs(
    ray_session, s3_bucket, tmp_path: Path
) -> None:
    for i in range(3):
        s3_bucket.client.put_object(
            Bucket=s3_bucket.name,
            Key=f"corpus/part{i}.txt",
            Body=("The quick brown fox jumps over the lazy dog. " * 400).encode(),
        )
    key, secret = _credentials()
    data_key, data_secret = _credentials()
    _, api_token = _credentials()
    spec = tiny_spec(
        tmp_path,
        "sealed-job",
        **{
            "model": {
                "kind": "custom",
                "provider": "custom_model:PROVIDER",
                "config": {"width": 16, "depth": 2, "api_token": api_token},
                "seq_len": 32,
            },
            "runtime_env.working_dir": str(Path(__file__).parent),
            "runtime_env.excludes": ["*.pyc", "__pycache__"],
            "checkpoint.uri": s3_bucket.uri("jobs/sealed"),
            "checkpoint.endpoint_url": s3_bucket.endpoint_url,
            "checkpoint.storage_options": {"key": key, "secret": secret},
            "data.corpus": f"s3://{s3_bucket.name}/corpus",
            "data.endpoint_url": s3_bucket.endpoint_url,
            "data.storage_options": {"key": data_key, "secret": data_secret},
            "preemption.sources": [{"kind": "ray-drain", "poll_interval_s": 0.5}],
            "backfill.enabled": True,  # every kind of actor: controller, workers,
            # executors, node watchers
            "elastic.min_replicas": 1,
            "elastic.max_replicas": 1,
            "train.steps": 4,
            "checkpoint.interval_steps": 2,
        },
    )
    import ray

    run = spotline.Job(spec).start()
    names: set[str] = set()
    while not ray.wait([run._done], timeout=0.2)[0]:
        names |= {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    result = run.wait(verbose=False)
    assert result.committed_steps == [2, 4]
    assert any(":backfill:" in n for n in names) and any(":watcher:" in n for n in names)
    held = _gcs_holds([key, secret, data_key, data_secret, api_token])
    assert not any(held.values()), held
    # Nor does anything the job wrote: manifests, receipts, artifacts.
    bucket = s3_bucket.client
    listed = bucket.list_objects_v2(Bucket=s3_bucket.name, Prefix="jobs/sealed/")["Contents"]
    assert any(o["Key"].endswith("/manifest.json") for o in listed)
    assert any("/artifacts/" in o["Key"] for o in listed)
    for o in listed:
        body = bucket.get_object(Bucket=s3_bucket.name, Key=o["Key"])["Body"].read()
        for s in (key, secret, data_key, data_secret, api_token):
            assert s.encode() not in body, (o["Key"], s)
    manifest = json.loads(
        bucket.get_object(Bucket=s3_bucket.name, Key="jobs/sealed/step_00000004/manifest.json")[
            "Body"
        ].read()
    )
    assert manifest["extra"]["spec"]["model.config.api_token"] == "***"


def test_every_node_that_starts_a_process_of_the_job_removes_its_copy_of_the_secrets(
    ray_session, tmp_path: Path
) -> None:
    """A submitted job's secrets travel in a package of its runtime_env, which Ray
    unpacks on every node that starts a process of the job; only the driver reads it.
    The first actor that opens its job on a node removes that node's copy."""
    import importlib.util

    import ray

    from spotline.config.redact import SECRETS_FILE, write_secrets_package
    from spotline.runtime.sealed import SealedJob

    class Looker:
        """Any process of the job: where this node's copy of the package lies."""

        def copy(self, module: str) -> str:
            found = importlib.util.find_spec(module)
            return str(Path(next(iter(found.submodule_search_locations))) / SECRETS_FILE)

    class Worker:
        """A Spotline actor on the node: it opens its job, and never reads the package."""

        def __init__(self, job: SealedJob) -> None:
            self.spec = job.open_spec()

        def name(self) -> str:
            return self.spec.name

    _, secret = _credentials()
    module = write_secrets_package(
        tmp_path, [[["checkpoint", "storage_options", "secret"], secret]]
    )
    # Uploaded as a submitted job's runtime_env is (an actor's may name only URIs).
    from spotline.compat.ray import upload_py_modules_if_needed

    env = upload_py_modules_if_needed(
        {"py_modules": [str(tmp_path / module)]}, include_gitignore=False
    )
    looker = ray.remote(Looker).options(num_cpus=0, runtime_env=env).remote()
    copy = Path(ray.get(looker.copy.remote(module)))
    assert copy.is_file() and not copy.is_relative_to(tmp_path)  # Ray's unpacked copy
    assert secret in copy.read_text()
    spec = load_spec({"name": "secrets-package"})
    worker = ray.remote(Worker).options(num_cpus=0, runtime_env=env).remote(SealedJob(spec))
    assert ray.get(worker.name.remote()) == "secrets-package"
    assert not copy.exists()
    ray.kill(looker)
    ray.kill(worker)


def test_a_submitted_drivers_secrets_package_leaves_the_cluster_once_read(
    ray_session, tmp_path: Path
) -> None:
    """`spotline submit` hands a job's secrets to its driver in a package of the job's
    runtime_env: Ray uploads it to the GCS and unpacks it where the driver starts. Once
    the driver has read it, no process of the job gets it, Ray's copy on the driver's
    node is gone, and the GCS no longer holds the upload."""
    import importlib.util
    import os

    import ray

    from spotline.compat.ray import (
        job_driver_environment,
        package_stored,
        session_dir,
        upload_py_modules_if_needed,
    )
    from spotline.config.redact import write_secrets_package
    from spotline.runtime.sealed import take_secrets_package

    class Driver:
        """A submitted job's entrypoint: started with the job's runtime_env, and handed
        it as Ray's job supervisor hands it, to give the job's processes."""

        def take(self, module: str) -> tuple[list, str, dict]:
            found = importlib.util.find_spec(module)
            folder = str(next(iter(found.submodule_search_locations)))
            secrets = take_secrets_package(module)
            (name,) = job_driver_environment({})
            return secrets, folder, json.loads(os.environ[name])["runtime_env"]

    class Looker:
        def finds(self, module: str) -> bool:
            return importlib.util.find_spec(module) is not None

    _, secret = _credentials()
    given = [[["checkpoint", "storage_options", "secret"], secret]]
    module = write_secrets_package(tmp_path, given)
    env = upload_py_modules_if_needed(
        {"py_modules": [str(tmp_path / module)]}, include_gitignore=False
    )
    (uri,) = env["py_modules"]
    assert package_stored(uri)
    handed = {
        **env,
        "env_vars": {
            **job_driver_environment(env),
            "RAY_ADDRESS": ray.get_runtime_context().gcs_address,  # as a driver has it
        },
    }
    driver = ray.remote(Driver).options(num_cpus=0, runtime_env=handed).remote()
    secrets, folder, job_env = ray.get(driver.take.remote(module))
    assert secrets == given
    # Ray's unpacked copy on the driver's node (this one), and the upload in the GCS.
    assert Path(folder).is_relative_to(session_dir()) and not Path(folder).parent.exists()
    assert not package_stored(uri)
    # What the driver gives its job: a process of the job finds no package.
    assert uri not in job_env.get("py_modules", [])
    looker = ray.remote(Looker).options(num_cpus=0, runtime_env=job_env).remote()
    assert ray.get(looker.finds.remote(module)) is False
    runtime = Path(session_dir()) / "runtime_resources"
    left = [p for p in runtime.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert left == []
    ray.kill(driver)
    ray.kill(looker)
