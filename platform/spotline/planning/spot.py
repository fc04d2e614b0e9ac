"""Spot recovery at the job's shape, on paper: a just-in-time save against each cloud's
notice, peer snapshots against each node's memory, and what a restore costs from peer
memory and from storage.

A node's ranks share its link to object storage: a save ends when the busiest node has
written its ranks' checkpoint files (`peer_memory.rank_copy_bytes`, which are exactly a
checkpoint's files) at the node's bandwidth, and when the busiest rank has written its
own at what one upload may use (checkpoint.upload_max_mb_per_s), plus a fixed part (the
host copy's set-up, the receipt, the commit poll and the manifest). Without a stated
bandwidth, each rank is assumed to upload at SPOTLINE_ASSUMED_SAVE_MB_PER_S.

A restore at the same shape reads what was saved: from storage, the busiest node reads
its ranks' share at its bandwidth; from peer memory, the survivors read their own node's
copies (host memory, not counted) and the replacement of a lost node reads its ranks'
copies from its buddy's keeper across the network. Where peer snapshots keep no buddy
copy, a lost node's ranks read storage. Pure arithmetic: nothing is read or started.
"""

from __future__ import annotations

from dataclasses import dataclass

from spotline import constants
from spotline.config.schema import JobSpec
from spotline.planning.checkpoint_time import SAVE_FIXED_S, NoticeFit
from spotline.planning.peer_memory import (
    NodePeerMemory,
    node_peer_memory,
    node_ranks,
    rank_copy_bytes,
)
from spotline.units import human_bytes

CLOUD_NOTICES = (("AWS", 120.0), ("GCP", 30.0), ("Azure", 30.0))
"""The notice each cloud gives before it takes a spot instance back."""
RESTORE_FIXED_S = 2.0
"""A restore's part that is not bytes: the manifest read and checked, every rank's plan."""
DEFAULT_NETWORK_GBPS = 100.0
"""Between two nodes of a GPU cluster, when not stated (8-GPU instances have 100-3200)."""


@dataclass(frozen=True)
class SpotRecovery:
    """The job's spot recovery at one shape (see the module)."""

    ranks_per_node: int
    storage_bytes_per_s: float
    """One node's bandwidth to object storage."""
    storage_stated: bool
    """The bandwidth was given (else each rank at SPOTLINE_ASSUMED_SAVE_MB_PER_S)."""
    network_bytes_per_s: float
    node_bytes: int
    """The busiest node's checkpoint bytes (its ranks' files)."""
    rank_bytes: int
    save_s: float
    """From a save request to the commit: the busiest node's bytes, or the busiest
    rank's, whichever takes longer, plus the fixed part."""
    step_s: float
    """A step the save waits for (0: unknown)."""
    notices: list[NoticeFit]
    peer: NodePeerMemory | None
    restore_storage_s: float
    restore_peer_s: float | None
    """None: no peer snapshots (off, or none fit)."""

    def render(self) -> list[str]:
        gbps = self.storage_bytes_per_s * 8 / 1e9
        rate = (
            f"{gbps:g} Gbit/s a node to storage (--storage-gbps-per-node)"
            if self.storage_stated
            else f"{gbps:.2g} Gbit/s a node to storage: {self.ranks_per_node} rank(s) at the "
            f"assumed {constants.SPOTLINE_ASSUMED_SAVE_MB_PER_S:.0f} MB/s each (give "
            "--storage-gbps-per-node)"
        )
        step = f" after a {self.step_s:.3g}s step" if self.step_s else ""
        fits = ", ".join(
            f"{n.source} {n.deadline_s:.0f}s {'fits' if n.fits else 'does NOT fit'}"
            for n in self.notices
        )
        lines = [
            f"  spot recovery     {self.ranks_per_node} rank(s) a node; {rate}; "
            f"{self.network_bytes_per_s * 8 / 1e9:g} Gbit/s between nodes",
            f"    save            the busiest node writes {human_bytes(self.node_bytes)} (its "
            f"busiest rank {human_bytes(self.rank_bytes)}): a just-in-time save commits in "
            f"about {self.save_s:.0f}s{step}: {fits}",
        ]
        if self.peer is not None:
            lines.append(f"    peer snapshots  {self.peer.render()}")
        peer = (
            f"from peer memory about {self.restore_peer_s:.0f}s (a lost node's replacement "
            f"reads {human_bytes(self.node_bytes)} from its buddy's keeper; the others "
            "read their own node's copies)"
            if self.restore_peer_s is not None
            else "no peer snapshots (recovery.peer_snapshots)"
        )
        lines.append(
            f"    restore         {peer}; from storage about {self.restore_storage_s:.0f}s "
            f"(the busiest node reads {human_bytes(self.node_bytes)})"
        )
        return lines


def spot_recovery(
    spec: JobSpec,
    replicas: int,
    ranks_per_node: int,
    node_ram: int | None,
    storage_gbps: float | None = None,
    network_gbps: float | None = None,
    step_s: float | None = None,
    bounds: list[int] | None = None,
) -> SpotRecovery:
    """The job's spot recovery at `replicas` (see the module); bandwidths in Gbit/s."""
    per_rank = rank_copy_bytes(spec, replicas, bounds)
    nodes = node_ranks(spec.parallel.pipeline_stages, replicas, max(1, ranks_per_node))
    node_bytes = max(sum(per_rank[r] for r in ranks) for ranks in nodes)
    rank_bytes = max(per_rank)
    assumed = constants.SPOTLINE_ASSUMED_SAVE_MB_PER_S * 1e6
    storage = storage_gbps * 1e9 / 8 if storage_gbps else assumed * max(1, ranks_per_node)
    one = min(storage, assumed) if not storage_gbps else storage
    cap = spec.checkpoint.upload_max_mb_per_s
    if cap is not None:
        one = min(one, cap * 1e6)
    save_s = max(node_bytes / storage, rank_bytes / one) + SAVE_FIXED_S
    step = step_s or 0.0
    margin = constants.SPOTLINE_JIT_MARGIN_S
    notices = [
        NoticeFit(cloud, deadline, save_s + step, save_s + step <= deadline - margin)
        for cloud, deadline in CLOUD_NOTICES
    ]
    network = (network_gbps or DEFAULT_NETWORK_GBPS) * 1e9 / 8
    restore_storage_s = node_bytes / storage + RESTORE_FIXED_S
    peer = None
    restore_peer_s = None
    if spec.recovery.peer_snapshots:
        peer = node_peer_memory(spec, replicas, ranks_per_node, node_ram, bounds)
        if peer.level.steps:
            lost = node_bytes / network if peer.level.buddy and len(nodes) > 1 else None
            restore_peer_s = (lost if lost is not None else node_bytes / storage) + RESTORE_FIXED_S
    return SpotRecovery(
        ranks_per_node=ranks_per_node,
        storage_bytes_per_s=storage,
        storage_stated=bool(storage_gbps),
        network_bytes_per_s=network,
        node_bytes=node_bytes,
        rank_bytes=rank_bytes,
        save_s=save_s,
        step_s=step,
        notices=notices,
        peer=peer,
        restore_storage_s=restore_storage_s,
        restore_peer_s=restore_peer_s,
    )
