"""Spawning a benchmark's ranks and waiting for rank 0's figures, shared by the scripts
here. Only the standard library is imported at the top: spawned ranks import their
script, and so this module, again."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

LOG_TAIL_LINES = 40


class BenchmarkError(RuntimeError):
    """A run failed; the message says where, with the failing rank's log tail."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redirect_output(path: Path) -> None:
    """Send this process's stdout and stderr to `path`: DeepSpeed prints from every
    rank; its lines belong in a per-rank log, not in the table."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def log_tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-LOG_TAIL_LINES:]) or "(empty log)"


def exit_now() -> None:
    """End a rank that finished cleanly without the interpreter's teardown: the data
    prefetcher's and gloo's threads can still be live then, and a C++ thread destroyed
    while joinable aborts the process (SIGABRT) after the figures were sent."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(
    fn: Callable[..., None],
    args: tuple[Any, ...],
    nprocs: int,
    workdir: Path,
    timeout_s: float,
    where: str,
    killed_hint: str = "",
) -> dict[str, Any]:
    """Run fn(rank, *args, results) in `nprocs` spawned processes; rank r logs to
    workdir/rank_r.log and rank 0 puts one dict on `results`, which this returns.
    A rank that raises, exits or outlives `timeout_s` ends all of them and raises
    BenchmarkError with that rank's log tail."""
    import torch.multiprocessing as mp

    results = mp.get_context("spawn").SimpleQueue()
    ctx = mp.start_processes(
        fn, args=(*args, results), nprocs=nprocs, join=False, start_method="spawn"
    )
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            while not results.empty():
                got.append(results.get())
            if time.monotonic() > deadline:
                raise BenchmarkError(
                    f"{where} did not finish within {timeout_s:.0f}s (--timeout); "
                    f"rank 0 log tail:\n{log_tail(workdir / 'rank_0.log')}"
                )
    except mp.ProcessRaisedException as e:
        raise BenchmarkError(
            f"{where}: rank {e.error_index} raised:\n{e.msg.strip()}\n"
            f"--- rank {e.error_index} log tail ---\n{log_tail(workdir / f'rank_{e.error_index}.log')}"
        ) from None
    except mp.ProcessExitedException as e:
        raise BenchmarkError(
            f"{where}: rank {e.error_index} exited with code {e.exit_code}"
            + (f" (signal {e.signal_name})" if e.signal_name else "")
            + (killed_hint if e.signal_name == "SIGKILL" else "")
            + f"\n--- rank {e.error_index} log tail ---\n"
            + log_tail(workdir / f"rank_{e.error_index}.log")
        ) from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    while not results.empty():
        got.append(results.get())
    if len(got) != 1:
        raise BenchmarkError(f"{where}: rank 0 returned {len(got)} results, expected 1")
    return got[0]
