"""What a step's files are: safetensors for tensors, JSON for the rest, hashed once.

Nothing read from storage is ever unpickled. A checkpoint file is data: a safetensors
file is a JSON header plus raw tensor bytes, and its loader cannot run code, whatever
the bytes are. A file that is not what its name says (a pickle put in the bucket with
its sha256 updated in the manifest, a truncated upload) fails to parse with
`CheckpointFormatError`, which the restore path treats like corruption: it falls back
to an older committed step.

One rank's training state is two files in its rank directory (`rank_dir`):
`state.safetensors`, the rank's tensors written by safetensors, and `meta.json`, written
last (a rank directory with it is complete). The unit of state is a *fragment*: a
contiguous element range of one parameter, flattened in row-major order, named by the
parameter's stable name (`<layer index>.<param>`, the same at any number of pipeline
stages). Index entry::

    {"key": "3.attn.q.weight/exp_avg/512",   # tensor name in the file
     "param": "3.attn.q.weight", "kind": "fp32" | "exp_avg" | "exp_avg_sq" | "weight",
     "start": 512, "numel": 512,             # element range in the flattened full param
     "shape": [32, 32], "dtype": "float32",  # the full param's shape; the stored dtype
     "rank": 1,                              # the rank that wrote it
     # completed by write_rank():
     "file": "rank_00001/state.safetensors", # relative to the directory holding the
                                             # rank directories (the index root)
     "offset": 4096, "nbytes": 2048,         # the tensor's bytes inside that file
     "sha256": "...",                        # of exactly those bytes
     "chunk_bytes": 4194304, "chunk_sha256": ["...", ...]}  # of each chunk of them

Hashed once: `write_rank` reads the file safetensors wrote back once, front to back, and
in that one pass hashes every entry (whole and per chunk; an entry of one chunk is
hashed once, its whole hash being its chunk's) and the whole file. It returns each
file's size and sha256 (`RankFiles.files`), so the upload has no reason to read and hash
the files again.

Never here: engines or DeepSpeed (spotline.train), storage backends, manifests.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple

from spotline.storage import UnsafePathError, check_relpath

if TYPE_CHECKING:
    import torch

FORMAT = "spotline.sharded/1"
STATE_FILE = "state.safetensors"
META_FILE = "meta.json"
CHUNK_BYTES = 4 * 2**20
FP32 = "fp32"
WEIGHT = "weight"
MOMENTS = ("exp_avg", "exp_avg_sq")
INDEX = "<index>"  # the `path` of errors about the index rather than a file

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
"""The dtypes a checkpoint holds, by name, and their bytes per element. The layout
names them without importing torch, so a process that only moves a step's bytes (a
state keeper, a verifier) never loads it."""
_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


class CheckpointFormatError(ValueError):
    """A checkpoint file that is not a valid safetensors or JSON file of its kind."""

    def __init__(self, path: str | os.PathLike[str], reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{path}: {reason}")


_META_KEY = "spotline"


def save_tensors(
    path: str | os.PathLike[str], tensors: dict[str, torch.Tensor], meta: dict
) -> None:
    """Write `tensors` (contiguous CPU copies) and JSON-able `meta` as one safetensors file."""
    from safetensors.torch import save_file

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    flat = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    save_file(flat, str(path), metadata={_META_KEY: json.dumps(meta, sort_keys=True)})


def load_tensors(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """Read a file written by `save_tensors`; CheckpointFormatError if it is not one."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len)) if 0 < header_len < 100 * 2**20 else None
        if not isinstance(header, dict):
            raise ValueError("no safetensors header")
        tensors = load_file(str(path), device="cpu")
    except (SafetensorError, ValueError, UnicodeDecodeError, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise CheckpointFormatError(path, f"not a valid safetensors file ({e})") from None
    raw_meta = (header.get("__metadata__") or {}).get(_META_KEY)
    try:
        meta = json.loads(raw_meta) if raw_meta is not None else {}
    except ValueError as e:
        raise CheckpointFormatError(path, f"its metadata is not valid JSON ({e})") from None
    return tensors, meta


class FileDigest(NamedTuple):
    """A written file's size and sha256, known to its writer."""

    size: int
    sha256: str


def save_json(path: str | os.PathLike[str], obj: Any) -> FileDigest:
    """Write `obj` as JSON (sorted keys); the size and sha256 of the bytes written."""
    data = json.dumps(obj, sort_keys=True).encode()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(data)
    return FileDigest(len(data), hashlib.sha256(data).hexdigest())


def load_json(path: str | os.PathLike[str]) -> Any:
    """Read a JSON checkpoint file; CheckpointFormatError if it is not JSON."""
    try:
        return json.loads(Path(path).read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointFormatError(path, f"not a valid JSON file ({e})") from None


# --- one rank's files --------------------------------------------------------------------


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a checkpoint dtype name (one of `ITEMSIZE`; KeyError else)."""
    import torch

    if name not in ITEMSIZE:  # never another attribute of torch
        raise KeyError(f"{name!r} is not a checkpoint dtype ({', '.join(ITEMSIZE)})")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def rank_dir(root: str | os.PathLike[str], rank: int) -> Path:
    """The directory rank `rank` writes to under the index root."""
    return Path(root) / f"rank_{rank:05d}"


@dataclass
class RankSnapshot:
    """Host copies of one rank's state: `tensors[key]` (1-D, CPU) for each entry."""

    tensors: dict[str, torch.Tensor]
    entries: list[dict]
    meta: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass
class RankFiles:
    """What `write_rank` wrote: the completed index entries, and each file's size and
    sha256 by its path relative to the rank directory."""

    entries: list[dict]
    files: dict[str, FileDigest]
    meta: dict = field(default_factory=dict)
    """The rank's meta as its meta file holds it (`RankSnapshot.meta`)."""


class _Pass:
    """One front-to-back read of a file, every byte into the file's sha256."""

    def __init__(self, f: BinaryIO):
        self.f = f
        self.pos = 0
        self.sha = hashlib.sha256()

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise OSError("file shorter than its header says")
        self.sha.update(data)
        self.pos += n
        return data

    def skip_to(self, pos: int, step: int) -> None:
        while self.pos < pos:
            self.read(min(step, pos - self.pos))

    def finish(self, step: int) -> FileDigest:
        while data := self.f.read(step):
            self.sha.update(data)
            self.pos += len(data)
        return FileDigest(self.pos, self.sha.hexdigest())


def _entry_hashes(src: _Pass, nbytes: int, chunk: int) -> tuple[str, list[str]]:
    """(sha256 of the next `nbytes` of `src`, sha256 of each `chunk` of them)."""
    whole = hashlib.sha256() if nbytes > chunk else None
    chunks = []
    left = nbytes
    while left > 0:
        data = src.read(min(chunk, left))
        if whole is not None:
            whole.update(data)
        chunks.append(hashlib.sha256(data).hexdigest())
        left -= len(data)
    if not chunks:
        chunks.append(hashlib.sha256(b"").hexdigest())
    # One chunk: the entry's hash is that chunk's.
    return (whole.hexdigest() if whole is not None else chunks[0]), chunks


def write_rank(
    snap: RankSnapshot,
    out_dir: str | os.PathLike[str],
    *,
    root: str | os.PathLike[str] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> RankFiles:
    """Write `out_dir/state.safetensors` and `out_dir/meta.json`.

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
    rel = Path(os.path.relpath(path, Path(root) if root is not None else out_dir.parent))
    with open(tmp, "rb") as f:
        src = _Pass(f)
        header_len = int.from_bytes(src.read(8), "little")
        header = json.loads(src.read(header_len))
        data_start = 8 + header_len
        where: dict[str, tuple[int, int]] = {}
        for e in snap.entries:
            info = header[e["key"]]
            begin, end = info["data_offsets"]
            nbytes = end - begin
            itemsize = ITEMSIZE[e["dtype"]]
            if _ST_DTYPES.get(info["dtype"]) != e["dtype"] or nbytes != e["numel"] * itemsize:
                raise RuntimeError(f"{tmp}: {e['key']} was not written as recorded")
            where[e["key"]] = (data_start + begin, nbytes)
        # In file order, so that the same pass hashes the file whole.
        hashes = {}
        for key, (offset, nbytes) in sorted(where.items(), key=lambda kv: kv[1][0]):
            src.skip_to(offset, chunk_bytes)
            hashes[key] = _entry_hashes(src, nbytes, chunk_bytes)
        state_digest = src.finish(chunk_bytes)
    entries = []
    for e in snap.entries:
        offset, nbytes = where[e["key"]]
        sha, chunks = hashes[e["key"]]
        entries.append(
            {
                **e,
                "file": rel.as_posix(),
                "offset": offset,
                "nbytes": nbytes,
                "sha256": sha,
                "chunk_bytes": chunk_bytes,
                "chunk_sha256": chunks,
            }
        )
    os.replace(tmp, path)
    # Written last: a rank directory with meta.json is complete.
    meta_digest = save_json(
        out_dir / META_FILE, {"format": FORMAT, "meta": snap.meta, "entries": entries}
    )
    return RankFiles(entries, {STATE_FILE: state_digest, META_FILE: meta_digest}, snap.meta)


# --- index entries -----------------------------------------------------------------------

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


def check_entry(e: Any, checked: set[str] | None = None) -> None:
    """CheckpointFormatError unless `e` is a well-formed index entry whose file stays
    under the index root. `checked`: files already found to stay there (a rank's
    entries share one), added to."""
    if not isinstance(e, dict):
        raise CheckpointFormatError(INDEX, f"index entry {e!r} is not an object")
    where = e.get("file", INDEX)
    for k, typ in _ENTRY_FIELDS.items():
        if not isinstance(e.get(k), typ):
            raise CheckpointFormatError(where, f"index entry {e.get('key')!r} has no valid {k!r}")
    if checked is None or e["file"] not in checked:
        try:
            check_relpath(e["file"])
        except UnsafePathError as err:
            raise CheckpointFormatError(
                where, f"index entry {e['key']!r}: leaves the checkpoint ({err.why})"
            ) from None
        if checked is not None:
            checked.add(e["file"])
    if e["dtype"] not in ITEMSIZE:
        raise CheckpointFormatError(where, f"{e['key']}: unknown dtype {e['dtype']!r}")
    numel = math.prod(e["shape"])
    if e["start"] < 0 or e["numel"] <= 0 or e["start"] + e["numel"] > numel:
        raise CheckpointFormatError(where, f"{e['key']}: range outside its param's shape")
    if e["nbytes"] != e["numel"] * ITEMSIZE[e["dtype"]] or e["chunk_bytes"] <= 0:
        raise CheckpointFormatError(where, f"{e['key']}: byte size does not match numel/dtype")
    if len(e["chunk_sha256"]) != max(1, -(-e["nbytes"] // e["chunk_bytes"])):
        raise CheckpointFormatError(where, f"{e['key']}: wrong number of chunk hashes")
