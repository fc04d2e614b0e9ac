"""The `tracking:` section: trackers chosen by kind, credentials from the environment only,
a missing package caught by the preflight, and nothing of it in the training math."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from spotline.config import SpecError, load_spec

pytestmark = pytest.mark.unit

SECRET = "tracker-test-secret-value-0123"


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
