"""The only file formats a checkpoint holds: safetensors for tensors, JSON for the rest.

Nothing read from storage is ever unpickled. A checkpoint file is data: a safetensors
file is a JSON header plus raw tensor bytes, and its loader cannot run code, whatever
the bytes are. A file that is not what its name says (a pickle put in the bucket with
its sha256 updated in the manifest, a truncated upload) fails to parse with
`CheckpointFormatError`, which the restore path treats like corruption: it falls back
to an older committed step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch


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


def save_json(path: str | os.PathLike[str], obj: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, sort_keys=True))


def load_json(path: str | os.PathLike[str]) -> Any:
    """Read a JSON checkpoint file; CheckpointFormatError if it is not JSON."""
    try:
        return json.loads(Path(path).read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointFormatError(path, f"not a valid JSON file ({e})") from None
