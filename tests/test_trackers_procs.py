"""The job's run in wandb, read back with its own library: an offline run directory
carries the series, the events and the redacted spec, and a restarted writer of the
same job continues the same run. wandb starts processes of its own (its service, git);
the other trackers are in test_trackers.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import tensorboard_run, wandb_run
from spotline.metrics.trackers import run_key
from test_trackers import (  # noqa: F401 - _hermetic_trackers: its autouse fixture
    SECRET,
    _hermetic_trackers,
    _mlflow,
    _mlflow_run,
    _spec,
    _tb,
    _wandb,
    _write_a_job,
)

pytestmark = pytest.mark.procs


def _wandb_dirs(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "wandb" / "wandb").glob("offline-run-*"))


def test_wandb_offline_run_holds_config_history_and_events(tmp_path):
    spec = _spec(tmp_path, _wandb(tmp_path))
    t = _write_a_job(spec)
    assert t.summary()[0]["errors"] == 0
    (run_dir,) = _wandb_dirs(tmp_path)
    run = wandb_run(run_dir)
    assert run["id"] == t.key and run["exit_code"] == 0
    assert run["config"]["train"]["log_every"] == 10
    assert run["config"]["checkpoint"]["storage_options"] == {"secret": "***"}
    losses = [(r["step"], r["train/loss"]) for r in run["history"] if "train/loss" in r]
    assert losses == [(10, 0.5), (20, 0.25), (30, 5 / 30)]
    # An eval of step 10's weights, sent after step 30: plotted at step 10 all the same.
    assert [(r["step"], r["eval/loss"]) for r in run["history"] if "eval/loss" in r] == [(10, 4.5)]
    commits = [r["events/checkpoint"] for r in run["history"] if "events/checkpoint" in r]
    assert commits == [f"committed step {s}" for s in (10, 20, 30)]
    assert SECRET not in (run_dir / f"run-{t.key}.wandb").read_bytes().decode("latin-1")


def test_a_restarted_writer_continues_the_same_runs(tmp_path):
    spec = _spec(tmp_path, _tb(tmp_path), _mlflow(tmp_path), _wandb(tmp_path))
    first = _write_a_job(spec)
    # A new controller of the same job resumes from step 20: step 30 is trained again
    # (its loss differs here, to show which one TensorBoard keeps).
    again = _write_a_job(spec, resumed_step=20, steps=(30,), loss=lambda s: 0.125)
    assert again.key == first.key == run_key("tracked", f"file://{tmp_path}/ckpt")
    assert [s["errors"] for s in again.summary()] == [0, 0, 0]
    scalars, _ = tensorboard_run(tmp_path / "tb" / "tracked")
    assert scalars["train/loss"] == [(10, 0.5), (20, 0.25), (30, 0.125)]  # 30 purged, once
    client, runs = _mlflow_run(tmp_path, first.key)
    assert len(runs) == 1  # the same run, found by its run key
    events = client.download_artifacts(runs[0].info.run_id, "spotline/events.txt", str(tmp_path))
    assert len(Path(events).read_text().splitlines()) == 3 + 1 + 2  # both controllers'
    ids = {wandb_run(d)["id"] for d in _wandb_dirs(tmp_path)}
    assert ids == {first.key}  # two offline directories of one run, for `wandb sync`
    # Another checkpoint URI is another run of the same job name.
    other = _spec(tmp_path, _mlflow(tmp_path), uri="elsewhere")
    assert _write_a_job(other).key != first.key
    assert len(_mlflow_run(tmp_path, first.key)[1]) == 1
