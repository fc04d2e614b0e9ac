"""One rank's training state as a sharded, topology-free checkpoint.

Every rank saves only the state it owns, with no collective, and any rank of any
later shape (p' pipeline stages, D' replicas, another ZeRO stage) loads by reading
only the byte ranges it needs.

Save, in two parts:

- `snapshot(engine, topo, write_weights=...)` is the only part the training step
  waits for: host copies of this rank's fp32 master fragments and Adam moments (and,
  on the rank the caller picks, the stage's low-precision weights). No collective, no
  file I/O.
- `write(snap, out_dir)` (a background thread) writes them as one safetensors file plus
  a JSON file and returns the rank's index entries.

The unit of state is a *fragment*: a contiguous element range of one parameter,
flattened in row-major order. A parameter is named by its stable name
(`<layer index>.<param>`, the same at any number of pipeline stages), so fragments
written at one shape address the same elements at every other shape. Index entry::

    {"key": "3.attn.q.weight/exp_avg/512",   # tensor name in the file
     "param": "3.attn.q.weight", "kind": "fp32" | "exp_avg" | "exp_avg_sq" | "weight",
     "start": 512, "numel": 512,             # element range in the flattened full param
     "shape": [32, 32], "dtype": "float32",  # the full param's shape; the stored dtype
     "rank": 1,                              # the rank that wrote it
     # completed by write():
     "file": "rank_00001/state.safetensors", # relative to the directory holding the
                                             # rank directories (the index root)
     "offset": 4096, "nbytes": 2048,         # the tensor's bytes inside that file
     "sha256": "...",                        # of exactly those bytes
     "chunk_bytes": 4194304, "chunk_sha256": ["...", ...]}  # of each chunk of them

What a rank owns: ZeRO-1/2 and BF16_Optimizer: the fragments its `_hp_mapping`s
point at; ZeRO-3: its partition of every parameter; ZeRO-0: whole parameters, written
by replica 0 only (the other replicas hold copies). Low-precision weights ("weight",
whole tensors) are written where the caller passes `write_weights=True` (replica 0 of
each stage), except where they are not a separate tensor (ZeRO-0 fp32: the parameter
is its own master) or not held whole without a collective (ZeRO-3: rebuilt from fp32
on load, which is exactly how ZeRO-3 derives them). Params the optimizer does not
train are saved as "weight" only (ZeRO-3: each rank its partition). Optimizer state
kinds are the optimizer's per-element tensors (Adam: exp_avg, exp_avg_sq; amsgrad
adds max_exp_avg_sq), listed in meta["optim_keys"]; before Adam's first step they are
saved as zeros, which is what Adam would create.

Load sets each rank's fp32 fragments and moments from the overlapping saved
fragments and the module's whole low-precision params from the "weight" entries (of
the same dtype; else from the full fp32 cast, exactly how DeepSpeed derives them).

Verification on read: entries are hashed whole (`sha256`) and per `chunk_bytes` chunk
(`chunk_sha256`). `load` reads, of every entry it needs, the chunk-aligned byte range
covering the elements it needs, and checks every chunk it read (the whole-entry hash
when that range is the whole entry). Every byte that reaches the engine was checked;
a rank reads what it needs rounded out to chunk boundaries (4 MiB by default).

`load` checks the whole plan against the index (names, shapes, dtypes, coverage)
before reading, and reads and checks every byte before writing anything into the
engine: a load that raises `CheckpointFormatError` leaves the engine as it was.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from spotline.checkpoint.layout import CheckpointFormatError, load_json, save_json, save_tensors
from spotline.storage import UnsafePathError, check_relpath, join_under

FORMAT = "spotline.sharded/1"
STATE_FILE = "state.safetensors"
META_FILE = "meta.json"
CHUNK_BYTES = 4 * 2**20
FP32 = "fp32"
WEIGHT = "weight"
MOMENTS = ("exp_avg", "exp_avg_sq")
INDEX = "<index>"  # the `path` of errors about the index rather than a file

Reader = Callable[[dict, int, int], bytes]

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class RankSnapshot:
    """Host copies of one rank's state: `tensors[key]` (1-D, CPU) for each entry."""

    tensors: dict[str, torch.Tensor]
    entries: list[dict]
    meta: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


# --- where this rank's state lives in the engine -------------------------------------


@dataclass
class _Slot:
    """One element range of one parameter held by this rank, and how to get/set it."""

    name: str
    start: int
    numel: int
    kinds: tuple[str, ...]
    owner: bool  # this rank writes it (ZeRO-0 replicas > 0 hold copies and do not)
    get: Callable[[str], torch.Tensor | None]  # None: optimizer state not created yet
    set: Callable[[str, torch.Tensor], None]


@dataclass
class _Param:
    name: str
    param: torch.nn.Parameter
    shape: tuple[int, ...]
    numel: int
    slots: list[_Slot] = field(default_factory=list)
    # The module's copy, when separate from the fp32 master: written whole as "weight"
    # entries, set whole on load (from "weight" entries, else from fp32).
    lp_get: Callable[[], torch.Tensor] | None = None
    lp_set: Callable[[torch.Tensor], None] | None = None
    lp_saved: bool = True  # False: leave it out of snapshots (ZeRO-3: no whole copy)


class _Layout:
    """This rank's view of the engine's training state, by optimizer kind.

    kinds: "zero3" (params with `ds_id`), "hp" (ZeRO-1/2 and BF16_Optimizer: params
    with `_hp_mapping` into a flat fp32 partition), "unfused" (bf16 without ZeRO at
    pp=1: FP16_UnfusedOptimizer's per-param fp32 copies), "plain" (ZeRO-0 fp32: the
    client optimizer over the module's own params).
    """

    def __init__(self, engine, topo):
        self.engine = engine
        self.opt = engine.optimizer
        if self.opt is None:
            raise NotImplementedError("spotline.train.state needs an engine with an optimizer")
        self.base: torch.optim.Optimizer = getattr(self.opt, "optimizer", self.opt)
        self.replica = topo.replica
        named = list(engine.module.named_parameters())
        if any(hasattr(p, "ds_id") for _, p in named):
            self.kind = "zero3"
            self.flats = list(self.opt.fp32_partitioned_groups_flat)
        elif hasattr(self.opt, "single_partition_of_fp32_groups"):
            self.kind = "hp"
            self.flats = list(self.opt.single_partition_of_fp32_groups)
        elif hasattr(self.opt, "fp32_groups_flat_partition"):
            self.kind = "hp"
            self.flats = list(self.opt.fp32_groups_flat_partition)
        elif hasattr(self.opt, "fp32_groups") and hasattr(self.opt, "fp16_groups"):
            self.kind = "unfused"
            self.flats = [t for group in self.opt.fp32_groups for t in group]
            self._master = {
                id(lp): hp
                for lp_group, hp_group in zip(
                    self.opt.fp16_groups, self.opt.fp32_groups, strict=True
                )
                for lp, hp in zip(lp_group, hp_group, strict=True)
            }
        elif isinstance(self.opt, torch.optim.Optimizer) and self.base is self.opt:
            self.kind = "plain"
            self.flats = [p for group in self.base.param_groups for p in group["params"]]
        else:
            raise NotImplementedError(
                f"spotline.train.state does not know DeepSpeed's {type(self.opt).__name__}"
            )
        self._in_opt = {id(t) for t in self.flats}
        self.params = [self._param(name, p) for name, p in named]

    # -- optimizer state ------------------------------------------------------------

    def optim_keys(self) -> list[str]:
        """The optimizer's per-element state tensors (Adam: exp_avg, exp_avg_sq)."""
        for flat in self.flats:
            st = self.base.state.get(flat)
            if st:
                return sorted(
                    k
                    for k, v in st.items()
                    if torch.is_tensor(v) and v.shape == flat.shape and k != "step"
                )
        return list(MOMENTS)

    def adam_step(self) -> float | None:
        steps = set()
        for flat in self.flats:
            st = self.base.state.get(flat)
            if st and "step" in st:
                steps.add(float(st["step"]))
        if len(steps) > 1:
            raise RuntimeError(f"optimizer state has several step counts {sorted(steps)}")
        return steps.pop() if steps else None

    def ensure_state(self, keys: list[str], step: float) -> None:
        """Create the optimizer state Adam would create lazily at its first step, and
        set every state's step count."""
        groups = {id(p): g for g in self.base.param_groups for p in g["params"]}
        for flat in self.flats:
            st = self.base.state.get(flat)
            if not st:
                g = groups.get(id(flat), {})
                on_device = g.get("capturable") or g.get("fused")
                st = self.base.state[flat] = {
                    "step": torch.tensor(
                        step, dtype=torch.float32, device=flat.device if on_device else "cpu"
                    )
                }
            for k in keys:
                if k not in st:
                    st[k] = torch.zeros_like(flat, memory_format=torch.contiguous_format)
            if torch.is_tensor(st.get("step")):
                st["step"].fill_(step)
            else:
                st["step"] = step

    def check_keys(self, keys: list[str]) -> None:
        for flat in self.flats:
            st = self.base.state.get(flat) or {}
            extra = [
                k
                for k, v in st.items()
                if torch.is_tensor(v) and v.shape == flat.shape and k != "step" and k not in keys
            ]
            if extra:
                raise CheckpointFormatError(
                    INDEX, f"the optimizer has state {extra} that the checkpoint does not"
                )

    def _moment(self, flat: torch.Tensor, key: str, start: int, numel: int):
        st = self.base.state.get(flat)
        if not st or key not in st:
            return None
        return st[key].view(-1).narrow(0, start, numel)

    # -- parameters -------------------------------------------------------------------

    def _param(self, name: str, p: torch.nn.Parameter) -> _Param:
        shape = tuple(getattr(p, "ds_shape", p.shape))
        numel = math.prod(shape)
        rec = _Param(name, p, shape, numel)
        if self.kind == "zero3":
            self._zero3(rec)
        elif self.kind == "hp":
            self._hp(rec)
        else:
            self._whole(rec)
        return rec

    def _hp(self, rec: _Param) -> None:
        p = rec.param
        rec.lp_get = lambda: p.detach().reshape(-1)
        rec.lp_set = lambda v: p.data.view(-1).copy_(v)
        if not hasattr(p, "_hp_mapping"):
            return  # not trained: its weight is all there is
        frag = p._hp_mapping
        if frag is None:
            return  # this rank holds none of it
        flat = self.flats[frag.param_group_index]
        hp_start = frag.hp_fragment_address.start
        n = frag.lp_fragment_address.numel
        expected = flat.narrow(0, hp_start, n)
        hp = frag.hp_fragment
        if (
            hp.data_ptr() != expected.data_ptr()
            or hp.numel() != n
            or frag.hp_fragment_address.numel != n
        ):
            raise RuntimeError(
                f"{rec.name}: DeepSpeed's fragment mapping does not point into its flat fp32 "
                "partition as expected (DeepSpeed internals changed?)"
            )

        def get(kind: str):
            return expected if kind == FP32 else self._moment(flat, kind, hp_start, n)

        def set_(kind: str, v: torch.Tensor) -> None:
            get(kind).copy_(v)

        rec.slots.append(_Slot(rec.name, frag.lp_fragment_address.start, n, (), True, get, set_))

    def _whole(self, rec: _Param) -> None:
        p = rec.param
        owner = self.replica == 0
        master = p if self.kind == "plain" else self._master.get(id(p))
        if master is not None and id(master) not in self._in_opt:
            master = None
        if master is None or master is not p:
            rec.lp_get = lambda: p.detach().reshape(-1)
            rec.lp_set = lambda v: p.data.view(-1).copy_(v)
        if master is None:
            return

        def get(kind: str):
            if kind == FP32:
                return master.detach().view(-1)
            return self._moment(master, kind, 0, rec.numel)

        def set_(kind: str, v: torch.Tensor) -> None:
            get(kind).copy_(v)

        rec.slots.append(_Slot(rec.name, 0, rec.numel, (), owner, get, set_))

    def _zero3(self, rec: _Param) -> None:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        from deepspeed.utils import (
            safe_get_local_fp32_param,
            safe_get_local_optimizer_state,
            safe_set_local_fp32_param,
            safe_set_local_optimizer_state,
        )

        p, opt = rec.param, self.opt
        part = p.ds_tensor.ds_numel  # padded partition size
        start = opt._get_param_partition_rank(p) * part
        n = max(0, min(part, rec.numel - start))

        def available() -> bool:
            return p.ds_status == ZeroParamStatus.AVAILABLE and p.data.numel() == rec.numel

        # Persistent (small) params stay gathered between steps: their whole copy is
        # set on load too, or it would be stale until ZeRO-3 next gathers them.
        rec.lp_saved = False
        if available():
            rec.lp_set = lambda v: p.data.view(-1).copy_(v)
        if n == 0:
            return
        if not p.requires_grad:  # not trained: its partition of the weight is all there is

            def get_w(kind: str):
                return p.ds_tensor.view(-1).narrow(0, 0, n)

            def set_w(kind: str, v: torch.Tensor) -> None:
                get_w(kind).copy_(v)
                if available():
                    p.data.view(-1).narrow(0, start, n).copy_(v)

            rec.slots.append(_Slot(rec.name, start, n, (WEIGHT,), True, get_w, set_w))
            return

        def get(kind: str):
            if kind != FP32 and not all(self.base.state.get(f) for f in self.flats):
                return None
            local = (
                safe_get_local_fp32_param(p)
                if kind == FP32
                else safe_get_local_optimizer_state(p, kind)
            )
            return local.view(-1).narrow(0, 0, n)

        def set_(kind: str, v: torch.Tensor) -> None:
            local = (
                safe_get_local_fp32_param(p)
                if kind == FP32
                else safe_get_local_optimizer_state(p, kind)
            )
            padded = local.detach().clone().view(-1)
            padded[:n].copy_(v)
            if kind == FP32:
                safe_set_local_fp32_param(p, padded)
            else:
                safe_set_local_optimizer_state(p, padded, kind)

        rec.slots.append(_Slot(rec.name, start, n, (), True, get, set_))

    def finish_load(self) -> None:
        if self.kind == "zero3":  # low-precision partitions from the fp32 ones
            for sub_group in range(len(self.opt.fp32_partitioned_groups_flat)):
                self.opt._reassign_or_swap_out_partitioned_parameters(sub_group)


# --- save ------------------------------------------------------------------------------


class HostCopier:
    """Host copies of device tensors, each owned by the caller (nothing shared with the
    engine), contiguous and 1-D.

    CPU tensors are cloned. CUDA tensors are copied into freshly allocated pinned host
    buffers, each enqueued (non_blocking) on a side stream of its device that first
    waits for what the current stream has queued so far: the copies see every write
    queued before them, and the host only enqueues them instead of blocking on each.
    `wait()` blocks once, until all of them have landed; until it returns, a CUDA
    copy's contents are undefined, and its source must not be written. The buffers are
    fresh at every save, never reused by Spotline: the upload thread reads a snapshot
    while training goes on (torch's pinned-memory cache recycles a buffer once freed).
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._sources: list[torch.Tensor] = []  # alive until their copies have landed

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.device.type == "cpu":
            return t.reshape(-1).clone(memory_format=torch.contiguous_format)
        if t.device.type != "cuda":
            return t.reshape(-1).to("cpu", copy=True).contiguous()
        stream = self._streams.get(t.device)
        if stream is None:
            stream = self._streams[t.device] = torch.cuda.Stream(t.device)
        # Waited on at every copy: `t` may be the output of a kernel queued just now.
        stream.wait_stream(torch.cuda.current_stream(t.device))
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            out.copy_(t, non_blocking=True)
        # Kept alive so the allocator cannot hand its memory to the current stream
        # before the side stream has read it (a temporary from a getter, say).
        self._sources.append(t)
        return out.view(-1)

    def wait(self) -> None:
        """Block until every copy enqueued so far is on the host."""
        for stream in self._streams.values():
            stream.synchronize()
        self._sources.clear()


def _topology_meta(engine, topo) -> dict[str, Any]:
    zero = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else 0
    return {
        "pipeline_stages": topo.pipeline_stages,
        "replicas": topo.replicas,
        "stage": topo.stage,
        "replica": topo.replica,
        "rank": topo.rank,
        "zero_stage": int(zero),
    }


def snapshot(engine, topo, *, write_weights: bool) -> RankSnapshot:
    """Host copies of the state this rank owns. No collective, no file I/O.

    `write_weights`: also take the stage's low-precision weights (pass True on replica
    0 of each stage). `topo` needs pipeline_stages, replicas, rank, stage, replica.
    """
    lay = _Layout(engine, topo)
    keys = lay.optim_keys()
    host = HostCopier()
    tensors: dict[str, torch.Tensor] = {}
    entries: list[dict] = []

    def add(rec: _Param, kind: str, start: int, t: torch.Tensor) -> None:
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
                "dtype": _dtype_name(t.dtype),
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
    sched = engine.lr_scheduler
    step = lay.adam_step()
    meta = {
        "format": FORMAT,
        "adam_step": 0.0 if step is None else step,
        "optim_keys": keys,
        "lr_scheduler": sched.state_dict() if sched is not None else None,
        "global_steps": int(engine.global_steps),
        "global_samples": int(engine.global_samples),
        "topology": _topology_meta(engine, topo),
        "optimizer": lay.kind,
    }
    try:
        json.dumps(meta)
    except TypeError as e:
        raise TypeError(f"training state meta is not JSON-able ({e})") from None
    return RankSnapshot(tensors, entries, meta)


def _header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return n, json.loads(f.read(n))


def _hashes(f, offset: int, nbytes: int, chunk: int) -> tuple[str, list[str]]:
    whole = hashlib.sha256()
    chunks = []
    f.seek(offset)
    left = nbytes
    while left > 0:
        data = f.read(min(chunk, left))
        if not data:
            raise OSError("file shorter than its header says")
        whole.update(data)
        chunks.append(hashlib.sha256(data).hexdigest())
        left -= len(data)
    if not chunks:
        chunks.append(hashlib.sha256(b"").hexdigest())
    return whole.hexdigest(), chunks


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
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / STATE_FILE
    tmp = out_dir / (STATE_FILE + ".tmp")
    save_tensors(tmp, snap.tensors, {"format": FORMAT})  # the meta lives in meta.json
    header_len, header = _header(tmp)
    data_start = 8 + header_len
    rel = Path(os.path.relpath(path, Path(root) if root is not None else out_dir.parent))
    entries = []
    with open(tmp, "rb") as f:
        for e in snap.entries:
            info = header[e["key"]]
            begin, end = info["data_offsets"]
            nbytes = end - begin
            itemsize = _DTYPES[e["dtype"]].itemsize
            if _ST_DTYPES.get(info["dtype"]) != e["dtype"] or nbytes != e["numel"] * itemsize:
                raise RuntimeError(f"{tmp}: {e['key']} was not written as recorded")
            sha, chunks = _hashes(f, data_start + begin, nbytes, chunk_bytes)
            entries.append(
                {
                    **e,
                    "file": rel.as_posix(),
                    "offset": data_start + begin,
                    "nbytes": nbytes,
                    "sha256": sha,
                    "chunk_bytes": chunk_bytes,
                    "chunk_sha256": chunks,
                }
            )
    os.replace(tmp, path)
    # Written last: a rank directory with meta.json is complete.
    save_json(out_dir / META_FILE, {"format": FORMAT, "meta": snap.meta, "entries": entries})
    return entries


# --- index and readers -----------------------------------------------------------------


def rank_dir(root: str | os.PathLike[str], rank: int) -> Path:
    """The directory rank `rank` writes to under the index root."""
    return Path(root) / f"rank_{rank:05d}"


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


# --- load ------------------------------------------------------------------------------

_ENTRY_FIELDS = {
    "key": str,
    "param": str,
    "kind": str,
    "start": int,
    "numel": int,
    "shape": list,
    "dtype": str,
    "file": str,
    "offset": int,
    "nbytes": int,
    "sha256": str,
    "chunk_bytes": int,
    "chunk_sha256": list,
}


def _check_entry(e: Any) -> None:
    if not isinstance(e, dict):
        raise CheckpointFormatError(INDEX, f"index entry {e!r} is not an object")
    where = e.get("file", INDEX)
    for k, typ in _ENTRY_FIELDS.items():
        if not isinstance(e.get(k), typ):
            raise CheckpointFormatError(where, f"index entry {e.get('key')!r} has no valid {k!r}")
    try:
        check_relpath(e["file"])
    except UnsafePathError as err:
        raise CheckpointFormatError(
            where, f"index entry {e['key']!r}: leaves the checkpoint ({err.why})"
        ) from None
    if e["dtype"] not in _DTYPES:
        raise CheckpointFormatError(where, f"{e['key']}: unknown dtype {e['dtype']!r}")
    numel = math.prod(e["shape"])
    if e["start"] < 0 or e["numel"] <= 0 or e["start"] + e["numel"] > numel:
        raise CheckpointFormatError(where, f"{e['key']}: range outside its param's shape")
    if e["nbytes"] != e["numel"] * _DTYPES[e["dtype"]].itemsize or e["chunk_bytes"] <= 0:
        raise CheckpointFormatError(where, f"{e['key']}: byte size does not match numel/dtype")
    if len(e["chunk_sha256"]) != max(1, -(-e["nbytes"] // e["chunk_bytes"])):
        raise CheckpointFormatError(where, f"{e['key']}: wrong number of chunk hashes")


class _Index:
    def __init__(self, index: list[dict]):
        self.by: dict[tuple[str, str], list[dict]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for e in index:
            _check_entry(e)
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
        return _DTYPES[self.by[(name, kind)][0]["dtype"]]

    def cover(self, name: str, kind: str, lo: int, hi: int) -> list[tuple[dict, int, int]]:
        """Pieces (entry, first, last) of saved entries that cover elements [lo, hi)."""
        entries = self.by.get((name, kind))
        if not entries:
            raise CheckpointFormatError(
                INDEX,
                f"checkpoint has no {kind!r} state for {name}: elements [{lo}, {hi}) are not "
                "covered by the saved fragments (a rank's state missing?)",
            )
        pieces = []
        cur = lo
        while cur < hi:
            best = None
            for e in entries:
                if e["start"] > cur:
                    break
                if e["start"] + e["numel"] > cur and (
                    best is None or e["start"] + e["numel"] > best["start"] + best["numel"]
                ):
                    best = e
            if best is None:
                raise CheckpointFormatError(
                    INDEX,
                    f"{name}/{kind}: elements from {cur} (of [{lo}, {hi})) are not covered by "
                    "the saved fragments (a rank's state missing?)",
                )
            end = min(hi, best["start"] + best["numel"])
            pieces.append((best, cur, end))
            cur = end
        return pieces


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
    idx = _Index(index)
    lay = _Layout(engine, topo)
    keys = list(meta.get("optim_keys") or MOMENTS)
    lay.check_keys(keys)

    # Plan: which element range of which (param, kind) this rank needs, all checked
    # against the index before anything is read.
    plan: dict[tuple[str, str], list[int]] = {}

    def need(name: str, kind: str, lo: int, hi: int) -> None:
        r = plan.setdefault((name, kind), [lo, hi])
        r[0], r[1] = min(r[0], lo), max(r[1], hi)

    lp_kind: dict[str, str] = {}
    for rec in lay.params:
        if rec.name not in idx.shapes:
            raise CheckpointFormatError(INDEX, f"checkpoint has no state for parameter {rec.name}")
        if idx.shapes[rec.name] != rec.shape:
            raise CheckpointFormatError(
                INDEX,
                f"{rec.name}: saved shape {list(idx.shapes[rec.name])} != model shape "
                f"{list(rec.shape)}",
            )
        for slot in rec.slots:
            for kind in slot.kinds or (FP32, *keys):
                need(rec.name, kind, slot.start, slot.start + slot.numel)
        if rec.lp_set is not None:
            dtype = rec.param.dtype
            if idx.has(rec.name, WEIGHT) and idx.dtype(rec.name, WEIGHT) == dtype:
                lp_kind[rec.name] = WEIGHT
            elif idx.has(rec.name, FP32):
                lp_kind[rec.name] = FP32
            else:
                lp_kind[rec.name] = WEIGHT
            need(rec.name, lp_kind[rec.name], 0, rec.numel)
    pieces = {}
    for (name, kind), (lo, hi) in plan.items():
        if kind != WEIGHT and idx.has(name, kind) and idx.dtype(name, kind) != torch.float32:
            raise CheckpointFormatError(INDEX, f"{name}/{kind}: saved as {idx.dtype(name, kind)}")
        pieces[(name, kind)] = idx.cover(name, kind, lo, hi)

    # Read and verify everything before changing the engine.
    stats = _new_stats()
    data = {
        (name, kind): _assemble(idx, name, kind, *plan[(name, kind)], parts, read, stats)
        for (name, kind), parts in pieces.items()
    }

    # Apply.
    lay.ensure_state(keys, float(meta.get("adam_step") or 0.0))
    with torch.no_grad():
        for rec in lay.params:
            for slot in rec.slots:
                for kind in slot.kinds or (FP32, *keys):
                    lo, _ = plan[(rec.name, kind)]
                    src = data[(rec.name, kind)][slot.start - lo : slot.start - lo + slot.numel]
                    live = slot.get(kind)
                    slot.set(kind, src.to(device=live.device, dtype=live.dtype))
            if rec.lp_set is not None:
                full = data[(rec.name, lp_kind[rec.name])]
                rec.lp_set(full.to(device=rec.param.device, dtype=rec.param.dtype))
        lay.finish_load()
    sched = engine.lr_scheduler
    if sched is not None and meta.get("lr_scheduler") is not None:
        # The position in the schedule is the checkpoint's; the peak lr is this job's
        # (a resume with a retuned train.lr, e.g. a PBT exploit, must not undo it).
        base_lrs = list(sched.base_lrs)
        sched.load_state_dict(meta["lr_scheduler"])
        sched.base_lrs = base_lrs
    engine.global_steps = meta["global_steps"]
    engine.global_samples = meta["global_samples"]
    return _public(stats)


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
    buf = torch.empty(hi - lo, dtype=idx.dtype(name, kind))
    for entry, first, last in parts:
        raw = _read_verified(entry, first, last, read, stats)
        buf[first - lo : last - lo] = torch.frombuffer(bytearray(raw), dtype=buf.dtype)
    return buf


def full_params(
    index: list[dict], read: Reader, names: list[str] | None = None
) -> dict[str, torch.Tensor]:
    """Whole parameters by stable name (all of them, or `names`), for exports and
    evaluation: the fp32 master (or, for a param without one, its saved weight),
    assembled from every rank's fragments with verified reads. No engine needed."""
    idx = _Index(index)
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
