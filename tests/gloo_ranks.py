"""Ranks of a test's own process group (gloo, no Ray): where they meet.

A port picked by binding a socket and closing it can be taken by another process
before rank 0 listens on it. Here rank 0's TCPStore listens on a port the kernel picks
and keeps it, and rank 0 sends that port to the others through a queue of the context
that launched them, as the runtime's rank 0 does through Ray.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any


def rank_store(rank: int, world: int, ports: Any, timeout_s: float = 300.0) -> Any:
    """This rank's TCPStore of a `world`-rank group. `ports`: a queue that every rank
    of the group was launched with (each call of rank 0 puts its port there once for
    every other rank)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        store = dist.TCPStore(
            "127.0.0.1", 0, world, is_master=True, timeout=timeout, wait_for_workers=False
        )
        for _ in range(world - 1):
            ports.put(store.port)
        return store
    return dist.TCPStore("127.0.0.1", ports.get(timeout=timeout_s), world, timeout=timeout)


def join(topo: Any, ports: Any, timeout_s: float = 300.0) -> str:
    """`init_distributed` for rank `topo.rank` on a store from `rank_store`."""
    from spotline.train.process import init_distributed

    store = rank_store(topo.rank, topo.world_size, ports, timeout_s)
    return init_distributed(topo, "127.0.0.1", store.port, store=store)
