"""One rank's training state as a sharded, topology-free checkpoint: save and load.

Every rank saves only the state it owns, with no collective, and any rank of any
later shape (p' pipeline stages, D' replicas, another ZeRO stage) loads by reading
only the byte ranges it needs.

Save, in two parts:

- `snapshot(engine, topo, write_weights=...)` is the only part the training step
  waits for: host copies of this rank's fp32 master fragments and Adam moments (and,
  on the rank the caller picks, the stage's low-precision weights). No collective, no
  file I/O.
- `write(snap, out_dir)` (a background thread) writes them as one safetensors file plus
  a JSON file and returns the rank's index entries (`spotline.checkpoint.layout`
  describes the files and the entries; its `write_rank` also returns each file's
  size and sha256, hashed in the same pass).

What a rank owns: ZeRO-1/2 and BF16_Optimizer: the fragments its parameters' fragment
mappings point at; ZeRO-3: its partition of every parameter; ZeRO-0: whole parameters,
written by replica 0 only (the other replicas hold copies). Low-precision weights ("weight",
whole tensors) are written where the caller passes `write_weights=True` (replica 0 of
each stage), except where they are not a separate tensor (ZeRO-0 fp32: the parameter
is its own master) or not held whole without a collective (ZeRO-3: rebuilt from fp32
on load, which is exactly how ZeRO-3 derives them). Params the optimizer does not
train are saved as "weight" only (ZeRO-3: each rank its partition). Optimizer state
kinds are the optimizer's per-element tensors (Adam: exp_avg, exp_avg_sq; amsgrad
adds max_exp_avg_sq), listed in meta["optim_keys"]; before Adam's first step they are
saved as zeros, which is what Adam would create. Where DeepSpeed keeps all of this is
the engine adapter's business (`spotline.train.engine`).

Load sets each rank's fp32 fragments and moments from the overlapping saved
fragments and the module's whole low-precision params from the "weight" entries (of
the same dtype; else from the full fp32 cast, exactly how DeepSpeed derives them).
What to read, and the verified reads, are the reshard planner's
(`spotline.checkpoint.reshard`): the whole plan is checked against the index (names,
shapes, dtypes, coverage) and every byte read is checked against its chunk hashes
before anything is written into the engine, so a load that raises
`CheckpointFormatError` leaves the engine as it was.

Never here: collectives, storage, Ray.
"""

from __future__ import annotations

import json
import os

import torch

from spotline.checkpoint.layout import (
    CHUNK_BYTES,
    FORMAT,
    FP32,
    INDEX,
    META_FILE,
    MOMENTS,
    WEIGHT,
    CheckpointFormatError,
    RankSnapshot,
    dtype_name,
    write_rank,
)
from spotline.checkpoint.reshard import Plan, Reader, combine_meta, store_reader
from spotline.train.engine import EngineAdapter, HostCopier, Param

__all__ = [
    "FORMAT",
    # Kept here for the trainer, which reaches them as `state.<name>`.
    "META_FILE",
    "RankSnapshot",
    "combine_meta",
    "store_reader",
    # This module's own.
    "load",
    "snapshot",
    "write",
]


def snapshot(engine, topo, *, write_weights: bool) -> RankSnapshot:
    """Host copies of the state this rank owns. No collective, no file I/O.

    `write_weights`: also take the stage's low-precision weights (pass True on replica
    0 of each stage). `topo` needs pipeline_stages, replicas, rank, stage, replica.
    """
    lay = EngineAdapter(engine, topo)
    keys = lay.optim_keys()
    host = HostCopier()
    tensors: dict[str, torch.Tensor] = {}
    entries: list[dict] = []

    def add(rec: Param, kind: str, start: int, t: torch.Tensor) -> None:
        key = f"{rec.name}/{kind}/{start}"
        tensors[key] = t
        entries.append(
            {
                "key": key,
                "param": rec.name,
                "kind": kind,
                "start": start,
                "numel": t.numel(),
                "shape": list(rec.shape),
                "dtype": dtype_name(t.dtype),
                "rank": topo.rank,
            }
        )

    for rec in lay.params:
        for slot in rec.slots:
            if not slot.owner:
                continue
            for kind in slot.kinds or (FP32, *keys):
                live = slot.get(kind)
                # Adam creates its moments at the first step: before it, they are zero.
                t = (
                    torch.zeros(slot.numel, dtype=torch.float32)
                    if live is None
                    else host.copy(live)
                )
                add(rec, kind, slot.start, t)
        # fp32 weights are the master itself: a load rebuilds them from the fp32
        # fragments, which it reads anyway, so they are not written twice.
        if (
            write_weights
            and rec.lp_saved
            and rec.lp_get is not None
            and rec.param.dtype != torch.float32
        ):
            add(rec, WEIGHT, 0, host.copy(rec.lp_get()))
    host.wait()
    progress = lay.progress()
    step = lay.adam_step()
    meta = {
        "format": FORMAT,
        "adam_step": 0.0 if step is None else step,
        "optim_keys": keys,
        "lr_scheduler": progress["lr_scheduler"],
        "global_steps": progress["global_steps"],
        "global_samples": progress["global_samples"],
        "topology": lay.topology(topo),
        "optimizer": lay.kind,
    }
    try:
        json.dumps(meta)
    except TypeError as e:
        raise TypeError(f"training state meta is not JSON-able ({e})") from None
    return RankSnapshot(tensors, entries, meta)


def write(
    snap: RankSnapshot,
    out_dir: str | os.PathLike[str],
    *,
    root: str | os.PathLike[str] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> list[dict]:
    """Write `out_dir/state.safetensors` and `out_dir/meta.json`; return the entries.

    Each entry gains "file" (relative to `root`, by default out_dir's parent: the
    directory that holds every rank's directory), "offset"/"nbytes" (its bytes in the
    file, from the safetensors header), "sha256" of those bytes and "chunk_sha256" of
    each `chunk_bytes` of them. No collective. Same state -> same bytes.
    """
    return write_rank(snap, out_dir, root=root, chunk_bytes=chunk_bytes).entries


def load(engine, topo, index: list[dict], meta: dict, read: Reader) -> dict:
    """Load a checkpoint written at any shape into this rank's engine. No collective.

    `index`: every rank's entries (from `write`); `meta`: `combine_meta` of the ranks'
    metas (or `read_index`); `read(entry, byte_start, byte_len)`: bytes of an entry's
    tensor data. Reads only the entries (and, within them, the chunks) that overlap
    what this rank holds at its shape. Sets fp32 partitions, Adam moments (created if
    Adam has not run yet) and step, the low-precision weights, the lr scheduler (the
    caller then re-syncs lr to its own schedule) and global_steps/samples.
    Returns {"bytes_read", "entries_read", "bytes_by_kind"}.
    """
    if meta.get("format") != FORMAT:
        raise CheckpointFormatError(INDEX, f"format {meta.get('format')!r} is not {FORMAT!r}")
    plan = Plan(index)
    lay = EngineAdapter(engine, topo)
    keys = list(meta.get("optim_keys") or MOMENTS)
    lay.check_keys(keys)

    # Plan: which element range of which (param, kind) this rank needs, all checked
    # against the index before anything is read.
    lp_kind: dict[str, str] = {}
    for rec in lay.params:
        plan.param(rec.name, rec.shape)
        for slot in rec.slots:
            for kind in slot.kinds or (FP32, *keys):
                plan.need(rec.name, kind, slot.start, slot.start + slot.numel)
        if rec.lp_set is not None:
            lp_kind[rec.name] = plan.whole(rec.name, rec.param.dtype)

    # Read and verify everything before changing the engine.
    got = plan.read(read)

    # Apply.
    lay.ensure_state(keys, float(meta.get("adam_step") or 0.0))
    with torch.no_grad():
        for rec in lay.params:
            for slot in rec.slots:
                for kind in slot.kinds or (FP32, *keys):
                    src = got.get(rec.name, kind, slot.start, slot.numel)
                    live = slot.get(kind)
                    slot.set(kind, src.to(device=live.device, dtype=live.dtype))
            if rec.lp_set is not None:
                full = got.all(rec.name, lp_kind[rec.name])
                rec.lp_set(full.to(device=rec.param.device, dtype=rec.param.dtype))
        lay.finish_load()
    lay.restore_progress(meta)
    return got.stats
