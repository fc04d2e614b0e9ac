"""The README's driver flow, each command its own process, as a user runs them:
`spotline run` trains; `spotline status NAME` and `spotline report NAME` from another
shell watch it by name; SIGTERM (Kubernetes, `ray job stop`) between two checkpoints
stops the job at the next step boundary with a commit there; running it again resumes
from that commit; running a finished job again reports it from its stored summary
without starting a worker.

Every `spotline run` here starts its own local Ray cluster; the test checks that each is
gone when its driver exits, and stops only processes it started.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from conftest import tiny_spec
from spotline.checkpoint import CheckpointStore

pytestmark = pytest.mark.ray

NAME = "drv-watch"
_TIMEOUT_S = 300
# Long enough that a stop asked just after one periodic checkpoint lands well before
# the next, however fast the tiny job trains.
_INTERVAL = 200


def _config(tmp_path: Path) -> Path:
    # Far more steps than the test waits for: it is ended by SIGTERM.
    spec = tiny_spec(
        tmp_path,
        NAME,
        **{
            "train.steps": 100_000,
            "train.log_every": 5,
            "checkpoint.interval_steps": _INTERVAL,
        },
    )
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    return path


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)  # `spotline run` starts a local cluster of its own
    # As a new user runs it: no auth mode of their own, so Spotline states Ray's.
    env.pop("RAY_AUTH_MODE", None)
    return env


# Ray's notice of the token-authentication mode it chose by itself.
_AUTH_NOTICE = "Token authentication is"


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "spotline.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
    )


class _Driver:
    """`spotline run` in a process of its own, its output in files."""

    def __init__(self, tmp_path: Path, tag: str, *args: str):
        self.out, self.err = tmp_path / f"{tag}.out", tmp_path / f"{tag}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "spotline.cli", "run", *args],
                stdout=out,
                stderr=err,
                env=_env(),
            )
        self.children: set[psutil.Process] = set()

    def text(self) -> str:
        return self.out.read_text() + self.err.read_text()

    def wait_for(self, pattern: str) -> re.Match:
        deadline = time.monotonic() + _TIMEOUT_S
        while time.monotonic() < deadline:
            self.note_children()
            m = re.search(pattern, self.out.read_text())
            if m:
                return m
            assert self.proc.poll() is None, f"the driver exited early:\n{self.text()[-4000:]}"
            time.sleep(0.5)
        raise AssertionError(f"{pattern!r} not seen in {_TIMEOUT_S}s:\n{self.text()[-4000:]}")

    def wait_for_step(self, pred) -> int:
        """The step the driver printed last, once `pred` holds for it."""
        deadline = time.monotonic() + _TIMEOUT_S
        while time.monotonic() < deadline:
            self.note_children()
            steps = re.findall(r"\] step (\d+)/", self.out.read_text())
            if steps and pred(int(steps[-1])):
                return int(steps[-1])
            assert self.proc.poll() is None, f"the driver exited early:\n{self.text()[-4000:]}"
            time.sleep(0.1)
        raise AssertionError(f"no such step in {_TIMEOUT_S}s:\n{self.text()[-4000:]}")

    def gcs_address(self) -> str:
        """The address of the Ray cluster the driver started, as its raylet was given it
        (Ray finds local clusters the same way)."""
        self.note_children()
        for p in self.children:
            with contextlib.suppress(psutil.Error):
                if p.name() == "raylet":
                    m = re.search(r"--gcs-address=(\S+)", " ".join(p.cmdline()))
                    if m:
                        return m[1]
        raise AssertionError(f"no raylet among the driver's processes: {self.children}")

    def note_children(self) -> None:
        """The processes of the driver's own Ray cluster (GCS, raylet, workers)."""
        with contextlib.suppress(psutil.Error):
            self.children |= set(psutil.Process(self.proc.pid).children(recursive=True))

    def finish(self) -> int:
        try:
            return self.proc.wait(timeout=_TIMEOUT_S)
        finally:
            self.stop()

    def left_behind(self) -> list[psutil.Process]:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            alive = [p for p in self.children if p.is_running() and p.status() != "zombie"]
            if not alive:
                return []
            time.sleep(0.5)
        return alive

    def stop(self) -> None:
        """Whatever this driver started and left running: only those processes."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for p in self.children:
            with contextlib.suppress(psutil.Error):
                p.kill()


def _summary(text: str) -> dict[str, str]:
    block = text[text.index(f"Spotline job {NAME}: ") :]
    return dict(re.findall(r"^  ([a-z -]+?)\s{2,}(.+)$", block, re.MULTILINE))


def test_a_running_job_is_watched_by_name_and_sigterm_stops_it_with_a_commit(
    ray_session, tmp_path: Path, monkeypatch
):
    # `ray_session`: this process's own cluster runs beside the one `spotline run`
    # starts, as another cluster often does on a workstation; Ray's "auto" would pick
    # either of the two.
    # Where each job last ran is recorded here, not in this machine's ~/.spotline.
    monkeypatch.setenv("SPOTLINE_HOME", str(tmp_path / "home"))
    config = _config(tmp_path)
    store = CheckpointStore(f"file://{tmp_path}/ckpt")
    driver = _Driver(tmp_path, "first", str(config))
    try:
        driver.wait_for(r"committed checkpoint step \d+")

        # Another process finds the job by name on the cluster `spotline run` started,
        # and with no name, as the one running job there (another cluster on this
        # machine, a developer's own, may run jobs of its own).
        named = _cli("status", NAME, "--json", "-")
        assert named.returncode == 0, named.stderr[-3000:]
        st = json.loads(named.stdout)
        assert st["name"] == NAME and st["state"] in ("running", "checkpointing")
        assert st["step"] >= 5 and st["committed_steps"]
        bare = _cli("status", "--address", driver.gcs_address(), "--json", "-")
        assert bare.returncode == 0, bare.stderr[-3000:]
        assert json.loads(bare.stdout)["name"] == NAME
        assert _AUTH_NOTICE not in named.stderr + bare.stderr
        report = _cli("report", NAME, "--out", str(tmp_path / "report"))
        assert report.returncode == 0, report.stderr[-3000:]
        assert (tmp_path / "report" / "loss.png").is_file()

        # SIGTERM between two periodic checkpoints: just after one, far from the next.
        driver.wait_for_step(lambda s: 5 <= s % _INTERVAL <= 50)
        periodic = store.committed_steps()
        driver.note_children()
        driver.proc.send_signal(signal.SIGTERM)
        code = driver.finish()
    finally:
        driver.stop()
    text = driver.text()
    # 143 = 128 + SIGTERM: what a shell and Kubernetes report for a process that SIGTERM
    # ended; 130 stays Ctrl-C's.
    assert code == 143, text[-4000:]
    assert "SIGTERM to the driver: stopping at the next step boundary with a commit" in text
    last = driver.err.read_text().strip().splitlines()[-1]
    m = re.fullmatch(
        r"spotline: stopped by SIGTERM at step (\d+), committed at (\S+)/step_(\d+): "
        r"running the job again resumes there",
        last,
    )
    assert m, last
    stopped = int(m[1])
    assert m[2] == store.uri and int(m[3]) == stopped
    # The step it stopped at is committed, past the periodic ones: the steps trained
    # since the last of them are kept.
    assert stopped in store.committed_steps()
    assert stopped > max(periodic) and stopped % _INTERVAL != 0, (stopped, periodic)
    assert "resumes from its latest commit" not in text
    assert "SIGTERM received" not in text and "PC: @" not in text and "Traceback" not in text
    assert not driver.left_behind(), "the driver's Ray cluster outlived it"
    # What the job stored says so, for `spotline status` and a rerun.
    stored = _cli("status", store.uri, "--json", "-")
    assert stored.returncode == 0, stored.stderr[-3000:]
    summary = json.loads(stored.stdout)
    assert (summary["state"], summary["step"]) == ("stopped", stopped)
    # By name too, now that its cluster is gone: from where it last ran.
    by_name = _cli("status", NAME, "--json", "-")
    assert by_name.returncode == 0, by_name.stderr[-3000:]
    assert json.loads(by_name.stdout) == summary
    assert "reading it from where it last ran" in by_name.stderr
    assert store.uri in by_name.stderr
    assert _AUTH_NOTICE not in text + stored.stderr + by_name.stderr

    # Run again: it resumes from the step it stopped at and trains to the (now near) end.
    end = f"train.steps={stopped + 30}"
    again = _Driver(tmp_path, "resume", str(config), "--set", end)
    code = again.finish()
    text = again.text()
    assert code == 0, text[-4000:]
    restored = int(re.search(r"restored committed checkpoint step (\d+)", text).group(1))
    assert restored == stopped
    first = _summary(again.out.read_text())
    assert first["steps"] == str(stopped + 30)
    assert not again.left_behind()

    # And once more: the job is finished, so it is reported from its stored summary,
    # with no worker started.
    third = _Driver(tmp_path, "finished", str(config), "--set", end)
    code = third.finish()
    text = third.text()
    assert code == 0, text[-4000:]
    assert "already finished" in text
    assert "starting 2 replica(s)" not in text and "restored committed" not in text
    summary = _summary(third.out.read_text())
    assert summary["steps"] == first["steps"]
    assert summary["train loss"] == first["train loss"] and "n/a" not in summary["train loss"]
    assert summary["throughput"] == first["throughput"]
    assert not summary["throughput"].startswith("0.00")
    assert not third.left_behind()
