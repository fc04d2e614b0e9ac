"""The files of a Hugging Face checkpoint, read without loading a weight: which
safetensors files hold the weights (from `model.safetensors.index.json`, whose shard
names never leave the folder), each file's header (bounded, checked against the file's
size), and config.json as JSON.

Never pickle: a folder with only `*.bin`/`*.pt` files is refused by name. Every refusal
is an `HFCheckpointError` (a `SpecError`): the same bytes fail the same way on every
restart, so it is never retried. This room knows the file formats, not the model:
`hf.py` checks names and shapes against the spec.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from spotline.config.loader import SpecError
from spotline.storage import UnsafePathError, check_relpath

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

MAX_HEADER_BYTES = 100_000_000
"""The safetensors library's own bound on a header; a longer one is not a real file."""
_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
RESAVE = (
    "re-save it with safetensors (transformers: save_pretrained(dir, "
    "safe_serialization=True)), or point model.init_from elsewhere"
)


class HFCheckpointError(SpecError):
    """model.init_from cannot be loaded: its config.json disagrees with the spec, a
    safetensors header is not one, a tensor is missing, extra or misshapen, or only
    pickles are there. One line naming the file and the tensor; final, as a restart
    would read the same bytes."""


def parse_config(raw: bytes, name: str) -> dict[str, Any]:
    try:
        cfg = json.loads(raw)
    except ValueError as e:
        raise HFCheckpointError(f"model.init_from: {name} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise HFCheckpointError(f"model.init_from: {name} is not a JSON object")
    return cfg


def safetensors_header(
    read: Callable[[int, int], bytes], size: int, name: str
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor: (dtype, shape)} of the safetensors file `name` of `size` bytes, from its
    header alone: an 8-byte little-endian length, bounded by the file and
    MAX_HEADER_BYTES, then that much JSON whose every entry must lie inside the file.
    `read(start, end)` returns those bytes of the file. HFCheckpointError naming it."""
    if size < 8:
        raise HFCheckpointError(
            f"model.init_from: {name} is {size} bytes, too short for safetensors; {RESAVE}"
        )
    n = int.from_bytes(read(0, 8), "little")
    if n > min(size - 8, MAX_HEADER_BYTES):
        raise HFCheckpointError(
            f"model.init_from: {name} is not a safetensors file: its header length is "
            f"{n:,} bytes, in a file of {size:,}; {RESAVE}"
        )
    try:
        header = json.loads(read(8, 8 + n))
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise HFCheckpointError(
            f"model.init_from: {name} is not a safetensors file: its header is not a JSON "
            f"object; {RESAVE}"
        )
    data = size - 8 - n
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for tensor, meta in header.items():
        if tensor == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
            ok = (
                all(isinstance(d, int) and d >= 0 for d in (*shape, begin, end))
                and begin <= end <= data
                and end - begin == math.prod(shape) * _DTYPE_BYTES[dtype]
            )
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise HFCheckpointError(
                f"model.init_from: {name}: the header entry of tensor {tensor} is malformed "
                f"or lies past the end of the file ({size:,} bytes): truncated or not "
                f"safetensors; {RESAVE}"
            )
        if dtype not in _FLOAT_DTYPES:
            raise HFCheckpointError(
                f"model.init_from: HF tensor {tensor} in {name} has dtype {dtype}; weights "
                f"must be floating point ({', '.join(sorted(_FLOAT_DTYPES))}); {RESAVE}"
            )
        out[tensor] = (dtype, shape)
    return out


def check_shard_name(fname: object, where: str) -> None:
    """Refuse a shard name from the safetensors index that is not a plain file of the
    checkpoint folder itself (the one path rule, plus: no subfolder, safetensors only)."""
    try:
        check_relpath(fname)
    except UnsafePathError as e:
        why = e.why
    else:
        if "/" in fname:  # type: ignore[operator]
            why = "lies in a subfolder"
        elif not fname.endswith(".safetensors"):  # type: ignore[union-attr]
            why = "is not a .safetensors file"
        else:
            return
    raise HFCheckpointError(
        f"model.init_from: {where}/{INDEX} names shard {fname!r}, which {why}: not a shard "
        f"in {where}"
    )


def weight_files(files: dict[str, int], read_index: Callable[[], bytes], where: str):
    """(the safetensors files that hold the weights, the index's weight_map or None)."""
    if INDEX in files:
        try:
            weight_map = json.loads(read_index())["weight_map"]
            values = list(weight_map.values())
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise HFCheckpointError(
                f"model.init_from: {where}/{INDEX} is not a safetensors index: {e}"
            ) from None
        for fname in values:
            check_shard_name(fname, where)
        names = sorted(set(values))
        for fname in names:
            if fname not in files:
                raise HFCheckpointError(
                    f"model.init_from: {where}/{INDEX} lists {fname}, which is not in {where}"
                )
        return names, weight_map
    if SINGLE in files:
        return [SINGLE], None
    pickles = sorted(n for n in files if n.endswith((".bin", ".pt", ".pth")))
    hint = (
        f" (only {', '.join(pickles)}: pickles, which Spotline never reads; convert them to "
        "safetensors with transformers' save_pretrained(dir, safe_serialization=True))"
        if pickles
        else "; give a Hugging Face checkpoint directory (config.json and *.safetensors)"
    )
    raise HFCheckpointError(f"model.init_from: {where} holds no {SINGLE} nor {INDEX}{hint}")
