"""SIGTERM to a real `spotline run` driver at the moments no step boundary is near:
while Ray starts under it, and as the job's controller starts, before the driver has
the run in hand. Each ends in a commit or in a last line saying plainly that nothing
was committed (tests/test_cli_driver_ray.py sends it between two checkpoints)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from conftest import tiny_spec
from spotline.checkpoint import CheckpointStore

pytestmark = pytest.mark.ray

_TIMEOUT_S = 300

# The driver, with one moment chosen for its SIGTERM (argv[2]):
# - "ray-starting": while Ray's own handler is in place, as `ray.init` starts Ray;
# - "controller-starting": as the controller actor starts, before the driver's run
#   exists (the call that starts it returns after the signal).
_DRIVER = textwrap.dedent(
    """
    import os, signal, sys, threading, time

    import spotline.cli as cli
    import spotline.controller.actor as actor

    def term():
        os.kill(os.getpid(), signal.SIGTERM)

    if sys.argv[2] == "controller-starting":
        real = actor.start_controller

        def start_controller(spec, store):
            handle = real(spec, store)
            term()
            return handle

        actor.start_controller = start_controller
    else:
        def watch():
            # Once the CLI's handler is in place, the first other one is Ray's.
            while signal.getsignal(signal.SIGTERM) != cli._interrupts.handle:
                time.sleep(0.001)
            while signal.getsignal(signal.SIGTERM) == cli._interrupts.handle:
                time.sleep(0.001)
            term()

        threading.Thread(target=watch, daemon=True).start()
    sys.exit(cli.main(["run", sys.argv[1]]))
    """
)


def _driver(tmp_path: Path, moment: str) -> tuple[int, str, CheckpointStore]:
    spec = tiny_spec(tmp_path, f"sigterm-{moment}", **{"train.steps": 100_000})
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)  # a local cluster of its own
    done = subprocess.run(
        [sys.executable, str(script), str(config), moment],
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
        env=env,
    )
    store = CheckpointStore(spec.resolved_checkpoint_uri())
    return done.returncode, done.stdout + done.stderr, store


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith("spotline: ")]
    assert lines, text[-4000:]
    return lines[-1]


def test_sigterm_while_ray_starts_under_the_driver_says_nothing_was_committed(tmp_path):
    code, text, store = _driver(tmp_path, "ray-starting")
    assert code == 143, text[-4000:]
    assert _last_line(text) == (
        "spotline: terminated by SIGTERM before the job started: nothing was committed"
    )
    assert "Traceback" not in text and "PC: @" not in text
    assert store.committed_steps() == []


def test_sigterm_as_the_controller_starts_stops_the_job_and_says_what_it_committed(tmp_path):
    code, text, store = _driver(tmp_path, "controller-starting")
    assert code == 143, text[-4000:]
    line = _last_line(text)
    committed = re.fullmatch(r"spotline: stopped by SIGTERM at step (\d+), committed at .*", line)
    if committed:
        assert int(committed[1]) in store.committed_steps()
    else:
        # Stopped before a step, or ended after the grace: plainly nothing committed.
        assert "this run committed no step" in line, line
        assert store.committed_steps() == []
    assert "SIGTERM to the driver: stopping at the next step boundary with a commit" in text
    assert "Traceback" not in text and "PC: @" not in text
