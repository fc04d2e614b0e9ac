"""The `tracking` section of a job spec: the experiment trackers the job's run appears in.

Each entry is one tracker, chosen by `kind` ('tensorboard', 'mlflow', 'wandb'). The
controller writes one run per job into each (never one per rank), and a restarted
controller of the same job continues that run. The section changes nothing in the
training math, so it is not part of the spec hash.

Credentials never come from the spec: each tracker reads its own environment
variables (MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_USERNAME/PASSWORD, WANDB_API_KEY),
and a credential-looking key here is refused with the variable to set instead.
"""

from __future__ import annotations

import urllib.parse
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from spotline.config.urls import refuse_credentials


class _Tracker(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    package: ClassVar[str]
    """The module the tracker needs (the preflight checks it is installed)."""
    credentials_env: ClassVar[str]
    """Where its credentials come from, for the message that refuses them in the spec."""


class TensorBoardTrackerSpec(_Tracker):
    """TensorBoard event files on a local (or mounted) disk of the head node."""

    package: ClassVar[str] = "tensorboard"
    credentials_env: ClassVar[str] = "the filesystem's own permissions (TensorBoard takes none)"

    kind: Literal["tensorboard"] = "tensorboard"
    dir: str
    """Directory of the runs on the head node: this job's goes under dir/<name>; point
    `tensorboard --logdir` at dir. A relative path is taken from where the job starts."""


class MlflowTrackerSpec(_Tracker):
    """An MLflow tracking server, or a local store: sqlite:///path.db (what MLflow
    recommends; run artifacts go to `mlartifacts` beside it) or file:///path/mlruns (in
    maintenance mode: MLflow reads it back only with MLFLOW_ALLOW_FILE_STORE=true)."""

    package: ClassVar[str] = "mlflow"
    credentials_env: ClassVar[str] = (
        "the environment: MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and "
        "MLFLOW_TRACKING_PASSWORD"
    )

    kind: Literal["mlflow"] = "mlflow"
    tracking_uri: str
    """http(s)://host:port of a tracking server, sqlite:////abs/path/mlflow.db (a path
    relative to where the job is started: sqlite:///mlflow.db), or file:///path/mlruns."""
    experiment: str = Field(min_length=1)
    """Experiment the run goes into; created when it does not exist yet."""

    @field_validator("tracking_uri")
    @classmethod
    def _no_credentials_in_uri(cls, v: str) -> str:
        refuse_credentials(
            v,
            None,
            "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
            "MLFLOW_TRACKING_TOKEN) in the environment instead",
        )
        parts = urllib.parse.urlsplit(v)
        if parts.scheme not in ("http", "https", "sqlite", "file", "databricks"):
            raise ValueError(
                f"{v!r} must be http(s)://host:port of a tracking server, "
                "sqlite:////path/mlflow.db or file:///path/mlruns"
            )
        return v


class WandbTrackerSpec(_Tracker):
    """Weights & Biases: offline by default (`wandb sync` uploads the run later)."""

    package: ClassVar[str] = "wandb"
    credentials_env: ClassVar[str] = "the environment: WANDB_API_KEY (or `wandb login`)"

    kind: Literal["wandb"] = "wandb"
    project: str = Field(min_length=1)
    entity: str | None = None
    """Team or user the project belongs to; None: the API key's default entity."""
    mode: Literal["offline", "online"] = "offline"
    """'offline' writes the run to disk only; 'online' streams it to the W&B server."""
    dir: str | None = None
    """Where wandb writes its run directories (dir/wandb/offline-run-...) on the head
    node; a relative path is taken from where the job starts. None: wandb's default (the
    controller's working directory, or WANDB_DIR)."""


TRACKER_KINDS = ("tensorboard", "mlflow", "wandb")

TrackerSpec = Annotated[
    TensorBoardTrackerSpec | MlflowTrackerSpec | WandbTrackerSpec, Field(discriminator="kind")
]
"""One entry of `tracking:`, chosen by `kind`."""


def check_kinds(raw: Any) -> Any:
    """Refuse a missing or unknown `kind` in the raw list, in the spec's own words (before
    pydantic, whose union message names neither the field nor the choices)."""
    if not isinstance(raw, list):
        return raw
    choices = "choose tensorboard, mlflow or wandb"
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict) and not isinstance(entry, _Tracker):
            raise ValueError(
                f"tracking[{i}] must be a mapping such as {{kind: tensorboard, dir: ./tb}} "
                f"(got {type(entry).__name__})"
            )
        kind = entry.get("kind") if isinstance(entry, dict) else entry.kind
        if kind is None:
            raise ValueError(f"tracking[{i}].kind is required; {choices}")
        if kind not in TRACKER_KINDS:
            raise ValueError(f"tracking[{i}].kind: unknown tracker {kind!r}; {choices}")
    return raw
