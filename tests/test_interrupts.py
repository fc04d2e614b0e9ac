"""SIGTERM and Ctrl-C to a driver (`spotline.interrupts`): the first stops the job at
a step boundary with a commit, another ends it at once, and the last line says what was
committed. The handler is called directly here; tests/test_cli_driver_ray.py sends the
real signal to a real `spotline run`."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from spotline import constants
from spotline.interrupts import Interrupts
from spotline.job import JobResult
from spotline.job_outcome import resume_hint

pytestmark = pytest.mark.unit


@pytest.fixture
def keep_handlers() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


class FakeRun:
    def __init__(self, latest: int | None = None) -> None:
        self.asked: list[tuple[str, float | None]] = []
        self.latest = latest

    def stop_soon(self, reason: str, grace_s: float | None = None) -> None:
        self.asked.append((reason, grace_s))

    def resume_hint(self) -> str:
        return resume_hint(self.latest, seen=True)


def _result(steps: int, committed: list[int]) -> JobResult:
    return JobResult.from_dict(
        {
            "name": "j",
            "state": "stopped",
            "steps": steps,
            "losses": {},
            "final_train_loss": None,
            "heldout_loss": None,
            "steps_per_s": 0.0,
            "tokens_per_s": 0.0,
            "checkpoint_uri": "file:///runs/j/ckpt",
            "committed_steps": committed,
            "failures": 0,
            "wall_s": 1.0,
        }
    )


def test_the_first_signal_asks_a_stop_within_the_grace_and_the_second_ends_at_once(
    keep_handlers,
):
    it = Interrupts()
    it.install()
    it.run = FakeRun(latest=40)
    it.handle(signal.SIGTERM)  # returns: the driver waits for the stop
    assert it.run.asked == [("SIGTERM to the driver", constants.SPOTLINE_DRIVER_STOP_GRACE_S)]
    assert it.code == 143
    with pytest.raises(KeyboardInterrupt):
        it.handle(signal.SIGTERM)
    assert len(it.run.asked) == 1  # asked once
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # a third is not caught
    assert it.ended_at_once() == (
        "terminated by SIGTERM again: the job was ended at once; the latest commit seen is "
        "step 40: running the job again resumes there (or from a newer commit)"
    )
    it.restore()


def test_ctrl_c_exits_130_and_says_nothing_committed_when_nothing_was(keep_handlers):
    it = Interrupts()
    it.install()
    it.run = FakeRun(latest=None)
    it.handle(signal.SIGINT)
    assert it.run.asked[0][0] == "Ctrl-C to the driver"
    with pytest.raises(KeyboardInterrupt):
        it.handle(signal.SIGINT)
    assert it.code == 130
    line = it.ended_at_once()
    assert line == (
        "interrupted again: the job was ended at once; this run committed no step: running "
        "the job again starts where this run did"
    )
    assert "resumes from its latest commit" not in line
    it.restore()


def test_a_signal_before_the_job_started_ends_the_command_at_once(keep_handlers):
    it = Interrupts()
    it.install()
    with pytest.raises(KeyboardInterrupt):
        it.handle(signal.SIGTERM)
    assert (it.code, it.ended_at_once()) == (143, "terminated by SIGTERM")  # not a job
    it.install()
    it.for_job = True  # `spotline run`, before its controller started
    with pytest.raises(KeyboardInterrupt):
        it.handle(signal.SIGTERM)
    assert (
        it.ended_at_once() == "terminated by SIGTERM before the job started: nothing was committed"
    )
    it.restore()


def test_a_signal_while_the_controller_starts_is_the_runs_stop_once_it_exists(keep_handlers):
    it = Interrupts()
    it.install()
    it.for_job = True
    it.starting_job()
    it.handle(signal.SIGTERM)  # returns: the run does not exist yet
    run = FakeRun(latest=None)
    it.started(run)
    assert run.asked == [("SIGTERM to the driver", constants.SPOTLINE_DRIVER_STOP_GRACE_S)]
    with pytest.raises(KeyboardInterrupt):
        it.handle(signal.SIGTERM)
    assert len(run.asked) == 1 and it.code == 143
    it.restore()


def test_a_second_signal_while_the_controller_starts_ends_it_saying_nothing_committed(
    keep_handlers,
):
    it = Interrupts()
    it.install()
    it.for_job = True
    it.starting_job()
    it.handle(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        it.handle(signal.SIGINT)
    assert it.ended_at_once() == "interrupted again before the job started: nothing was committed"
    run = FakeRun()
    it.started(run)  # had the start gone on, the run would not be asked to stop again
    assert run.asked == []
    it.restore()


def test_a_started_run_with_no_signal_is_not_asked_to_stop(keep_handlers):
    it = Interrupts()
    it.install()
    it.starting_job()
    run = FakeRun()
    it.started(run)
    assert run.asked == [] and it.run is run and not it.starting
    it.restore()


def test_the_line_of_a_stopped_job_names_the_step_it_committed_or_says_it_did_not():
    it = Interrupts()
    it.seen = [signal.SIGTERM]
    assert it.stopped(_result(57, [40, 57])) == (
        "stopped by SIGTERM at step 57, committed at file:///runs/j/ckpt/step_00000057: "
        "running the job again resumes there"
    )
    assert it.stopped(_result(57, [40])) == (
        "stopped by SIGTERM at step 57, which did not commit; the latest commit is step 40: "
        "running the job again resumes there"
    )
    it.seen = [signal.SIGINT]
    assert it.stopped(_result(3, [])) == (
        "stopped by Ctrl-C at step 3, which did not commit; this run committed no step: "
        "running the job again starts where this run did"
    )
