"""The job's run in the experiment trackers people already use: TensorBoard, MLflow, wandb.

One writer per job, in the controller (never one per rank): the `tracking:` section
names the trackers, `Trackers` writes the run into each. What must never happen
here: a tracker stopping or slowing training. So every tracker gets its own
background thread and a bounded queue (a slow MLflow server does not hold up the
TensorBoard files either); a full queue drops the update and counts it
(spotline_tracker_dropped_total), it never waits. A tracker that raises (server down,
disk full) is logged once, in one line, and counted
(spotline_tracker_errors_total{tracker}); its later calls are still tried, and
nothing ever leaves this module as an exception.

A restarted controller of the same job (same name, same checkpoint URI) continues
the same run: `run_key` is stable for the pair and is the wandb run id, the MLflow
tag `spotline.run_key` searched for on start, and TensorBoard writes to the same
directory, purging the steps the resumed job trains again.

The tracker packages are imported inside their tracker, on its thread: Spotline
imports without them, and the preflight says which one is missing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import re
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spotline import constants
from spotline.config.identity import flatten_dotted
from spotline.config.redact import redact
from spotline.config.schema import JobSpec
from spotline.config.tracking import (
    MlflowTrackerSpec,
    TensorBoardTrackerSpec,
    WandbTrackerSpec,
)
from spotline.metrics.prometheus import Metrics

log = logging.getLogger("spotline.trackers")

RUN_KEY_TAG = "spotline.run_key"
STEP_KEY = "step"
"""wandb: the x-axis of every series (results may arrive after later steps)."""
# Older MLflow servers cap a parameter's value at 500 characters (newer ones at 6000);
# the whole spec is in the run's spotline/spec.json artifact anyway.
_MLFLOW_PARAM_CHARS = 500
_MLFLOW_TAG_CHARS = 5000
_MLFLOW_BATCH = 100  # params or tags per log_batch call
_MLFLOW_STATUS = {"finished": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}
_MLFLOW_KEY_RE = re.compile(r"[^\w.\- :/]")  # what MLflow allows in a key
_ERROR_CHARS = 300


def run_key(job: str, checkpoint_uri: str) -> str:
    """The run's identity in every tracker: the same for every controller of one job."""
    return hashlib.sha256(f"{job}\n{checkpoint_uri}".encode()).hexdigest()[:16]


def flat_params(params: dict[str, Any]) -> dict[str, str]:
    """The (redacted) spec as dotted keys and string values: lists and None as JSON."""
    out = {}
    for k, v in flatten_dotted(redact(params)).items():
        out[k] = v if isinstance(v, str) else json.dumps(v, default=str)
    return out


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return _truncate(redact(f"{type(e).__name__}: {text}"), _ERROR_CHARS)


# --- the trackers -------------------------------------------------------------------
# Each is driven by one thread only (its lane's): no locks inside.


class _TensorBoard:
    kind = "tensorboard"

    def __init__(self, spec: TensorBoardTrackerSpec, job: str, key: str):
        self.dir = Path(os.path.expanduser(spec.dir)) / job
        self.key = key
        self.where = str(self.dir)
        self.w: Any = None

    def open(self, params: dict[str, Any], resumed_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.dir.mkdir(parents=True, exist_ok=True)
        first = (resumed_step or 0) + 1
        # purge_step: TensorBoard hides what this directory holds from `first` on (the
        # steps a resumed job trains again, or all of an earlier run started afresh).
        self.w = SummaryWriter(log_dir=str(self.dir), purge_step=first, flush_secs=30)
        rows = "\n".join(f"| {k} | {v} |" for k, v in sorted(flat_params(params).items()))
        self.w.add_text("spotline/spec", f"| field | value |\n|---|---|\n{rows}", first - 1)
        self.w.add_text("spotline/run_key", self.key, first - 1)

    def metrics(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.w.add_scalar(k, v, step)

    def event(self, step: int, kind: str, text: str) -> None:
        self.w.add_text(f"events/{kind}", text, step)
        self.w.flush()  # events are rare, and someone may be watching for this one

    def close(self, status: str) -> None:
        self.w.close()


class _Mlflow:
    kind = "mlflow"

    def __init__(self, spec: MlflowTrackerSpec, job: str, key: str):
        self.spec, self.job, self.key = spec, job, key
        self.where = spec.tracking_uri
        self.client: Any = None
        self.run_id: str | None = None
        self.events: list[str] = []
        self._events_dirty = False

    def open(self, params: dict[str, Any], resumed_step: int | None) -> None:
        uri = self.spec.tracking_uri
        if uri.startswith("file:"):
            # MLflow 3 refuses a file store unless this opt-out is set; a file:// URI
            # in the spec is that choice. Remote URIs are left as MLflow wants them.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow import MlflowClient
        from mlflow.entities import Param

        client = MlflowClient(tracking_uri=uri)
        exp = self._experiment(client)
        found = client.search_runs(
            [exp],
            filter_string=f"tags.`{RUN_KEY_TAG}` = '{self.key}'",
            max_results=1,
            order_by=["attributes.start_time DESC"],
        )
        have: dict[str, str] = {}
        if found:
            run = found[0]
            self.run_id = run.info.run_id
            have = dict(run.data.params)
            client.update_run(self.run_id, status="RUNNING")
            self.events = self._stored_events(client)
        else:
            tags = {RUN_KEY_TAG: self.key, "spotline.job": self.job}
            self.run_id = client.create_run(exp, run_name=self.job, tags=tags).info.run_id
        self.client = client
        flat = flat_params(params)
        # Params never change in MLflow: a resumed run keeps the values it started with
        # (spotline/spec.json holds the spec of the latest controller).
        new = [
            Param(_MLFLOW_KEY_RE.sub("_", k), _truncate(v, _MLFLOW_PARAM_CHARS))
            for k, v in sorted(flat.items())
            if _MLFLOW_KEY_RE.sub("_", k) not in have
        ]
        for i in range(0, len(new), _MLFLOW_BATCH):
            client.log_batch(self.run_id, params=new[i : i + _MLFLOW_BATCH])
        client.log_text(self.run_id, json.dumps(redact(params), indent=1), "spotline/spec.json")

    def _experiment(self, client: Any) -> str:
        name = self.spec.experiment
        exp = client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        try:
            return client.create_experiment(
                name, artifact_location=_artifact_root(self.spec.tracking_uri)
            )
        except Exception:  # another job created it in between
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id

    def _stored_events(self, client: Any) -> list[str]:
        """The events an earlier controller of this run wrote (none when absent)."""
        with tempfile.TemporaryDirectory(prefix="spotline-mlflow-") as tmp:
            try:
                path = client.download_artifacts(self.run_id, "spotline/events.txt", tmp)
            except Exception:  # noqa: BLE001 - no events yet
                return []
            return Path(path).read_text().splitlines()

    def metrics(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        batch = [Metric(_MLFLOW_KEY_RE.sub("_", k), v, ms, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def event(self, step: int, kind: str, text: str) -> None:
        # The latest of each kind as a tag (the runs table shows it), all of them in a
        # text artifact.
        self.client.set_tag(
            self.run_id,
            f"spotline.event.{kind}",
            _truncate(f"step {step}: {text}", _MLFLOW_TAG_CHARS),
        )
        self.events.append(f"step {step} {kind}: {text}")
        self._events_dirty = True

    def flush(self) -> None:
        if self._events_dirty:
            self._events_dirty = False
            self.client.log_text(self.run_id, "\n".join(self.events) + "\n", "spotline/events.txt")

    def close(self, status: str) -> None:
        self.flush()
        self.client.set_terminated(self.run_id, status=_MLFLOW_STATUS.get(status, "FINISHED"))


def _artifact_root(tracking_uri: str) -> str | None:
    """Where a new experiment of an sqlite store keeps run artifacts: `mlartifacts`
    beside the database, as `mlflow server` does (MLflow's default, ./mlruns, would be
    the controller's working directory). None: the store's own choice."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    db = Path(tracking_uri.removeprefix("sqlite:///"))
    return (db.parent / "mlartifacts").resolve().as_uri()


class _Wandb:
    kind = "wandb"

    def __init__(self, spec: WandbTrackerSpec, job: str, key: str):
        self.spec, self.job, self.key = spec, job, key
        self.where = f"{spec.mode} project {spec.project}"
        self.run: Any = None

    def open(self, params: dict[str, Any], resumed_step: int | None) -> None:
        import wandb

        s = self.spec
        if s.dir is not None:
            Path(os.path.expanduser(s.dir)).mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(
            silent=True,
            console="off",  # the controller's stdout is Ray's, not wandb's to wrap
            x_disable_stats=True,  # the head node's CPU load is not the job's
            disable_git=True,
            save_code=False,
            reinit="create_new",
        )
        self.run = wandb.init(
            project=s.project,
            entity=s.entity,
            mode=s.mode,
            dir=os.path.expanduser(s.dir) if s.dir else None,
            id=self.key,
            resume="allow",
            name=self.job,
            config=redact(params),
            settings=settings,
        )
        # Every series is plotted against the training step, which an eval result of an
        # earlier checkpoint may go back to (wandb's own step only counts up).
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self.run.log({**values, STEP_KEY: step})

    def event(self, step: int, kind: str, text: str) -> None:
        self.run.log({f"events/{kind}": text, STEP_KEY: step})

    def close(self, status: str) -> None:
        self.run.finish(exit_code=1 if status == "failed" else 0)


_KINDS: dict[str, Callable[..., Any]] = {
    "tensorboard": _TensorBoard,
    "mlflow": _Mlflow,
    "wandb": _Wandb,
}

# --- one lane per tracker ------------------------------------------------------------

_CLOSE = object()


class _Lane:
    """One tracker, its queue, and the thread that drives it."""

    def __init__(self, index: int, tracker: Any, metrics: Metrics | None, warn, size: int):
        self.tracker = tracker
        self.label = f"tracking[{index}] ({tracker.kind} {tracker.where})"
        self.metrics = metrics
        self.warn = warn
        self.q: queue.Queue = queue.Queue(maxsize=max(1, size))
        self.thread: threading.Thread | None = None
        self.opened = False
        self.errors = 0
        self.dropped = 0
        self.last_error: str | None = None
        self._warned_error = False
        self._warned_drop = False
        self._open_args: tuple[dict[str, Any], int | None] | None = None
        self.status = "finished"  # how the run ends: set by close, read by the thread

    def start(self, params: dict[str, Any], resumed_step: int | None) -> None:
        self._open_args = (params, resumed_step)
        self.thread = threading.Thread(
            target=self._loop, name=f"spotline-tracker-{self.tracker.kind}", daemon=True
        )
        self.thread.start()

    def put(self, item: tuple) -> None:
        try:
            self.q.put_nowait(item)
        except queue.Full:
            self.dropped += 1
            if self.metrics is not None:
                self.metrics.inc("spotline_tracker_dropped_total", tracker=self.tracker.kind)
            if not self._warned_drop:
                self._warned_drop = True
                self.warn(
                    f"{self.label} is slow: {self.q.maxsize} updates are waiting for it, so "
                    "new ones are dropped until it catches up; training goes on"
                )

    def _loop(self) -> None:
        self._ensure_open()
        while True:
            item = self.q.get()
            if item is _CLOSE:
                break
            name, *args = item
            if self._ensure_open():
                self._call(name, getattr(self.tracker, name), *args)
            if self.q.empty() and self.opened and hasattr(self.tracker, "flush"):
                self._call("flush", self.tracker.flush)
        if self.opened:
            self._call("close the run", self.tracker.close, self.status)

    def _ensure_open(self) -> bool:
        if not self.opened:
            assert self._open_args is not None
            self.opened = self._call("start the run", self.tracker.open, *self._open_args)
        return self.opened

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> bool:
        try:
            fn(*args)
            return True
        except Exception as e:  # noqa: BLE001 - a tracker must never stop a job
            self.errors += 1
            self.last_error = _one_line(e)
            if self.metrics is not None:
                self.metrics.inc("spotline_tracker_errors_total", tracker=self.tracker.kind)
            if not self._warned_error:
                self._warned_error = True
                self.warn(
                    f"{self.label} could not {what}: {self.last_error}. Training goes on; "
                    "later updates are still sent to it (further errors are only counted)"
                )
            return False

    def close(self, status: str, deadline: float) -> bool:
        """Ask the thread to write what it holds and close the run; True when it did
        within the deadline."""
        self.status = status
        if self.thread is None:
            return True
        try:
            self.q.put(_CLOSE, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            return False
        self.thread.join(max(0.0, deadline - time.monotonic()))
        return not self.thread.is_alive()


class Trackers:
    """The job's run in every tracker of `spec.tracking`. Never raises, never blocks
    (but `close`, for at most SPOTLINE_TRACKER_CLOSE_TIMEOUT_S)."""

    def __init__(
        self,
        spec: JobSpec,
        checkpoint_uri: str,
        metrics: Metrics | None = None,
        warn: Callable[[str], None] | None = None,
        queue_size: int | None = None,
    ):
        self.key = run_key(spec.name, checkpoint_uri)
        self._warn = warn or (lambda text: log.warning(text))
        size = constants.SPOTLINE_TRACKER_QUEUE_SIZE if queue_size is None else queue_size
        self._lanes: list[_Lane] = []
        for i, t in enumerate(spec.tracking):
            try:
                tracker = _KINDS[t.kind](t, spec.name, self.key)
            except Exception as e:  # noqa: BLE001 - a tracker must never stop a job
                self._warn(f"tracking[{i}] ({t.kind}) is left out: {_one_line(e)}")
                continue
            self._lanes.append(_Lane(i, tracker, metrics, self._safe_warn, size))
        self.started = False
        self.closed = False

    def _safe_warn(self, text: str) -> None:
        with contextlib.suppress(Exception):
            self._warn(redact(text))

    def __bool__(self) -> bool:
        return bool(self._lanes)

    def start(self, params: dict[str, Any], resumed_step: int | None = None) -> None:
        """Open (or continue) the run in every tracker; `params`: the resolved spec
        (redacted here again), `resumed_step`: the committed step the job resumed from.
        What was sent before this is written after it."""
        if self.started or self.closed:
            return
        self.started = True
        for lane in self._lanes:
            lane.start(redact(params), resumed_step)

    def metrics(self, step: int, values: dict[str, float | None]) -> None:
        """Figures at training step `step`; None values are left out."""
        clean = {k: float(v) for k, v in values.items() if v is not None}
        if clean and not self.closed:
            for lane in self._lanes:
                lane.put(("metrics", int(step), clean))

    def event(self, step: int, kind: str, text: str) -> None:
        """Something that happened at `step` (a commit, a notice, a restart)."""
        if not self.closed:
            for lane in self._lanes:
                lane.put(("event", int(step), kind, redact(text)))

    def close(self, status: str = "finished", timeout_s: float | None = None) -> None:
        """End the run in every tracker ('finished', 'failed' or 'stopped'), waiting at
        most `timeout_s` for what they still hold. Idempotent."""
        if self.closed:
            return
        self.closed = True
        wait = constants.SPOTLINE_TRACKER_CLOSE_TIMEOUT_S if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait
        for lane in self._lanes:
            if not lane.close(status, deadline):
                self._safe_warn(
                    f"{lane.label} did not finish writing within {wait:.0f}s "
                    "(SPOTLINE_TRACKER_CLOSE_TIMEOUT_S); its last updates may be missing"
                )

    def summary(self) -> list[dict[str, Any]]:
        """Per tracker: kind, run key, errors and dropped updates so far, last error."""
        return [
            {
                "kind": lane.tracker.kind,
                "where": redact(lane.tracker.where),
                "run_key": self.key,
                "errors": lane.errors,
                "dropped": lane.dropped,
                "last_error": lane.last_error,
            }
            for lane in self._lanes
        ]
