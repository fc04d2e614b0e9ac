"""The `unit` tier's guard: a `unit` test that starts a process, Ray or DeepSpeed fails.

A `unit` test is pure logic in the test's own process, so the tier runs in seconds
and first. While one runs (its setup, call and teardown), the entry points below
refuse and the test fails, with a message naming the test, what it started and the
marker that fits:

- processes: `subprocess.Popen` (and so `run`, `check_output`, `os.popen`, asyncio's),
  `multiprocessing` processes (pools and `ProcessPoolExecutor` included),
  `os.fork`, `os.forkpty`, `os.posix_spawn[p]`, `os.system`, `os.execv[e]` (every
  `exec*` and `spawn*` goes through these), and `_posixsubprocess.fork_exec`, under
  all of them (multiprocessing's resource tracker and forkserver start that way);
- Ray: `ray.init` (what every first Ray call runs) and creating an actor or a task;
- DeepSpeed: `deepspeed.initialize`, `deepspeed.init_distributed` and building an
  engine. Importing DeepSpeed in a child process is a process.

Ray and DeepSpeed are patched when they are first imported (or at once if they
already are), so the guard costs neither import. The call is refused with pytest's
`Failed`, which `except Exception` does not swallow; a test that swallows it anyway
still fails at the end of the phase. Other tests pass straight through.

It also refuses a collection in which a test has no tier marker, or more than one.
Registered by conftest.py; `-p tier_guard` loads it into any pytest session.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import multiprocessing.process
import os
import platform
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

PROCS = "procs (several local processes, no Ray)"
RAY = "ray (a local Ray cluster)"
DEEPSPEED = "procs (DeepSpeed in processes of the test's own; it keeps process-wide state)"


@dataclass
class _Frame:
    """The `unit` test now in a phase, and what it tried."""

    nodeid: str
    violations: list[str] = field(default_factory=list)


# Innermost last: a pytest session run inside a test (pytester) pushes its own.
_frames: list[_Frame | None] = []
_lock = threading.Lock()


def message(nodeid: str, what: str, marker: str) -> str:
    return (
        f"{nodeid} is marked `unit`, which starts no process, Ray or DeepSpeed, "
        f"but it {what}. Mark it `{marker}`, or keep the unit test to its logic."
    )


def refuse(what: str, marker: str) -> None:
    """Fail the running `unit` test (if one runs) for `what`; otherwise do nothing."""
    frame = _frames[-1] if _frames else None
    if frame is None:
        return
    text = message(frame.nodeid, what, marker)
    with _lock:
        frame.violations.append(text)
    pytest.fail(text, pytrace=True)


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _guard(owner: Any, name: str, describe: Callable[..., str], marker: str) -> None:
    """Replace `owner.name` by a wrapper that refuses during a `unit` test."""
    original = getattr(owner, name, None)
    if original is None or getattr(original, "_tier_guarded", False):
        return

    def guarded(*args: Any, **kwargs: Any) -> Any:
        refuse(describe(*args, **kwargs), marker)
        return original(*args, **kwargs)

    guarded._tier_guarded = True  # type: ignore[attr-defined]
    guarded.__wrapped__ = original  # type: ignore[attr-defined]
    # Named as the attribute it replaces, so it pickles by reference as the original
    # does (a test may pickle `os.system`).
    guarded.__name__ = name
    if isinstance(owner, type):
        guarded.__module__, guarded.__qualname__ = owner.__module__, f"{owner.__qualname__}.{name}"
    else:
        guarded.__module__, guarded.__qualname__ = owner.__name__, name
    setattr(owner, name, guarded)


def _popen(self: Any, args: Any, *a: Any, **k: Any) -> str:
    return f"started a process: subprocess.Popen({_short(args)})"


def _process(self: Any, *a: Any, **k: Any) -> str:
    target = getattr(self, "_target", None)
    name = getattr(target, "__qualname__", None) or type(self).__name__
    return f"started a process: multiprocessing Process(target={name}).start()"


def _os(call: str) -> Callable[..., str]:
    return lambda *a, **k: f"started a process: {call}({_short(a[0]) if a else ''})"


def _guard_processes() -> None:
    import _posixsubprocess

    _guard(subprocess.Popen, "__init__", _popen, PROCS)
    _guard(multiprocessing.process.BaseProcess, "start", _process, PROCS)
    for call in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "execv", "execve"):
        _guard(os, call, _os(f"os.{call}"), PROCS)
    _guard(_posixsubprocess, "fork_exec", _os("_posixsubprocess.fork_exec"), PROCS)


def _guard_ray(ray: Any) -> None:
    from spotline.compat.ray import remote_name, start_points

    _guard(ray, "init", lambda *a, **k: "started Ray: ray.init()", RAY)

    def starting(kind: str) -> Callable[..., str]:
        return lambda remote, *a, **k: f"started a Ray {kind}: {remote_name(remote)}"

    for kind, (owner, method) in start_points().items():
        _guard(owner, method, starting(kind), RAY)


def _guard_deepspeed(deepspeed: Any) -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine

    _guard(deepspeed, "initialize", lambda *a, **k: "built a DeepSpeed engine", DEEPSPEED)
    _guard(
        deepspeed,
        "init_distributed",
        lambda *a, **k: "initialized DeepSpeed's communication (deepspeed.init_distributed)",
        DEEPSPEED,
    )
    _guard(
        DeepSpeedEngine,
        "__init__",
        lambda self, *a, **k: f"built a {type(self).__name__}",
        DEEPSPEED,
    )


class _WhenImported(importlib.abc.MetaPathFinder):
    """Runs a callback with a top-level module right after its first import."""

    def __init__(self, callbacks: dict[str, Callable[[Any], None]]):
        self.callbacks = callbacks
        self.finding: set[str] = set()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        callback = self.callbacks.get(fullname)
        if callback is None or fullname in self.finding:
            return None
        self.finding.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.finding.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            callback(module)

        spec.loader.exec_module = exec_module  # this spec's own loader
        return spec


_installed = False


def install() -> None:
    """Put the guards in place (once per process); they refuse only during a `unit` test."""
    global _installed
    if _installed:
        return
    _installed = True
    # Python's `platform` runs `uname -p` the first time anything reads the processor
    # (mlflow's import does, under DeepSpeed's); it is cached, so ask it here, once.
    platform.processor()
    _guard_processes()
    later = {}
    for name, guard in (("ray", _guard_ray), ("deepspeed", _guard_deepspeed)):
        if name in sys.modules:
            guard(sys.modules[name])
        else:
            later[name] = guard
    if later:
        sys.meta_path.insert(0, _WhenImported(later))


TIERS = ("unit", "procs", "ray", "chaos", "cluster")


def pytest_configure(config: pytest.Config) -> None:
    install()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test is in exactly one tier: `-m unit` must select only what the guard
    holds to the unit tier's rules, and every other run must know where a test goes."""
    wrong = []
    for item in items:
        tiers = [t for t in TIERS if item.get_closest_marker(t)]
        if len(tiers) != 1:
            wrong.append(f"  {item.nodeid}: {', '.join(tiers) or 'no tier'}")
    if wrong:
        raise pytest.UsageError(
            f"each test needs exactly one of the markers {', '.join(TIERS)}:\n" + "\n".join(wrong)
        )


def _phase(item: pytest.Item):
    frame = _Frame(item.nodeid) if item.get_closest_marker("unit") else None
    _frames.append(frame)
    try:
        result = yield
    except Exception:
        # The refusal, caught by the code under test, led to another error: say why.
        if frame is not None and frame.violations:
            pytest.fail("\n".join(dict.fromkeys(frame.violations)), pytrace=False)
        raise
    finally:
        _frames.pop()
    if frame is not None and frame.violations:
        # The code under test swallowed the refusal.
        pytest.fail("\n".join(dict.fromkeys(frame.violations)), pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    return (yield from _phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    return (yield from _phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    return (yield from _phase(item))
