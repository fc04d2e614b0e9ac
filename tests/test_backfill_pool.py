"""The backfill pool's hold on checkpoints: retention must keep what a task will read."""

from __future__ import annotations

import time

import pytest

from conftest import tiny_spec
from spotline.backfill.pool import BackfillPool
from spotline.checkpoint import Manifest

pytestmark = pytest.mark.unit


class _Method:
    def __init__(self, calls: list, name: str):
        self.calls, self.name = calls, name

    def remote(self, *args):
        self.calls.append((self.name, args))
        return object()  # an object ref stand-in: the pool only keys on it


class FakeExecutor:
    def __init__(self):
        self.calls: list = []
        self.run = _Method(self.calls, "run")
        self.configure = _Method(self.calls, "configure")
        self.stats = _Method(self.calls, "stats")


def manifest(step: int) -> Manifest:
    return Manifest(step, [], {"replicas": 1}, {"next_step": step + 1}, "h", time.time())


def test_queued_and_running_tasks_pin_their_step_until_done(tmp_path):
    pool = BackfillPool(tiny_spec(tmp_path, "pins"))
    tid = pool.submit({"kind": "eval", "batches": 1})
    assert pool.pinned_steps() == set()  # no weights chosen yet
    pool.on_commit(manifest(5))
    assert pool.pinned_steps() == set()  # still queued, not bound to a step
    ex = FakeExecutor()
    pool.attach([ex])
    pool._dispatch()
    assert pool.records[tid].state == "running"
    assert pool.pinned_steps() == {5}
    pool.on_commit(manifest(10))  # a newer commit does not release the step in use
    assert pool.pinned_steps() == {5}
    pool.records[tid].state = "done"
    assert pool.pinned_steps() == set()
