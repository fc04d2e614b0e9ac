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


def _spec_with_tasks(tmp_path, name):
    return tiny_spec(
        tmp_path,
        name,
        **{
            "backfill.enabled": True,
            "backfill.tasks": [
                {"kind": "eval", "every_steps": 5, "batches": 1},
                {"kind": "eval", "every_steps": 10, "batches": 2},
            ],
        },
    )


def test_a_task_still_running_is_not_started_again_beside_itself(tmp_path):
    pool = BackfillPool(_spec_with_tasks(tmp_path, "again"))
    a, b = FakeExecutor(), FakeExecutor()
    pool.attach([a, b])
    pool.on_commit(manifest(5))
    pool._dispatch()
    running = {r.name: r for r in pool.records.values() if r.state == "running"}
    assert set(running) == {"eval[0]", "eval[1]"}
    for step in (10, 15, 20, 25):  # both due again and again while they run
        pool.on_commit(manifest(step))
        pool._dispatch()
    assert len(pool.records) == 2  # no second copy of either, queued or running
    # eval[1] ends; the next commit queues it again, on the newest weights.
    ref = next(r for r, (t, _) in pool._running.items() if pool.records[t].name == "eval[1]")
    tid, ex = pool._running.pop(ref)
    pool._busy.discard(ex)
    pool.records[tid].state = "done"
    pool.on_commit(manifest(30))
    again = list(pool.records.values())[2:]
    assert [(r.name, r.step, r.state) for r in again] == [("eval[1]", 30, "queued")]
    # The final commit queues every task, running or not: its results are the job's.
    pool.on_commit(manifest(35), final=True)
    assert [(r.name, r.step) for r in list(pool.records.values())[2:]] == [
        ("eval[1]", 35),
        ("eval[0]", 35),
    ]


def test_tasks_given_up_after_training_stay_failed_through_the_teardown(tmp_path):
    pool = BackfillPool(_spec_with_tasks(tmp_path, "gaveup"))
    pool.attach([FakeExecutor()])
    pool.on_commit(manifest(5))
    pool._dispatch()  # one runs on the only executor, the other waits
    pool.poll = lambda: None  # nothing comes back from the stand-in executor
    pool.finish(timeout_s=0, sleep=lambda s: None)
    pool.detach()  # what the controller's teardown does next
    assert [r.state for r in pool.records.values()] == ["failed", "failed"]
    assert all("finish_timeout_s" in r.error for r in pool.records.values())
    assert pool.pending() == 0
