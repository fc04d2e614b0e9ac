"""A rank whose step failed cuts its gloo links: a survivor blocked on it fails at once
with a connection error, not at the collective timeout, and every survivor's process
lives on (what lets recovery.in_place keep them).

Four gloo processes, no Ray. Rank 3 exits in the middle of all-reduces. Without the
cut, a survivor that waits on another survivor stays blocked: the others wait (alive)
for every survivor to report, so it would only fail at the 30 s timeout, with
"Timed out" in its error, and the test fails.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from datetime import timedelta

import pytest

from gloo_ranks import rank_store

pytestmark = pytest.mark.procs

_WORLD = 4
_TIMEOUT_S = 30.0


def _rank(rank: int, ports, cut: bool, out, survivors_done) -> None:
    import torch
    import torch.distributed as dist

    from spotline.train.comms import comms_for

    torch.set_num_threads(1)
    store = rank_store(rank, _WORLD, ports, timeout_s=60)
    links = comms_for("gloo", rank)
    links.begin()  # after the store, as a rank does: its listener is not a link
    timeout = timedelta(seconds=_TIMEOUT_S)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=_WORLD, timeout=timeout)
    side = dist.new_group(list(range(_WORLD)), timeout=timeout)  # a group made later, too
    links.agree(store, _WORLD, 60)
    out.put(("listeners", rank, len(links.listeners)))
    t = torch.ones(2_000_000)
    dist.all_reduce(t)
    dist.all_reduce(t, group=side)
    dist.barrier()
    if rank == _WORLD - 1:
        time.sleep(0.3)
        os._exit(1)  # lost mid-run, without a word
    try:
        for _ in range(10_000):
            dist.all_reduce(t)
        out.put(("no error", rank, ""))
    except Exception as e:  # noqa: BLE001 - what the test reads
        n = links.abort() if cut else 0
        out.put(("error", rank, f"{n} {e}"))
    survivors_done.wait(90)  # alive until every survivor reported
    out.put(("alive", rank, ""))


def _run(cut: bool) -> dict[int, list[tuple[str, object]]]:
    ctx = mp.get_context("spawn")
    out, done, ports = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, ports, cut, out, done)) for r in range(_WORLD)]
    for p in procs:
        p.start()
    got: dict[int, list[tuple[str, object]]] = {r: [] for r in range(_WORLD)}
    errors = 0
    deadline = time.monotonic() + 120
    while errors < _WORLD - 1 and time.monotonic() < deadline:
        kind, rank, text = out.get(timeout=120)
        got[rank].append((kind, text))
        errors += kind in ("error", "no error")
    done.set()
    for _ in range(_WORLD - 1):
        kind, rank, text = out.get(timeout=30)
        got[rank].append((kind, text))
    for p in procs:
        p.join(30)
    return got


def test_a_failed_rank_cuts_its_links_so_no_survivor_waits_for_the_timeout():
    got = _run(cut=True)
    for rank in range(_WORLD - 1):
        kinds = dict(got[rank])
        assert kinds["listeners"] >= _WORLD  # every rank's, of both groups
        assert "error" in kinds, got[rank]
        assert "Timed out" not in kinds["error"] and "timeout" not in kinds["error"].lower()
        assert "alive" in kinds, f"rank {rank}'s process did not live on: {got[rank]}"
