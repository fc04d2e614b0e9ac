"""Peer copies: a rank's checkpoint files held in live peers' host memory, and which
step a new group may restore from them.

A rank's peer copy is exactly what its checkpoint upload holds (the same safetensors
and meta files, the same index entries with their chunk hashes, under the same
`a-<attempt>/rank_<r>` prefix), kept by a state keeper on its own node and one on a
buddy node (`spotline.runtime.keeper`). A step is complete when every rank of one group
left a copy of it in some live keeper; its manifest is built as a commit's is, so the
restore is the commit restore, reshard and verified reads included. Copies of two
groups never mix: only the group that failed is looked at.

Pure: no Ray, no storage.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from spotline.checkpoint.layout import RankFiles
from spotline.checkpoint.manifest import FileEntry, Manifest
from spotline.checkpoint.reshard import shared_meta
from spotline.checkpoint.transfer import UploadResult, attempt_dir, build_manifest
from spotline.config.schema import JobSpec

PEER_KEY = "peer"
"""The manifest.extra key of a peer-memory manifest: {"holders": {rank prefix: [keeper]}}."""


def rank_prefix(attempt: str, rank: int) -> str:
    """Where a rank's files of a step lie, in storage and in peer memory alike."""
    return f"{attempt_dir(attempt)}/rank_{rank:05d}"


@dataclass(frozen=True)
class PeerCopy:
    """What a keeper holds of one rank's snapshot of one step (its bytes stay there)."""

    attempt: str
    step: int
    rank: int
    world_size: int
    files: list[FileEntry]
    index: list[dict[str, Any]]
    batch: dict[str, Any] | None = None
    losses: list[tuple[int, float]] = field(default_factory=list)
    """(step, loss) of the steps up to this one (rank 0's): the record keeps them when
    the group died before it reported them."""
    meta: dict[str, Any] | None = None
    """What of the rank's meta every rank agrees on (`reshard.shared_meta`)."""

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_dict(self) -> dict[str, Any]:
        return {
            "attempt": self.attempt,
            "step": self.step,
            "rank": self.rank,
            "world_size": self.world_size,
            "files": [[f.path, f.size, f.sha256] for f in self.files],
            "index": self.index,
            "batch": self.batch,
            "losses": [[s, loss] for s, loss in self.losses],
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PeerCopy:
        return cls(
            d["attempt"],
            int(d["step"]),
            int(d["rank"]),
            int(d["world_size"]),
            [FileEntry(p, int(n), h) for p, n, h in d["files"]],
            list(d["index"]),
            d.get("batch"),
            [(int(s), float(loss)) for s, loss in d.get("losses") or []],
            d.get("meta"),
        )


def peer_copy(
    attempt: str,
    rank: int,
    world_size: int,
    step: int,
    local: Path,
    written: RankFiles,
    batch: dict[str, Any] | None = None,
    losses: list[tuple[int, float]] | None = None,
) -> tuple[PeerCopy, dict[str, np.ndarray]]:
    """A rank's copy of `step` from the files a save wrote under `local` (`written`
    describes them): its description, and each file's bytes by its path in the step,
    mapped read-only from the file (no copy in this process's memory)."""
    prefix = rank_prefix(attempt, rank)
    blobs = {f"{prefix}/{rel}": _mapped(local / rel) for rel in written.files}
    copy = PeerCopy(
        attempt,
        step,
        rank,
        world_size,
        [FileEntry(f"{prefix}/{rel}", d.size, d.sha256) for rel, d in written.files.items()],
        [dict(e, file=f"{prefix}/{e['file']}") for e in written.entries],
        batch,
        [(s, loss) for s, loss in losses or [] if s <= step],
        shared_meta(written.meta),
    )
    return copy, blobs


def _mapped(path: Path) -> np.ndarray:
    """A file's bytes as a read-only array over its memory map (empty: an empty array)."""
    if path.stat().st_size == 0:
        return np.empty(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)


@dataclass
class PeerOffer:
    """A step every rank of one group left complete in live keepers: the manifest a new
    group restores it by (it names who holds what)."""

    step: int
    attempt: str
    manifest: Manifest
    """Its extra[PEER_KEY]["holders"]: rank prefix -> the keepers holding its files."""
    losses: list[tuple[int, float]] = field(default_factory=list)
    """(step, loss) up to `step` as the group trained them (rank 0's copy)."""


def newest_complete(
    spec: JobSpec,
    held: list[tuple[str, PeerCopy]],
    attempt: str,
    world: int,
    partition: list[int] | None = None,
    at: int | None = None,
) -> PeerOffer | None:
    """The newest step of group `attempt` (of `world` ranks) whose every rank has a copy
    in `held` ((keeper, copy) pairs from the live keepers), as a `PeerOffer`; None when
    no step is complete. A copy of another group, or of another world size, never counts.
    `at`: only that step (the one a later group started from: its line of steps)."""
    by_step: dict[int, dict[int, PeerCopy]] = defaultdict(dict)
    holders: dict[tuple[int, int], list[str]] = defaultdict(list)
    for keeper, copy in held:
        if copy.attempt != attempt or copy.world_size != world or not 0 <= copy.rank < world:
            continue
        if at is not None and copy.step != at:
            continue
        by_step[copy.step].setdefault(copy.rank, copy)
        holders[(copy.step, copy.rank)].append(keeper)
    for step in sorted(by_step, reverse=True):
        copies = by_step[step]
        if len(copies) < world:
            continue
        results = [
            UploadResult(
                step,
                c.rank,
                attempt,
                world,
                list(c.files),
                list(c.index),
                batch=c.batch,
                meta=c.meta,
            )
            for c in copies.values()
        ]
        manifest = build_manifest(spec, step, attempt, world, results, partition)
        where = {rank_prefix(attempt, r): holders[(step, r)] for r in range(world)}
        manifest.extra[PEER_KEY] = {"holders": where}
        return PeerOffer(step, attempt, manifest, list(copies[0].losses))
    return None
