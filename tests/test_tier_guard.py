"""The unit tier's guard (tier_guard.py), run on a small test file of its own in a
pytest session inside this one: a `unit` test that starts a process, Ray or DeepSpeed
fails, saying which test did what and which marker fits, even when it swallows the
refusal; a test of another tier passes straight through; a test with no tier, or two,
stops the collection. Nothing is started: each refusal comes before the start.
"""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

pytestmark = pytest.mark.unit

_INI = """
[pytest]
addopts = -p tier_guard --strict-markers
markers =
    unit: the unit tier
    procs: several local processes
    ray: a local Ray cluster
    chaos: faults
    cluster: autoscaling
"""

_TESTS = """
import multiprocessing
import os
import subprocess
import sys

import pytest


@pytest.mark.unit
def test_runs_a_command():
    subprocess.run([sys.executable, "-c", "pass"])


@pytest.mark.unit
def test_swallows_the_refusal():
    try:
        os.system("true")
    except BaseException:
        pass


@pytest.mark.unit
def test_starts_a_process():
    multiprocessing.get_context("spawn").Process(target=print).start()


@pytest.mark.unit
def test_starts_ray():
    import ray

    ray.init(address="local", num_cpus=1)


@pytest.mark.unit
def test_starts_a_ray_actor():
    import ray

    @ray.remote
    class Actor:
        pass

    Actor.remote()


@pytest.mark.unit
def test_builds_a_deepspeed_engine():
    import deepspeed

    deepspeed.initialize(model=None)


@pytest.mark.procs
def test_of_another_tier_reaches_the_real_call():
    # Popen itself refuses this argument, before any process starts.
    with pytest.raises(ValueError, match="embedded null byte"):
        subprocess.Popen(["a\\0b"])
"""


@pytest.fixture
def pytester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """An inner session with no plugin but the guard (a plugin may start a process of
    its own at the session's start: pytest-benchmark asks git)."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makeini(_INI)
    return pytester


def test_a_unit_test_that_starts_a_process_ray_or_deepspeed_fails(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_tiers=_TESTS)
    result = pytester.runpytest_inprocess()
    result.assert_outcomes(failed=6, passed=1)
    says = "test_tiers.py::{} is marked `unit`, which starts no process, Ray or DeepSpeed, but it "
    result.stdout.fnmatch_lines_random(
        [
            "*" + says.format("test_runs_a_command") + "started a process: subprocess.Popen(*",
            "*"
            + says.format("test_swallows_the_refusal")
            + "started a process: os.system('true')*",
            "*"
            + says.format("test_starts_a_process")
            + "started a process: multiprocessing Process(target=print).start()*",
            "*" + says.format("test_starts_ray") + "started Ray: ray.init()*",
            "*" + says.format("test_starts_a_ray_actor") + "started a Ray actor*",
            "*" + says.format("test_builds_a_deepspeed_engine") + "built a DeepSpeed engine*",
        ]
    )
    result.stdout.fnmatch_lines_random(
        ["*Mark it `procs (several*", "*Mark it `ray (a local Ray*", "*Mark it `procs (DeepSpeed*"]
    )


def test_every_test_needs_exactly_one_tier(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_untiered="""
        import pytest

        def test_no_tier():
            pass

        @pytest.mark.unit
        @pytest.mark.procs
        def test_two_tiers():
            pass

        @pytest.mark.unit
        def test_one_tier():
            pass
        """
    )
    result = pytester.runpytest_inprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "*each test needs exactly one of the markers unit, procs, ray, chaos, cluster:",
            "*test_untiered.py::test_no_tier: no tier",
            "*test_untiered.py::test_two_tiers: unit, procs",
        ]
    )
