"""Reading a sharded checkpoint at any shape: index readers, the planner, verified reads.

A checkpoint written by p pipeline stages x D replicas (any ZeRO stage) is read by a
rank of any other shape, or by code with no engine at all (export, backfill), through
its index: every rank's entries (`spotline.checkpoint.layout`), from the rank
directories (`read_index`) or from a committed manifest.

The planner (`Plan`) is told which element ranges of which (param, kind) a reader
needs; it checks the whole plan against the index (names, shapes, dtypes, coverage)
before anything is read, then reads, of every entry it needs, the chunk-aligned byte
range covering the elements it needs, and checks every chunk it read (the whole-entry
hash when that range is the whole entry). Every byte handed back was checked; a reader
reads what it needs rounded out to chunk boundaries (4 MiB by default).

Never here: engines or DeepSpeed (the caller applies what was read), writes of any kind.
torch loads only when tensors are built: a process that only moves or describes a
step's bytes (a state keeper, the uploader's receipts) imports this room without it.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotline.checkpoint.layout import (
    FORMAT,
    FP32,
    INDEX,
    META_FILE,
    WEIGHT,
    CheckpointFormatError,
    check_entry,
    load_json,
    torch_dtype,
)
from spotline.storage import UnsafePathError, join_under

if TYPE_CHECKING:
    import torch

Reader = Callable[[dict, int, int], bytes]
"""read(entry, byte_start, byte_len): bytes of an entry's tensor data."""

# Job-level meta every rank of one checkpoint must agree on.
_SHARED_META = (
    "format",
    "adam_step",
    "optim_keys",
    "lr_scheduler",
    "global_steps",
    "global_samples",
    "batch_schedule",
    "partition",  # the layer bounds of the stages (rank metas of older saves have none)
)
_SHARED_TOPOLOGY = ("pipeline_stages", "replicas", "zero_stage")


# --- index and readers -----------------------------------------------------------------


def combine_meta(metas: list[dict]) -> dict:
    """One checkpoint's meta from its ranks' metas; CheckpointFormatError if they do
    not agree or a rank is missing."""
    if not metas:
        raise CheckpointFormatError(INDEX, "no rank wrote training state")
    first = metas[0]
    if first.get("format") != FORMAT:
        raise CheckpointFormatError(INDEX, f"format {first.get('format')!r} is not {FORMAT!r}")
    for m in metas[1:]:
        for k in _SHARED_META:
            if m.get(k) != first.get(k):
                raise CheckpointFormatError(INDEX, f"ranks disagree on {k}")
        for k in _SHARED_TOPOLOGY:
            if m["topology"].get(k) != first["topology"].get(k):
                raise CheckpointFormatError(INDEX, f"ranks disagree on topology.{k}")
    topo = first["topology"]
    world = topo["pipeline_stages"] * topo["replicas"]
    ranks = sorted(m["topology"]["rank"] for m in metas)
    if ranks != list(range(world)):
        missing = sorted(set(range(world)) - set(ranks))
        raise CheckpointFormatError(
            INDEX, f"training state of rank(s) {missing or ranks} missing or duplicated"
        )
    out = {k: first.get(k) for k in _SHARED_META}
    out["topology"] = {k: topo[k] for k in _SHARED_TOPOLOGY}
    out["optimizer"] = first.get("optimizer")
    return out


def shared_meta(meta: dict) -> dict:
    """What of a rank's meta `combine_meta` reads (what every rank must agree on, and
    the rank's place): its receipt carries it, so the manifest can record the
    checkpoint's meta and a restoring rank reads no other rank's meta file."""
    return {k: meta[k] for k in (*_SHARED_META, "topology", "optimizer") if k in meta}


def checkpoint_meta(manifest, store, rank: int | None) -> tuple[dict, dict | None]:
    """A committed step's combined meta, and the meta file of rank `rank` of the shape
    that saved it (its RNG states; None: not wanted). A manifest that records the
    combined meta (every rank's receipt carried its own) costs one read at most; an
    older one, every rank's meta file, read at once through a bounded pool.
    CheckpointFormatError when one does not verify or parse."""
    metas = [f for f in manifest.files if f.path.endswith(f"/{META_FILE}")]
    combined = manifest.extra.get("meta")
    if combined is not None:
        own = f"/rank_{rank:05d}/{META_FILE}" if rank is not None else None
        got = _read_metas(manifest.step, store, [f for f in metas if own and f.path.endswith(own)])
        return combined, got[0] if got else None
    got = _read_metas(manifest.step, store, metas)
    mine = [m for m in got if m.get("topology", {}).get("rank") == rank]
    return combine_meta(got), (mine[0] if mine and rank is not None else None)


def _read_metas(step: int, store, files: list) -> list[dict]:
    """The "meta" of each meta file in `files` (manifest entries), each verified."""
    from spotline.checkpoint.uploads import parallel
    from spotline.storage.backends import READ_THREADS

    def one(f) -> dict:
        raw = store.read_range(step, f.path, 0, f.size)
        if hashlib.sha256(raw).hexdigest() != f.sha256:
            raise CheckpointFormatError(f.path, "sha256 differs from the manifest's")
        try:
            return json.loads(raw)["meta"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointFormatError(f.path, f"not a valid meta file ({e})") from None

    return parallel([lambda f=f: one(f) for f in files], READ_THREADS)


def read_index(root: str | os.PathLike[str]) -> tuple[list[dict], dict]:
    """(index, meta) of the checkpoint whose rank directories are under `root`."""
    entries: list[dict] = []
    metas = []
    for path in sorted(Path(root).glob(f"*/{META_FILE}")):
        doc = load_json(path)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise CheckpointFormatError(path, f"not a {FORMAT} meta file")
        metas.append(doc["meta"])
        entries.extend(doc["entries"])
    return entries, combine_meta(metas)


def directory_reader(root: str | os.PathLike[str]) -> Reader:
    """read(entry, byte_start, byte_len) over local files under `root` (the index root:
    the union of every rank's output directory)."""
    root = Path(root)

    def read(entry: dict, start: int, length: int) -> bytes:
        try:
            path = join_under(root, entry["file"], local=True)
        except UnsafePathError as e:
            raise CheckpointFormatError(
                entry["file"], f"{entry['key']}: leaves the checkpoint ({e.why})"
            ) from None
        with open(path, "rb") as f:
            f.seek(entry["offset"] + start)
            data = f.read(length)
        if len(data) != length:
            raise CheckpointFormatError(path, f"{entry['key']}: file is truncated")
        return data

    return read


def store_reader(store, step: int) -> Reader:
    """read(entry, byte_start, byte_len) over a CheckpointStore's committed `step`: one
    ranged read of the entry's file (entry["file"] relative to the step's root)."""

    def read(entry: dict, start: int, length: int) -> bytes:
        return store.read_range(step, entry["file"], entry["offset"] + start, length)

    return read


class Index:
    """A checked index, by (param, kind): which saved entries cover which elements."""

    def __init__(self, index: list[dict]):
        self.by: dict[tuple[str, str], list[dict]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._reaches: dict[tuple[str, str], tuple[list[int], list[dict]]] = {}
        files: set[str] = set()
        for e in index:
            check_entry(e, files)
            shape = tuple(e["shape"])
            if self.shapes.setdefault(e["param"], shape) != shape:
                raise CheckpointFormatError(
                    e["file"], f"{e['param']}: entries disagree on its shape"
                )
            self.by.setdefault((e["param"], e["kind"]), []).append(e)
        for entries in self.by.values():
            entries.sort(key=lambda e: (e["start"], -e["numel"], e.get("rank", 0)))
            if len({e["dtype"] for e in entries}) > 1:
                raise CheckpointFormatError(
                    entries[0]["file"], f"{entries[0]['key']}: entries disagree on dtype"
                )

    def has(self, name: str, kind: str) -> bool:
        return (name, kind) in self.by

    def dtype(self, name: str, kind: str) -> torch.dtype:
        return torch_dtype(self.by[(name, kind)][0]["dtype"])

    def cover(self, name: str, kind: str, lo: int, hi: int) -> list[tuple[dict, int, int]]:
        """Pieces (entry, first, last) of saved entries that cover elements [lo, hi): at
        each point, of the entries that begin at or before it, the first reaching
        furthest. A binary search per piece over the entries' starts and the furthest
        reach so far (computed once per param and kind): however many ranks saved
        fragments of it, no scan over all of them per piece."""
        if not self.by.get((name, kind)):
            raise CheckpointFormatError(
                INDEX,
                f"checkpoint has no {kind!r} state for {name}: elements [{lo}, {hi}) are not "
                "covered by the saved fragments (a rank's state missing?)",
            )
        starts, furthest = self._reach(name, kind)
        pieces: list[tuple[dict, int, int]] = []
        cur = lo
        while cur < hi:
            j = bisect.bisect_right(starts, cur) - 1
            best = furthest[j] if j >= 0 else None
            if best is None or best["start"] + best["numel"] <= cur:
                raise CheckpointFormatError(
                    INDEX,
                    f"{name}/{kind}: elements from {cur} (of [{lo}, {hi})) are not covered by "
                    "the saved fragments (a rank's state missing?)",
                )
            end = min(hi, best["start"] + best["numel"])
            pieces.append((best, cur, end))
            cur = end
        return pieces

    def _reach(self, name: str, kind: str) -> tuple[list[int], list[dict]]:
        """The entries' starts (sorted), and for each position the first entry reaching
        furthest among those up to it."""
        got = self._reaches.get((name, kind))
        if got is None:
            starts, furthest, top = [], [], None
            for e in self.by[(name, kind)]:
                if top is None or e["start"] + e["numel"] > top["start"] + top["numel"]:
                    top = e
                starts.append(e["start"])
                furthest.append(top)
            got = self._reaches[(name, kind)] = (starts, furthest)
        return got


# --- verified reads --------------------------------------------------------------------


def _read_verified(entry: dict, first: int, last: int, read: Reader, stats: dict) -> bytes:
    """Elements [first, last) of `entry` (absolute element indices), read chunk-aligned
    and checked against the entry's hashes."""
    itemsize = entry["nbytes"] // entry["numel"]
    b0 = (first - entry["start"]) * itemsize
    b1 = (last - entry["start"]) * itemsize
    chunk, nbytes = entry["chunk_bytes"], entry["nbytes"]
    a = b0 // chunk * chunk
    z = min(-(-b1 // chunk) * chunk, nbytes)
    data = read(entry, a, z - a)
    if len(data) != z - a:
        raise CheckpointFormatError(entry["file"], f"{entry['key']}: short read")
    if a == 0 and z == nbytes:
        ok = hashlib.sha256(data).hexdigest() == entry["sha256"]
    else:
        ok = all(
            hashlib.sha256(data[off : off + chunk]).hexdigest()
            == entry["chunk_sha256"][(a + off) // chunk]
            for off in range(0, z - a, chunk)
        )
    if not ok:
        raise CheckpointFormatError(entry["file"], f"{entry['key']}: sha256 mismatch")
    stats["bytes_read"] += len(data)
    stats["bytes_by_kind"][entry["kind"]] = stats["bytes_by_kind"].get(entry["kind"], 0) + len(data)
    stats["_entries"].add((entry["file"], entry["key"]))
    return data[b0 - a : b1 - a]


def _new_stats() -> dict[str, Any]:
    return {"bytes_read": 0, "bytes_by_kind": {}, "_entries": set()}


def _public(stats: dict[str, Any]) -> dict[str, Any]:
    return {
        "bytes_read": stats["bytes_read"],
        "entries_read": len(stats["_entries"]),
        "bytes_by_kind": stats["bytes_by_kind"],
    }


def _assemble(idx, name, kind, lo, hi, parts, read, stats) -> torch.Tensor:
    """Elements [lo, hi) of (name, kind) from the verified bytes of `parts`."""
    import torch

    buf = torch.empty(hi - lo, dtype=idx.dtype(name, kind))
    for entry, first, last in parts:
        raw = _read_verified(entry, first, last, read, stats)
        buf[first - lo : last - lo] = torch.frombuffer(bytearray(raw), dtype=buf.dtype)
    return buf


# --- the planner -----------------------------------------------------------------------


class Plan:
    """What one reader needs of a checkpoint: element ranges by (param, kind).

    `param` checks a parameter against the index, `need` and `whole` add ranges, and
    `read` checks the whole plan (dtypes, coverage) and then reads and verifies every
    byte of it. Nothing is read before the whole plan has checked.
    """

    def __init__(self, index: list[dict]):
        self.idx = Index(index)
        self.ranges: dict[tuple[str, str], list[int]] = {}

    def param(self, name: str, shape: tuple[int, ...]) -> None:
        """CheckpointFormatError unless the checkpoint has `name` at `shape`."""
        if name not in self.idx.shapes:
            raise CheckpointFormatError(INDEX, f"checkpoint has no state for parameter {name}")
        if self.idx.shapes[name] != shape:
            raise CheckpointFormatError(
                INDEX,
                f"{name}: saved shape {list(self.idx.shapes[name])} != model shape {list(shape)}",
            )

    def need(self, name: str, kind: str, lo: int, hi: int) -> None:
        """Elements [lo, hi) of (name, kind); one range per (name, kind), widened."""
        r = self.ranges.setdefault((name, kind), [lo, hi])
        r[0], r[1] = min(r[0], lo), max(r[1], hi)

    def whole(self, name: str, dtype: torch.dtype) -> str:
        """Need all of `name` for a whole copy of `dtype`: its saved weight of that dtype,
        else its fp32 master (cast by the caller, exactly how DeepSpeed derives it).
        Returns the kind planned."""
        if self.idx.has(name, WEIGHT) and self.idx.dtype(name, WEIGHT) == dtype:
            kind = WEIGHT
        elif self.idx.has(name, FP32):
            kind = FP32
        else:
            kind = WEIGHT
        self.need(name, kind, 0, math.prod(self.idx.shapes[name]))
        return kind

    def pieces(self) -> dict[tuple[str, str], list[tuple[dict, int, int]]]:
        """Check the plan against the index (dtypes, coverage): by (param, kind), the
        saved pieces (entry, first, last) that cover what is needed. Reads nothing."""
        import torch

        idx = self.idx
        pieces = {}
        for (name, kind), (lo, hi) in self.ranges.items():
            if kind != WEIGHT and idx.has(name, kind) and idx.dtype(name, kind) != torch.float32:
                raise CheckpointFormatError(
                    INDEX, f"{name}/{kind}: saved as {idx.dtype(name, kind)}"
                )
            pieces[(name, kind)] = idx.cover(name, kind, lo, hi)
        return pieces

    def read(self, read: Reader) -> Loaded:
        """Check the plan against the index, then read and verify all of it."""
        pieces = self.pieces()
        stats = _new_stats()
        data = {
            key: _assemble(self.idx, *key, *self.ranges[key], parts, read, stats)
            for key, parts in pieces.items()
        }
        return Loaded({k: lo for k, (lo, _) in self.ranges.items()}, data, _public(stats))


class Loaded:
    """The verified elements of a read `Plan`, and what reading them took
    (`stats`: {"bytes_read", "entries_read", "bytes_by_kind"})."""

    def __init__(self, lows: dict, data: dict[tuple[str, str], torch.Tensor], stats: dict):
        self._lows = lows
        self._data = data
        self.stats = stats

    def get(self, name: str, kind: str, start: int, numel: int) -> torch.Tensor:
        """Elements [start, start + numel) of (name, kind) (a view; CPU)."""
        lo = self._lows[(name, kind)]
        return self._data[(name, kind)][start - lo : start - lo + numel]

    def all(self, name: str, kind: str) -> torch.Tensor:
        """Everything read of (name, kind)."""
        return self._data[(name, kind)]


def full_params(
    index: list[dict], read: Reader, names: list[str] | None = None
) -> dict[str, torch.Tensor]:
    """Whole parameters by stable name (all of them, or `names`), for exports and
    evaluation: the fp32 master (or, for a param without one, its saved weight),
    assembled from every rank's fragments with verified reads. No engine needed."""
    idx = Index(index)
    stats = _new_stats()
    out = {}
    for name in names if names is not None else sorted(idx.shapes, key=_layer_order):
        if name not in idx.shapes:
            raise CheckpointFormatError(INDEX, f"checkpoint has no state for parameter {name}")
        shape = idx.shapes[name]
        kind = FP32 if idx.has(name, FP32) else WEIGHT
        parts = idx.cover(name, kind, 0, math.prod(shape))
        out[name] = _assemble(idx, name, kind, 0, math.prod(shape), parts, read, stats).reshape(
            shape
        )
    return out


def _layer_order(name: str) -> tuple[int, str]:
    head, _, rest = name.partition(".")
    return (int(head), rest) if head.isdigit() else (-1, name)
