"""Sweeps with Ray Tune: every trial a real Spotline job on the session's Ray cluster.

ASHA stops trials through a graceful stop that commits, PBT continues a trial from
another trial's committed step with its own lr, and a sweep whose driver was killed
goes on from each trial's last commit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import spotline
from conftest import tiny_spec
from spotline.checkpoint import CheckpointStore
from spotline.tune import Tuner

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[1]


def sweep_spec(tmp: Path, steps: int, **over):
    """One 1-stage, 1-replica worker per trial (0.5 CPU): four trials share the cluster."""
    return tiny_spec(
        tmp,
        "sweep",
        **{
            "parallel.pipeline_stages": 1,
            "elastic.min_replicas": 1,
            "elastic.max_replicas": 1,
            "train.global_batch_size": 4,
            "train.steps": steps,
            "train.log_every": 5,
            "checkpoint.interval_steps": 5,
            **over,
        },
    )


def summary(uri: str) -> dict:
    return json.loads(CheckpointStore(uri).read_artifact("summary.json"))


def job_uris(root: Path, trial: str) -> list[str]:
    return sorted(f"file://{p}" for p in (root / trial).iterdir() if p.is_dir())


def loss_of_step(spec, store: CheckpointStore, step: int) -> float:
    """The training loss of step `step + 1` on one replica, from the full weights of
    committed step `step` (read back from storage, independent of any trainer)."""
    import torch

    from spotline.backfill.tasks import load_target
    from spotline.data import open_dataset
    from spotline.data.sampler import Sampler
    from spotline.models import model_def

    model = load_target(spec, store, store.load_manifest(step))
    data = open_dataset(spec)
    sampler = Sampler(data.train, spec.model.seq_len, spec.micro_batch_size(), spec.data.seed)
    loss = model_def(spec).loss
    with torch.no_grad():
        batches = sampler.micro_batches(step, 0, 1, spec.grad_accum(1))
        return float(torch.stack([loss(model(x), y) for x, y in batches]).mean())


def lr_of_run(uri: str) -> float:
    """The train.lr a job at `uri` was configured with (its newest manifest records it)."""
    return CheckpointStore(uri).latest_manifest().extra["spec"]["train.lr"]


def test_asha_stops_trials_early_with_a_commit_and_leaves_no_actor(ray_session, tmp_path):
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    # Long enough that the trials' half-second polls see them at several rungs: a tiny
    # trial on a quiet machine trains 40 steps between two polls.
    spec = sweep_spec(tmp_path, 200, **{"checkpoint.interval_steps": 10})
    asha = ASHAScheduler(time_attr="step", grace_period=20, max_t=200, reduction_factor=2)
    # ASHA lets the first trial to reach a rung through, and stops a later one below the
    # rung's median. One trial at a time, the two good learning rates first, makes that
    # order the grid's: run side by side, the slow-learning trials could reach each rung
    # first and never be stopped.
    grid = Tuner(
        spotline.Job(spec),
        {"train.lr": tune.grid_search([3e-3, 1e-2, 3e-5, 1e-5])},
        tune.TuneConfig(metric="train_loss", mode="min", scheduler=asha, max_concurrent_trials=1),
        name="asha",
        storage_path=str(tmp_path / "tune"),
    ).fit()
    assert not grid.errors
    results = list(grid)
    assert len(results) == 4
    early = [r for r in results if not r.metrics.get("finished")]
    assert early, "ASHA stopped no trial"
    assert any(r.metrics.get("finished") for r in results)
    root = tmp_path / "ckpt"
    stopped_at = []
    for r in early:
        (uri,) = job_uris(root, r.metrics["trial_id"])
        s = summary(uri)
        assert s["committed_steps"][-1] == s["step"]  # stopped at a step boundary, committed
        if s["step"] < spec.train.steps:
            assert s["state"] == "stopped"
            stopped_at.append(s["step"])
        else:  # Tune's stop landed as the job ended, before the trial's last report
            assert s["state"] in ("stopped", "finished")
    # ASHA must have cut at least one trial short.
    assert stopped_at, "ASHA stopped no trial before its last step"
    # Nothing of any trial's job is left on the cluster (Ray's GCS: live named actors,
    # placement groups not removed).
    deadline = time.monotonic() + 30
    while True:
        alive = [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("spotline:asha-")
        ]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert alive == []
    groups = ray.util.placement_group_table().values()
    left = [g["name"] for g in groups if g["name"].startswith("spotline:asha-")]
    assert left, "no placement group of a trial's job was ever made"  # the names match
    assert all(g["state"] == "REMOVED" for g in groups if g["name"] in left), left


def test_pbt_exploit_resumes_from_the_donors_commit_with_its_own_lr(ray_session, tmp_path):
    from ray import tune
    from ray.tune.schedulers import PopulationBasedTraining

    from spotline.train.trainer import lr_lambda

    # Steps slow enough (a wider model) that PBT sees the trials while both train.
    spec = sweep_spec(tmp_path, 80, **{"model.d_model": 128, "model.n_layers": 4})
    assert spec.grad_accum(1) == 2  # (the loss check below sums the same micro-batches)
    pbt = PopulationBasedTraining(
        time_attr="step",
        perturbation_interval=10,
        hyperparam_mutations={"train.lr": tune.uniform(1e-4, 1e-2)},
        quantile_fraction=0.5,
        resample_probability=0.0,  # mutate by x0.8 or x1.2: always another lr
    )
    grid = Tuner(
        spotline.Job(spec),
        {"train.lr": tune.grid_search([1e-5, 5e-3])},
        tune.TuneConfig(metric="train_loss", mode="min", scheduler=pbt),
        name="pbt",
        storage_path=str(tmp_path / "tune"),
    ).fit()
    assert not grid.errors
    root = tmp_path / "ckpt"
    exploits = [
        uri for r in grid for uri in job_uris(root, r.metrics["trial_id"]) if "/from-" in uri
    ]
    assert exploits, "no trial exploited another"
    checked = 0
    for uri in exploits:
        donor, step = uri.rsplit("/from-", 1)[1].rsplit("-", 1)
        s = summary(uri)
        new_lr = lr_of_run(uri)
        # The summary holds the losses of the run's last start: where Tune paused the
        # exploiting trial and resumed it later from its own commit, they start there and
        # the restore from the donor is not among them; its lr is (below).
        first = min(int(k) for k in s["losses"])
        if first == int(step) + 1:
            # The loss of the first step after the restore is the loss of the restored
            # weights on that step's batch: the donor's weights at that step give it too.
            # The donor may hold that step in more than one run (its own first run, and
            # one it started from a third trial's step and trained past it): one of them.
            held = [
                u
                for u in job_uris(root, donor)
                if int(step) in CheckpointStore(u).committed_steps()
            ]
            got = s["losses"][str(first)]
            donor_uri = next(
                (
                    u
                    for u in held
                    if got
                    == pytest.approx(loss_of_step(spec, CheckpointStore(u), int(step)), rel=1e-5)
                ),
                None,
            )
            assert donor_uri, (uri, held, got)
            # The mutated lr is in force, not the one the checkpoint was trained with.
            assert new_lr != pytest.approx(lr_of_run(donor_uri))
            checked += 1
        mine = spec.model_copy(deep=True)
        mine.train.lr = new_lr
        f = lr_lambda(mine, 1)
        rows = [h for h in s["history"] if h.get("lr") is not None]
        assert rows
        for h in rows:
            # (a report reads the lr of its step, or of the next when the rank is past it)
            at = [new_lr * f(h["step"]), new_lr * f(h["step"] + 1)]
            assert any(h["lr"] == pytest.approx(x, rel=1e-6) for x in at), (h, at, new_lr)
    assert checked, "no exploiting run's summary starts at its restore"


DRIVER = """
import json, sys
sys.path.insert(0, {tests!r})
import ray
ray.init(address={address!r}, log_to_driver=False, logging_level="WARNING")
from ray import tune
import spotline
from spotline.config import validate_dict
from spotline.tune import Tuner
spec = validate_dict(json.loads({spec!r}))
Tuner(spotline.Job(spec), {{"train.lr": tune.grid_search([1e-3, 3e-3])}},
      tune.TuneConfig(metric="train_loss", mode="min"), name="resume",
      storage_path={storage!r}).fit()
"""


def test_a_sweep_restored_after_its_driver_was_killed_resumes_each_trial(ray_session, tmp_path):
    import ray
    from ray import tune  # noqa: F401 - Tune must import here as in the driver

    spec = sweep_spec(tmp_path, 160)
    storage = tmp_path / "tune"
    root = tmp_path / "ckpt"
    script = DRIVER.format(
        tests=str(REPO / "tests"),
        address=ray.get_runtime_context().gcs_address,
        spec=spec.model_dump_json(),
        storage=str(storage),
    )
    driver = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO / "platform")},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )

    def committed() -> dict[str, int]:
        out = {}
        for d in root.glob("*/run"):
            steps = CheckpointStore(f"file://{d}").committed_steps()
            if steps:
                out[d.parent.name] = steps[-1]
        return out

    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and driver.poll() is None:
        c = committed()
        state = list(storage.glob("resume/experiment_state-*.json"))
        if len(c) == 2 and min(c.values()) >= 10 and state:
            break
        time.sleep(0.5)
    assert driver.poll() is None, "the sweep ended before it could be interrupted"
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    before = committed()
    assert len(before) == 2 and max(before.values()) < spec.train.steps

    grid = Tuner.restore(storage / "resume", spotline.Job(spec)).fit()
    assert not grid.errors
    assert len(list(grid)) == 2
    for r in grid:
        assert r.metrics.get("finished"), r.metrics
        trial = r.metrics["trial_id"]
        (uri,) = job_uris(root, trial)
        s = summary(uri)
        assert s["state"] == "finished" and s["step"] == spec.train.steps
        # The restored trial's job went on from a commit, not from the start.
        assert min(int(k) for k in s["losses"]) > before[trial] >= 10
