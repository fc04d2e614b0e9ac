"""The evidence of a hang without Ray: py-spy's output read into frames, the training
thread's frame found, NCCL flight records behind their seam (a fake dump), the stacks
kept beside the checkpoints, and the controller taking them before it tears a hung
group down (a fake group and a fake stack taker)."""

from __future__ import annotations

import json

import pytest

from spotline.controller.artifacts import Artifacts
from spotline.report import stack_rows, stacks_lines, stacks_text, status_rows
from spotline.runtime.stacks import (
    flight_record,
    flight_recorder_on,
    process_state,
    summarise,
    threads_of,
    training_frame,
)

pytestmark = pytest.mark.unit

# What `py-spy dump --json` prints for a rank frozen in its forward (innermost first).
DUMP = [
    {
        "thread_name": "control",
        "frames": [
            {"name": "Condition.wait", "short_filename": "threading.py", "line": 327},
            {"name": "Thread.run", "short_filename": "threading.py", "line": 982},
        ],
    },
    {
        "thread_name": "ThreadPoolExecutor-0_0",
        "frames": [
            {
                "name": "Faults.maybe_freeze",
                "short_filename": "spotline/runtime/faults.py",
                "line": 118,
            },
            {"name": "faulty", "short_filename": "spotline/runtime/faults.py", "line": 99},
            {
                "name": "Trainer.train_step",
                "short_filename": "spotline/train/trainer.py",
                "line": 288,
            },
            {"name": "TrainWorker.run", "short_filename": "spotline/runtime/actor.py", "line": 430},
        ],
    },
]


def test_the_training_threads_innermost_frame_is_named_from_py_spys_dump():
    threads = threads_of(DUMP)
    assert threads[1]["name"] == "ThreadPoolExecutor-0_0"
    assert threads[1]["frames"][0] == "Faults.maybe_freeze (spotline/runtime/faults.py:118)"
    assert training_frame(threads) == "Faults.maybe_freeze (spotline/runtime/faults.py:118)"
    # No thread holds the training loop: the main thread's frame, else none.
    main = [{"name": "MainThread", "frames": ["spin (x.py:3)"]}]
    assert training_frame(main) == "spin (x.py:3)"
    assert training_frame([]) is None


def test_a_process_state_is_read_in_words():
    import os

    assert process_state(os.getpid()) in ("running", "sleeping")
    assert process_state(2**22 + 12345) == "gone"


def test_the_flight_record_is_taken_only_where_torch_keeps_one_and_never_raises():
    """The NCCL seam, under a fake dump: torch's own cannot run without NCCL here."""
    taken = []

    def dump():
        taken.append(1)
        return b'{"entries": []}'

    assert flight_recorder_on({"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"})
    assert flight_recorder_on({"TORCH_FR_BUFFER_SIZE": "10"})
    assert not flight_recorder_on({"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"})
    assert "off" in flight_record(dump, env={})
    assert taken == []
    assert flight_record(dump, env={"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}) == {
        "json": b'{"entries": []}'
    }

    def broken():
        raise RuntimeError("no NCCL process group")

    got = flight_record(broken, env={"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"})
    assert got == {"error": "RuntimeError: no NCCL process group"}


class _Coordinator:
    def __init__(self):
        self.files: dict[str, bytes] = {}

    def write_artifact(self, path, data):
        self.files[path] = data
        return f"file:///ckpt/artifacts/{path}"


def _record():
    threads = threads_of(DUMP)
    return {
        "taken_at": 1.0,
        "ranks": {
            "0": {"rank": 0, "node": "n0", "pid": 10, "state": "sleeping", "error": None}
            | {"threads": [], "frame": "Pipe.recv (p2p.py:1)"},
            "1": {"rank": 1, "node": "n1", "pid": 11, "state": "stopped", "error": None}
            | {"threads": threads, "frame": training_frame(threads)},
        },
        "flight": {"0": {"json": b'{"entries": [1]}'}, "1": {"error": "no answer within 20s"}},
    }


def test_stacks_and_flight_records_are_kept_beside_the_checkpoints():
    coordinator = _Coordinator()
    artifacts = Artifacts(None, coordinator, lambda *a, **k: None)
    assert artifacts.store_stacks("hang-a-step14", _record()) is None  # not owned: nothing
    artifacts.owned = True
    uri = artifacts.store_stacks("hang-a-step14", _record())
    assert uri == "file:///ckpt/artifacts/stacks/hang-a-step14/stacks.json"
    stored = json.loads(coordinator.files["stacks/hang-a-step14/stacks.json"])
    assert stored["ranks"]["1"]["frame"].startswith("Faults.maybe_freeze")
    # A flight record is kept as torch wrote it, in a file of its own.
    assert coordinator.files["stacks/hang-a-step14/flight-rank-00000.json"] == b'{"entries": [1]}'
    assert stored["flight"]["0"]["uri"].endswith("flight-rank-00000.json")
    assert stored["flight"]["1"] == {"error": "no answer within 20s"}


def test_the_summary_names_the_frame_each_named_rank_is_in():
    summary = summarise(_record(), [1])
    assert summary == {
        "1": {
            "frame": "Faults.maybe_freeze (spotline/runtime/faults.py:118)",
            "state": "stopped",
            "node": "n1",
            "error": None,
        }
    }
    assert summarise(_record(), [3])["3"]["error"] == "no stack came back"
    rows = stack_rows({"step": 14, "uri": "file:///x/stacks.json", "ranks": summary})
    assert rows[0] == ("stacks", "hang at step 14: file:///x/stacks.json")
    assert rows[1] == (
        "rank 1 stack",
        "Faults.maybe_freeze (spotline/runtime/faults.py:118) (process stopped)",
    )
    assert "rank 1 stack: Faults.maybe_freeze" in stacks_text([{"step": 14, "ranks": summary}])
    lines = stacks_lines({"job": "j", "step": 3, "attempt": "a", **_record()})
    assert lines[0] == "job j, step 3, group a"
    at = lines.index("rank 1 (node n1, pid 11, stopped)")
    assert lines[at + 1 : at + 5] == [
        "    Faults.maybe_freeze (spotline/runtime/faults.py:118)",
        "    faulty (spotline/runtime/faults.py:99)",
        "    Trainer.train_step (spotline/train/trainer.py:288)",
        "    TrainWorker.run (spotline/runtime/actor.py:430)",
    ]


# --- through the controller ----------------------------------------------------------------


class FakeStacks:
    """Takes a fake group's stacks: rank `frozen` sits in maybe_freeze, stopped."""

    def __init__(self, frozen=1, fail=False):
        self.frozen, self.fail = frozen, fail
        self.calls: list[dict] = []

    def take(self, group, ranks=None, timeout_s=None):
        self.calls.append({"ranks": ranks, "group_shut": group.shut})
        if self.fail:
            raise RuntimeError("GCS unreachable")
        out = {}
        for info in group.worker_info():
            r = info["rank"]
            frozen = r == self.frozen
            threads = threads_of(DUMP) if frozen else []
            out[str(r)] = {
                "rank": r,
                "node": info["node_id"],
                "pid": info["pid"],
                "state": "stopped" if frozen else "sleeping",
                "threads": threads,
                "frame": training_frame(threads) if frozen else "Pipe.recv (p2p.py:1)",
                "error": None,
            }
        return {"taken_at": 1.0, "ranks": out, "flight": {}}


def test_a_hangs_stacks_are_taken_before_the_teardown_kept_and_shown(tmp_path):
    from controller_fakes import make, run_until

    ctl, store = make(
        tmp_path, {"freeze": {"at": 15, "rank": 1, "times": 1}}, stacks=FakeStacks(frozen=1)
    )
    run_until(ctl, lambda: len(ctl.rec.attempts) == 2)
    (call,) = ctl.stacks.calls
    assert call == {"ranks": None, "group_shut": False}  # every rank, the group still up
    (taken,) = ctl.health.stacks
    assert taken["why"] == "hang" and taken["step"] == ctl.rec.attempts[0].losses[-1][0]
    assert list(taken["ranks"]) == ["1"]  # the named rank
    assert taken["ranks"]["1"]["frame"].startswith("Faults.maybe_freeze")
    name = f"hang-{ctl.rec.attempts[0].attempt}-step{taken['step']}"
    stored = json.loads(store.read_artifact(f"stacks/{name}/stacks.json"))
    assert stored["named"] == [1] and set(stored["ranks"]) == {"0", "1", "2", "3"}
    assert taken["uri"].endswith(f"stacks/{name}/stacks.json")
    said = [e for e in ctl.events.since(0)[0] if e.startswith("stacks taken before the teardown")]
    assert said == [
        "stacks taken before the teardown: rank 1: Faults.maybe_freeze "
        f"(spotline/runtime/faults.py:118) (stopped); the stacks taken are at {taken['uri']}"
    ]
    rows = dict(status_rows(ctl.door.status()))
    assert rows["rank 1 stack"].startswith("Faults.maybe_freeze")
    run_until(ctl, lambda: ctl.state.terminal)
    # The stored summary (what `spotline status/report URI` read) carries them.
    summary = json.loads(store.read_artifact("summary.json"))
    assert summary["health"]["stacks"][0]["ranks"]["1"]["state"] == "stopped"


def test_a_stack_taker_that_fails_never_holds_the_hang_path_up(tmp_path):
    from controller_fakes import make, run_until

    ctl, _ = make(
        tmp_path, {"freeze": {"at": 15, "rank": 1, "times": 1}}, stacks=FakeStacks(fail=True)
    )
    run_until(ctl, lambda: ctl.state.terminal)
    assert ctl.state.name == "finished" and ctl.rec.attempts[0].ended_by == "hang"
    assert any("could not take the hung ranks' stacks: GCS" in e for e in ctl.events.since(0)[0])
    assert ctl.health.stacks == []


def test_a_large_group_has_only_its_named_ranks_stacks_taken(tmp_path, monkeypatch):
    from controller_fakes import make, run_until
    from spotline import constants

    monkeypatch.setattr(constants, "SPOTLINE_STACKS_ALL_RANKS", 2)
    ctl, _ = make(tmp_path, {"freeze": {"at": 15, "rank": 1, "times": 1}}, stacks=FakeStacks())
    run_until(ctl, lambda: len(ctl.rec.attempts) == 2)
    assert ctl.stacks.calls[0]["ranks"] == [1]


def test_stacks_on_demand_from_a_running_job_and_a_clear_answer_without_one(tmp_path):
    from controller_fakes import make

    ctl, _ = make(tmp_path, stacks=FakeStacks(frozen=None))
    assert (
        "has no group running to take stacks of (it is pending)" in ctl.door.take_stacks()["error"]
    )
    ctl.step()
    ctl.step()  # running
    record = ctl.door.take_stacks()
    assert record["job"] == "ctl" and set(record["ranks"]) == {"0", "1", "2", "3"}
    assert ctl.stacks.calls[-1]["ranks"] is None
