"""Reading the cluster's capacity and losses patiently, as the controller needs them.

A group just torn down gives its devices back a moment later, and a node whose
worker died can be seen gone a moment after its processes: these helpers read the
cluster view again for a bounded time rather than decide from the first reading.
They decide nothing themselves.
"""

from __future__ import annotations

from spotline import constants
from spotline.storage.retry import poll


def settled_capacity(cluster, want: int, clock, sleep, held: int = 0) -> int:
    """Whole replicas the live, non-draining capacity holds (`held`: devices the job's
    own ranks kept for the next group occupy), read again (for up to
    SPOTLINE_CAPACITY_SETTLE_S) while it is short of `want`: sizing from the first
    reading after a teardown would start too small."""
    return poll(
        lambda: cluster.capacity(held_workers=held),
        lambda capacity: capacity >= want,
        within_s=constants.SPOTLINE_CAPACITY_SETTLE_S,
        every_s=0.2,
        clock=clock,
        sleep=sleep,
    )


def lost_nodes(cluster, nodes: set[str], patient: bool, clock, sleep) -> set[str]:
    """Which of `nodes` are gone. A failure may surface first as a peer's collective
    error; after a worker reported dead (`patient`) the checks go on for
    SPOTLINE_NODE_LOSS_WAIT_S, as its node can be seen gone a moment after its
    processes."""
    return poll(
        lambda: cluster.gone(nodes),
        bool,
        within_s=constants.SPOTLINE_NODE_LOSS_WAIT_S if patient else 0.0,
        every_s=0.25,
        clock=clock,
        sleep=sleep,
    )


def replicas_left(cluster, workers: list[dict], gone: set[str], ahead: int = 0) -> int:
    """Replicas a group's devices off the `gone` nodes, the `ahead` devices of replicas
    started ahead, and the free ones hold: what the next group can expect once the
    devices of the old one show free again."""
    held = sum(1 for w in workers if w["node_id"] not in gone) + ahead
    return cluster.capacity(held_workers=held, exclude=gone)
