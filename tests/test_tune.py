"""Sweep specs and search spaces: every bad input fails before any trial starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import tiny_spec
from spotline.cli import main
from spotline.config import SpecError
from spotline.config.sweep import load_sweep
from spotline.job import Job
from spotline.tune import Tuner, check_space, default_concurrency, from_sweep_spec
from test_spec import SWEEPS

pytestmark = pytest.mark.unit


@pytest.fixture
def spec(tmp_path):
    return tiny_spec(tmp_path, "sweepbase")


def test_the_shipped_sweeps_load_and_pass_their_checks() -> None:
    assert SWEEPS, "no sweep file in configs/"
    for path in SWEEPS:
        sweep, here = load_sweep(path)
        job = Job.from_yaml(here / sweep.job, sweep.overrides)
        tuner = from_sweep_spec(sweep, job)
        assert tuner.root.startswith("file:///") and tuner.name == sweep.name


def test_a_key_that_is_no_field_gets_a_did_you_mean(spec) -> None:
    with pytest.raises(SpecError) as ei:
        check_space(spec, {"train.lrr": {"loguniform": [1e-4, 1e-2]}})
    assert str(ei.value) == (
        "param_space.train.lrr: the job has no field 'train.lrr'; did you mean 'train.lr'?"
    )
    with pytest.raises(SpecError, match="no field 'model.depth'"):
        check_space(spec, {"model.depth": [2, 4]})


def test_a_value_that_makes_an_invalid_job_is_named(spec) -> None:
    with pytest.raises(SpecError) as ei:
        check_space(spec, {"train.warmup_steps": {"choice": [5, -1]}})
    msg = str(ei.value)
    assert msg.startswith("param_space.train.warmup_steps: the value -1 makes an invalid job")
    assert "train.warmup_steps" in msg


def test_pbt_may_search_only_the_retunable_fields(spec) -> None:
    from ray import tune
    from ray.tune.schedulers import PopulationBasedTraining

    check_space(spec, {"train.lr": {"loguniform": [1e-4, 1e-2]}}, "pbt")
    with pytest.raises(SpecError) as ei:
        check_space(spec, {"model.d_model": {"choice": [32, 64]}}, "pbt")
    assert "param_space.model.d_model: PBT continues a trial" in str(ei.value)
    assert "train.lr" in str(ei.value) and "asha or fifo" in str(ei.value)
    # The Python API checks Tune's own domains and the mutations the same way.
    pbt = PopulationBasedTraining(hyperparam_mutations={"data.seed": [1, 2]})
    with pytest.raises(SpecError, match="scheduler.hyperparam_mutations.data.seed: PBT"):
        Tuner(
            Job(spec),
            {"train.lr": tune.loguniform(1e-4, 1e-2)},
            tune.TuneConfig(metric="train_loss", mode="min", scheduler=pbt),
        )


def test_tune_domains_are_checked_at_their_bounds(spec) -> None:
    from ray import tune

    check_space(spec, {"train.lr": tune.loguniform(1e-4, 1e-2), "train.seed": tune.randint(0, 9)})
    with pytest.raises(SpecError, match="the value 0.0 makes an invalid job"):
        check_space(spec, {"train.lr": tune.uniform(0.0, 1e-2)})
    with pytest.raises(SpecError, match="the value 0 makes an invalid job"):
        check_space(spec, {"train.steps": tune.grid_search([10, 0])})


def test_fields_the_sweep_owns_cannot_be_searched(spec) -> None:
    for key in ("name", "checkpoint.uri"):
        with pytest.raises(SpecError, match=f"param_space.{key}: .*cannot be searched"):
            check_space(spec, {key: ["a", "b"]})
    with pytest.raises(SpecError, match="param_space is empty"):
        check_space(spec, {})


def _sweep_file(tmp_path: Path, body: str) -> Path:
    job = tmp_path / "job.yaml"
    job.write_text("name: base\ncheckpoint:\n  uri: file://./ckpt\n")
    path = tmp_path / "sweep.yaml"
    path.write_text("job: job.yaml\n" + body)
    return path


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            "param_space:\n  train.lr: {lognormal: [1, 2]}\n",
            "param_space.train.lr: {'lognormal': [1, 2]} is not a domain; use one of {choice",
        ),
        (
            "param_space:\n  train.lr: {uniform: [0.1, 0.01]}\n",
            "param_space.train.lr.uniform: low 0.1 must be below high 0.01",
        ),
        ("param_space: {train.lr: 0.1}\nscheduler: {kind: hyperband}\n", "scheduler"),
        (
            "param_space: {train.lr: 0.1}\nstorage_path: s3://bucket/sweeps\n",
            "storage_path 's3://bucket/sweeps': give a local directory",
        ),
        ("param_space:\n  trian.lr: [1, 2]\n", "did you mean 'train.lr'?"),
    ],
)
def test_a_bad_sweep_file_fails_in_one_line_before_anything_starts(
    tmp_path, capsys, body, expected
) -> None:
    code = main(["sweep", str(_sweep_file(tmp_path, body))])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("spotline: ") and err.count("\n") == 1, err
    assert expected in err
    assert "Traceback" not in err


def test_default_concurrency_fits_each_trials_minimum_on_the_cluster(spec) -> None:
    # tiny_spec: 2 stages x min 2 replicas, 0.5 CPU per worker = 2 CPUs per trial.
    assert default_concurrency(spec, {"CPU": 4.0}) == 2
    assert default_concurrency(spec, {"CPU": 9.0}) == 4
    assert default_concurrency(spec, {"CPU": 1.0}) == 1  # one trial waits for capacity
    gpu = spec.model_copy(deep=True)
    gpu.resources.device = "gpu"
    assert default_concurrency(gpu, {"CPU": 64.0, "GPU": 8.0}) == 2
