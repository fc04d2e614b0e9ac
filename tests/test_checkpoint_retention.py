"""Retention (checkpoint.keep_last), which only the commit coordinator applies: the
newest steps stay, a pinned step outlives keep_last, abandoned uploads go and one that
may still be running stays. On file://; test_s3_store.py runs it on S3. No Ray.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from spotline.checkpoint import CheckpointStore
from spotline.checkpoint.catalog import Steps
from spotline.checkpoint.retention import apply_retention, plan_retention
from test_checkpoint_store import make_staging, save_step

pytestmark = pytest.mark.unit


def _root(store: CheckpointStore) -> Path:
    assert store.uri.startswith("file://")
    return Path(store.uri[len("file://") :])


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(f"file://{tmp_path}/ckpt")


# --- retention -------------------------------------------------------------------------


def test_retention_keeps_last_k_and_removes_abandoned_but_not_in_flight(
    store: CheckpointStore, tmp_path: Path
) -> None:
    for step in (100, 200, 300, 400):
        save_step(store, step, tmp_path)
    store.upload_dir(make_staging(tmp_path / "p150", 150), 150)  # abandoned partial
    store.upload_dir(make_staging(tmp_path / "p500", 500), 500)  # still uploading
    deleted = apply_retention(store, keep_last=2)
    assert deleted == [100, 150, 200]
    assert store.committed_steps() == [300, 400]
    assert sorted(p.name for p in _root(store).iterdir()) == [
        "step_00000300",
        "step_00000400",
        "step_00000500",
    ]
    assert apply_retention(store, keep_last=2) == []


def test_retention_keeps_pinned_steps_past_keep_last(
    store: CheckpointStore, tmp_path: Path
) -> None:
    for step in (100, 200, 300):
        save_step(store, step, tmp_path)
    assert apply_retention(store, keep_last=1, pinned={100}) == [200]
    assert store.committed_steps() == [100, 300]
    assert store.load_manifest(100).step == 100
    assert apply_retention(store, keep_last=1) == [100]
    assert store.committed_steps() == [300]


def test_retention_with_nothing_committed_deletes_nothing(
    store: CheckpointStore, tmp_path: Path
) -> None:
    store.upload_dir(make_staging(tmp_path / "p", 50), 50)
    assert apply_retention(store, keep_last=1) == []
    assert (_root(store) / "step_00000050").is_dir()


def test_retention_needs_keep_last_of_at_least_one(store: CheckpointStore) -> None:
    with pytest.raises(ValueError, match="keep_last"):
        apply_retention(store, 0)


def test_the_plan_spares_in_flight_pinned_damaged_and_quarantined_steps() -> None:
    steps = Steps(
        committed=[100, 200, 300, 400],
        damaged={350: "manifest is not valid JSON", 900: "manifest is not signed"},
        quarantined=[250],
        uncommitted=[150, 500],
    )
    assert plan_retention(steps, 2, {100}) == ([200], [150])
    assert plan_retention(Steps(uncommitted=[5], damaged={9: "bad"}), 1) == ([], [])
    with pytest.raises(ValueError, match="keep_last"):
        plan_retention(steps, 0)
