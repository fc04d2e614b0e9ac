"""Trackers on a real job: an MLflow server that is down changes nothing in training.

The reference job's exact spec runs with two trackers: TensorBoard, and MLflow at a
port nobody listens on. Its per-step losses must equal the tracker-free reference
run's, bit for bit; the MLflow failure is one line among the job's events and is
counted; the TensorBoard event files carry the job's series and events.
"""

from __future__ import annotations

import io
import socket

import numpy as np
import pytest

import spotline
from conftest import tensorboard_run, tiny_spec

pytestmark = pytest.mark.ray


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tracked(reference_run, tmp_path_factory):
    ref_spec, ref, _ = reference_run
    tmp = tmp_path_factory.mktemp("tracked")
    down = f"http://127.0.0.1:{_closed_port()}"
    tracking = [
        {"kind": "tensorboard", "dir": str(tmp / "tb")},
        {"kind": "mlflow", "tracking_uri": down, "experiment": "spotline-tests"},
    ]
    spec = tiny_spec(tmp, "tracked", tracking=tracking)
    assert spec.spec_hash() == ref_spec.spec_hash()  # trackers are not part of the math
    out = io.StringIO()
    result = spotline.Job(spec).start().wait(verbose=True, out=out)
    return spec, result, ref, tmp, down, out.getvalue()


def test_a_tracker_that_is_down_leaves_training_untouched(tracked):
    _, result, ref, _, down, events = tracked
    assert result.state == "finished"
    assert result.losses == ref.losses  # exactly
    assert result.heldout_loss == ref.heldout_loss
    tb, mlflow = result.tracking
    assert tb["errors"] == 0 and tb["dropped"] == 0
    assert mlflow["errors"] >= 1 and mlflow["where"] == down
    failures = [line for line in events.splitlines() if "tracking[1] (mlflow" in line]
    assert len(failures) == 1, failures  # logged once, however many calls failed
    assert "could not start the run" in failures[0] and "Training goes on" in failures[0]


def test_tensorboard_carries_the_real_jobs_series_and_events(tracked):
    spec, result, ref, tmp, _, _ = tracked
    scalars, texts = tensorboard_run(tmp / "tb" / "tracked")
    # log_every 10 over 30 steps; TensorBoard stores float32.
    assert scalars["train/loss"] == [(s, np.float32(ref.losses[s])) for s in (10, 20, 30)]
    for tag in ("train/tokens_per_s", "train/step_s", "pipeline/bubble_fraction"):
        assert [s for s, _ in scalars[tag]] == [10, 20, 30], tag
    assert all(v > 0 for _, v in scalars["train/tokens_per_s"])
    assert 0 < scalars["goodput/fraction"][-1][1] <= 1
    assert scalars["eval/heldout_loss"] == [(30, np.float32(result.heldout_loss))]
    assert [s for s, _ in texts["events/checkpoint"]] == result.committed_steps == [10, 20, 30]
    assert texts["events/start"][0][1].startswith("starting 2 replica(s) x 2 stage(s)")
    assert texts["events/end"][0][1].startswith("finished 30 steps")
    ((_, spec_text),) = texts["spotline/spec"]
    assert "| name | tracked |" in spec_text
