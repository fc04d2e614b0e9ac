"""The job's run in TensorBoard, MLflow and wandb, each read back with its own library.

`Trackers` is driven directly (no Ray): TensorBoard event files, an MLflow file://
store and a wandb offline run directory carry the series, the events and the
redacted spec; a restarted writer of the same job continues the same runs; a
tracker that fails or stalls is logged once, counted, and never blocks. The
controller's wiring runs against test_controller's fake group. wandb starts processes
of its own (its service, git): its runs are read back in test_trackers_procs.py.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from conftest import tensorboard_run
from spotline.config import SpecError, load_spec
from spotline.metrics import trackers as trackers_mod
from spotline.metrics.trackers import Trackers, run_key

pytestmark = pytest.mark.unit

SECRET = "tracker-test-secret-value-0123"


class RecordingMetrics:
    """Stands in for `Metrics`: the counters a test expects, without Ray."""

    def __init__(self) -> None:
        self.incs: list[tuple[str, float, dict[str, Any]]] = []

    def inc(self, name: str, value: float = 1.0, **tags: Any) -> None:
        self.incs.append((name, value, tags))

    def count(self, name: str, **tags: Any) -> float:
        return sum(v for n, v, t in self.incs if n == name and t == tags)


@pytest.fixture(autouse=True)
def _hermetic_trackers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # wandb keeps settings and caches under $HOME; MLflow's file-store opt-out is left as
    # the test found it (Trackers sets it for file:// URIs).
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "set-by-test")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")


def _spec(tmp_path: Path, *tracking: dict[str, Any], name: str = "tracked", uri: str = "ckpt"):
    return load_spec(
        {
            "name": name,
            "checkpoint": {
                "uri": f"file://{tmp_path}/{uri}",
                "storage_options": {"secret": SECRET},
            },
            "train": {"steps": 30, "log_every": 10},
            "tracking": list(tracking),
        }
    )


def _tb(tmp_path: Path) -> dict[str, Any]:
    return {"kind": "tensorboard", "dir": str(tmp_path / "tb")}


def _mlflow(tmp_path: Path, uri: str | None = None) -> dict[str, Any]:
    return {
        "kind": "mlflow",
        "tracking_uri": uri or f"file://{tmp_path}/mlruns",
        "experiment": "spotline-tests",
    }


def _wandb(tmp_path: Path) -> dict[str, Any]:
    return {"kind": "wandb", "project": "spotline-tests", "dir": str(tmp_path / "wandb")}


def _write_a_job(spec, resumed_step=None, steps=(10, 20, 30), loss=lambda s: 5.0 / s, **kw):
    """What the controller sends over a job: the spec, figures at log_every steps, an
    eval of an earlier checkpoint after a later step, a commit, the end."""
    t = Trackers(spec, spec.resolved_checkpoint_uri(), **kw)
    t.event(resumed_step or 0, "start", "starting 2 replica(s) x 2 stage(s) = 4 workers")
    t.start(spec.model_dump(mode="json"), resumed_step)
    for s in steps:
        t.metrics(s, {"train/loss": loss(s), "train/lr": 1e-3, "train/mfu": None})
        t.event(s, "checkpoint", f"committed step {s}")
    t.metrics(steps[0], {"eval/loss": 4.5})
    # Everything is written before this returns (the job's own 30 s bound is for a
    # server that hangs; a busy test host may need longer to start wandb's service).
    t.close("finished", timeout_s=180)
    assert not any(lane.thread and lane.thread.is_alive() for lane in t._lanes)
    return t


def _mlflow_run(tmp_path: Path, key: str, uri: str | None = None):
    from mlflow import MlflowClient

    client = MlflowClient(uri or f"file://{tmp_path}/mlruns")
    exp = client.get_experiment_by_name("spotline-tests")
    runs = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.`spotline.run_key` = '{key}'"
    )
    return client, runs


# --- what each tracker holds ----------------------------------------------------------


def test_tensorboard_holds_the_series_events_and_the_redacted_spec(tmp_path):
    spec = _spec(tmp_path, _tb(tmp_path))
    t = _write_a_job(spec)
    assert t.summary()[0]["errors"] == 0
    scalars, texts = tensorboard_run(tmp_path / "tb" / "tracked")
    assert scalars["train/loss"] == [(10, 0.5), (20, 0.25), (30, pytest.approx(5 / 30))]
    assert [s for s, _ in scalars["train/lr"]] == [10, 20, 30]
    assert "train/mfu" not in scalars  # None values are left out
    assert scalars["eval/loss"] == [(10, 4.5)]
    assert texts["events/checkpoint"] == [(s, f"committed step {s}") for s in (10, 20, 30)]
    assert texts["events/start"] == [(0, "starting 2 replica(s) x 2 stage(s) = 4 workers")]
    ((_, spec_text),) = texts["spotline/spec"]
    assert "| train.log_every | 10 |" in spec_text
    assert "| checkpoint.storage_options.secret | *** |" in spec_text
    assert SECRET not in spec_text


def test_mlflow_file_store_holds_params_metrics_and_events(tmp_path):
    spec = _spec(tmp_path, _mlflow(tmp_path))
    t = _write_a_job(spec)
    assert t.summary()[0]["errors"] == 0
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"  # set for the file:// URI
    _assert_mlflow_run(tmp_path, *_mlflow_run(tmp_path, t.key))


def test_mlflow_sqlite_store_is_read_back_by_mlflow_as_it_comes(tmp_path, monkeypatch):
    """The store MLflow recommends: read back with no file-store opt-out, and the run's
    artifacts beside the database, not in the working directory of the writer."""
    from spotline.preflight import check_trackers

    cwd = tmp_path / "controller-cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    spec = _spec(tmp_path, _mlflow(tmp_path, f"sqlite:///{tmp_path}/mlflow.db"))
    check_trackers(spec)
    t = _write_a_job(spec)
    assert t.summary()[0]["errors"] == 0
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    _assert_mlflow_run(tmp_path, *_mlflow_run(tmp_path, t.key, uri))
    assert (tmp_path / "mlartifacts").is_dir() and not any(cwd.iterdir())


def test_a_relative_sqlite_store_is_where_the_job_was_started(tmp_path, monkeypatch):
    from spotline.preflight import check_trackers

    monkeypatch.chdir(tmp_path)
    spec = _spec(tmp_path, _mlflow(tmp_path, "sqlite:///runs/mlflow.db"))
    check_trackers(spec)
    assert spec.tracking[0].tracking_uri == f"sqlite:///{tmp_path}/runs/mlflow.db"


def _assert_mlflow_run(tmp_path: Path, client, runs) -> None:
    (run,) = runs
    run = client.get_run(run.info.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    params = run.data.params
    assert params["train.log_every"] == "10" and params["name"] == "tracked"
    assert params["checkpoint.storage_options.secret"] == "***"
    assert params["model.vocab_size"] == "null"
    assert all(len(v) <= 500 for v in params.values())
    assert SECRET not in str(params) and SECRET not in str(run.data.tags)
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(10, 0.5), (20, 0.25), (30, 5 / 30)]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/loss")] == [10]
    assert run.data.tags["spotline.event.checkpoint"] == "step 30: committed step 30"
    events = client.download_artifacts(run.info.run_id, "spotline/events.txt", str(tmp_path))
    assert Path(events).read_text().splitlines()[-1] == "step 30 checkpoint: committed step 30"
    spec_json = client.download_artifacts(run.info.run_id, "spotline/spec.json", str(tmp_path))
    assert SECRET not in Path(spec_json).read_text()


# --- failures never reach training ----------------------------------------------------


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_tracker_is_logged_once_counted_and_the_others_write(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    down = _mlflow(tmp_path, f"http://127.0.0.1:{_closed_port()}")
    spec = _spec(tmp_path, down, _tb(tmp_path))
    warnings: list[str] = []
    metrics = RecordingMetrics()
    t = _write_a_job(spec, metrics=metrics, warn=warnings.append)
    mlflow, tb = t.summary()
    assert tb["errors"] == 0 and mlflow["errors"] >= 1
    assert metrics.count("spotline_tracker_errors_total", tracker="mlflow") == mlflow["errors"]
    (line,) = warnings  # once, however many calls failed
    assert line.startswith(f"tracking[0] (mlflow {down['tracking_uri']}) could not start the run")
    assert "Training goes on" in line
    assert "\n" not in line
    assert tensorboard_run(tmp_path / "tb" / "tracked")[0]["train/loss"][-1][0] == 30


class _Stuck:
    """A tracker whose server hangs: every call waits until the test lets it go (or a
    minute passes), and counts when it comes back."""

    kind = "tensorboard"
    where = "a server that hangs"
    release = threading.Event()
    returned = 0

    def __init__(self, *args: Any) -> None:
        pass

    def open(self, params, resumed_step):
        pass

    def _hang(self) -> None:
        self.release.wait(60)
        type(self).returned += 1

    def metrics(self, step, values):
        self._hang()

    def event(self, step, kind, text):
        self._hang()

    def close(self, status):
        self._hang()


def test_a_stuck_tracker_drops_updates_and_never_blocks(tmp_path, monkeypatch):
    monkeypatch.setitem(trackers_mod._KINDS, "tensorboard", _Stuck)
    _Stuck.release.clear()
    _Stuck.returned = 0
    warnings: list[str] = []
    metrics = RecordingMetrics()
    spec = _spec(tmp_path, _tb(tmp_path))
    t = Trackers(spec, "file:///x", metrics, warn=warnings.append, queue_size=4)
    t.start({}, None)
    for s in range(1, 201):
        t.metrics(s, {"train/loss": 1.0})
    # Every update came back while no call of the tracker had: nothing waited for it.
    assert _Stuck.returned == 0
    dropped = t.summary()[0]["dropped"]
    assert 190 <= dropped <= 196  # the queue's 4, and the one call in flight, went through
    assert metrics.count("spotline_tracker_dropped_total", tracker="tensorboard") == dropped
    assert len([w for w in warnings if "is slow" in w]) == 1
    t.close("finished", timeout_s=0.5)
    # The job's end waited its bound, not for the tracker, which still holds its call.
    assert _Stuck.returned == 0
    assert any("did not finish writing within" in w for w in warnings)
    _Stuck.release.set()
    t.metrics(201, {"train/loss": 1.0})  # after close: ignored, no error


def test_a_tracker_that_raises_never_raises_into_the_caller(tmp_path, monkeypatch):
    class Broken(_Stuck):
        def open(self, params, resumed_step):
            raise OSError(f"disk full writing {SECRET}")

    monkeypatch.setitem(trackers_mod._KINDS, "tensorboard", Broken)
    warnings: list[str] = []
    spec = _spec(tmp_path, _tb(tmp_path))
    t = _write_a_job(spec, warn=warnings.append)
    (line,) = warnings
    assert "OSError: disk full" in line and SECRET not in line
    # The open is tried at the start, and again before each of the 8 updates.
    assert t.summary()[0]["errors"] == 1 + 8


def test_no_trackers_start_no_threads(tmp_path):
    spec = _spec(tmp_path)
    before = threading.active_count()
    t = _write_a_job(spec)
    assert not t and t.summary() == [] and threading.active_count() == before


# --- the spec -------------------------------------------------------------------------


def _spec_error(tracking: list[Any]) -> str:
    with pytest.raises(SpecError) as ei:
        load_spec({"tracking": tracking})
    return str(ei.value)


def test_an_unknown_tracker_kind_names_the_field_and_the_choices():
    msg = _spec_error([{"kind": "tensorboard", "dir": "x"}, {"kind": "foo"}])
    assert msg.endswith(
        "tracking[1].kind: unknown tracker 'foo'; choose tensorboard, mlflow or wandb"
    )
    assert "tracking[0].kind is required; choose" in _spec_error([{"dir": "x"}])


@pytest.mark.parametrize(
    ("entry", "env"),
    [
        ({"kind": "wandb", "project": "p", "api_key": SECRET}, "WANDB_API_KEY"),
        (
            {"kind": "mlflow", "tracking_uri": "http://h:5000", "experiment": "e", "token": SECRET},
            "MLFLOW_TRACKING_TOKEN",
        ),
    ],
)
def test_credentials_in_the_spec_are_refused_with_the_variable_to_set(entry, env):
    key = next(k for k in entry if k in ("api_key", "token"))
    msg = _spec_error([entry])
    assert f"tracking[0].{key}: credentials are never read from the spec" in msg
    assert env in msg and SECRET not in msg


def test_a_user_and_password_in_the_mlflow_uri_are_refused():
    entry = {"kind": "mlflow", "tracking_uri": f"https://me:{SECRET}@h", "experiment": "e"}
    msg = _spec_error([entry])
    assert "tracking[0].tracking_uri: must not hold a user or password" in msg
    assert "MLFLOW_TRACKING_PASSWORD" in msg and SECRET not in msg


def test_a_missing_tracker_package_fails_the_preflight(tmp_path, monkeypatch):
    from spotline import preflight

    spec = _spec(tmp_path, _tb(tmp_path), _mlflow(tmp_path))
    monkeypatch.setattr(preflight, "package_installed", lambda name: name != "mlflow")
    with pytest.raises(SpecError) as ei:
        preflight.check_offline(spec)
    assert str(ei.value) == (
        "tracking[1] (mlflow) needs the mlflow package: pip install 'spotline[tracking]'"
    )


def test_the_preflight_takes_tracker_dirs_from_where_the_job_starts(tmp_path, monkeypatch):
    from spotline.preflight import check_trackers

    monkeypatch.chdir(tmp_path)
    spec = _spec(tmp_path, {"kind": "tensorboard", "dir": "tb"}, _wandb(tmp_path))
    check_trackers(spec)
    assert spec.tracking[0].dir == str(tmp_path / "tb")
    assert spec.tracking[1].dir == str(tmp_path / "wandb")


def test_tracking_is_not_part_of_the_training_math(tmp_path):
    plain = _spec(tmp_path)
    tracked = _spec(tmp_path, _tb(tmp_path), _mlflow(tmp_path), _wandb(tmp_path))
    assert tracked.hashed_fields() == plain.hashed_fields()
    assert tracked.spec_hash() == plain.spec_hash()
    assert tracked.tracking[2].mode == "offline"  # nothing leaves the machine by default


# --- the controller's wiring ----------------------------------------------------------


def test_the_controller_sends_figures_and_events_once_per_step(tmp_path):
    from controller_fakes import FakeGroup, make

    script = {"kill_at": 17, "lose_node": "node-1"}

    def capacity(held, cluster):
        live = sum(g.replicas for g in FakeGroup.instances if not g.shut)
        return len(cluster.nodes & {"node-0", "node-1"}) - live + held // 2

    ctl, _ = make(tmp_path, script=script, capacity=capacity, tracking=[_tb(tmp_path)])
    res = ctl.run()
    assert res["state"] == "finished" and res["node_losses"] == 1
    assert res["tracking"] == [
        {
            "kind": "tensorboard",
            "where": str(tmp_path / "tb" / "ctl"),
            "run_key": run_key("ctl", ctl.store.uri),
            "errors": 0,
            "dropped": 0,
            "last_error": None,
        }
    ]
    scalars, texts = tensorboard_run(tmp_path / "tb" / "ctl")
    # log_every 5: steps 11..17 were trained twice, but each step is sent once.
    assert [s for s, _ in scalars["train/loss"]] == [5, 10, 15, 20, 25]
    assert [s for s, _ in scalars["train/tokens_per_s"]] == [5, 10, 15, 20, 25]
    for tag in ("train/step_s", "train/replicas", "goodput/fraction", "goodput/useful"):
        assert tag in scalars, sorted(scalars)
    assert [s for s, _ in scalars["checkpoint/bytes"]] == [10, 20, 25]
    assert scalars["eval/heldout_loss"][0][0] == 25
    assert [s for s, _ in texts["events/checkpoint"]] == [10, 20, 25]
    assert [text for _, text in texts["events/node_loss"]][0].startswith("lost node(s) node-1")
    assert len(texts["events/start"]) == 2 and len(texts["events/resume"]) == 1
    assert "training again" in texts["events/recovery"][0][1]
    assert texts["events/end"][0][1].startswith("finished 25 steps")


@pytest.mark.parametrize(
    ("script", "over", "state"),
    [
        ({"stop_at_step": 12}, {}, "stopped"),
        ({"kill_at": 12}, {"failure.max_failures": 0}, "failed"),
    ],
)
def test_the_run_is_closed_on_every_end(tmp_path, monkeypatch, script, over, state):
    from controller_fakes import make

    closed: list[str] = []
    real = Trackers.close
    monkeypatch.setattr(
        Trackers, "close", lambda self, s="finished", **kw: closed.append(s) or real(self, s, **kw)
    )
    ctl, _ = make(tmp_path, script=script, tracking=[_tb(tmp_path)], **over)
    assert ctl.run()["state"] == state
    assert closed == [state]
    _, texts = tensorboard_run(tmp_path / "tb" / "ctl")
    (end,) = texts["events/end"]
    assert end[1].startswith("stopped at step" if state == "stopped" else "FAILED:")
