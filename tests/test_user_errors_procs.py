"""Errors that are the user's, as the `spotline` command itself shows them: one line on
stderr that names what to fix (the rest: test_user_errors.py, in this process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.procs


@pytest.mark.parametrize("cmd", ["status", "report", "trace"])
def test_no_cluster_at_the_address_names_the_job_and_how_to_point_at_it(cmd) -> None:
    """Nothing listens at 127.0.0.1:1: refused at once, not after Ray's minutes of retries.
    A fresh interpreter, so no Ray connection of another test stands in for the address."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, "-m", "spotline.cli", cmd, "llama-track", "--address", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    line = lines[0]
    assert "cannot reach a Ray cluster at 127.0.0.1:1" in line
    assert "'llama-track'" in line and "--address" in line and "RAY_ADDRESS" in line
    assert f"spotline {cmd} CHECKPOINT_URI" in line
