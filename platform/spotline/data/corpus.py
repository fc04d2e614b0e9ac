"""Reads the training corpus into one byte array, split into train and held-out.

The default corpus is the source of Python's own standard library, so a job
runs with no download. A directory, file or fsspec URI of text works too.
Reading is deterministic: files in sorted order, truncated at max_bytes.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spotline.spec.models import DataSpec


class CorpusError(ValueError):
    """The corpus cannot be read. The message names data.corpus and the fix."""


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # uint8 tokens
    heldout: np.ndarray
    source: str

    @property
    def total_bytes(self) -> int:
        return int(self.train.size + self.heldout.size)


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def _local_files(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    if root.is_file():
        return [root]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        # site-packages holds third-party code; keep the stdlib corpus the same everywhere.
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        out.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(suffixes))
    return out


def _read_local(root: Path, spec: DataSpec) -> bytes:
    if not root.exists():
        raise CorpusError(
            f"data.corpus: {root} does not exist; point it at a directory or file of text, "
            "or use 'stdlib'"
        )
    try:
        files = _local_files(root, tuple(spec.file_suffixes))
    except OSError as e:
        raise CorpusError(f"data.corpus: cannot list {root}: {e}") from None
    return _concat(files, spec.max_bytes, root, lambda p: p.read_bytes())


def _read_fsspec(uri: str, spec: DataSpec) -> bytes:
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(uri)
        if fs.isfile(path):
            files = [path]
        else:
            files = sorted(p for p in fs.find(path) if p.endswith(tuple(spec.file_suffixes)))
    except ImportError as e:
        raise CorpusError(f"data.corpus: {uri} needs an optional package: {e}") from None
    except Exception as e:  # noqa: BLE001 - any backend error means unreadable
        raise CorpusError(f"data.corpus: cannot list {uri}: {type(e).__name__}: {e}") from None
    return _concat(files, spec.max_bytes, uri, fs.cat_file)


def _concat(files, max_bytes: int, where, read) -> bytes:
    chunks: list[bytes] = []
    total = 0
    errors = 0
    for f in files:
        try:
            data = read(f)
        except OSError:
            errors += 1
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        detail = f" ({errors} files could not be read)" if errors else ""
        raise CorpusError(
            f"data.corpus: no readable text files found in {where}{detail}; check the path, "
            "its permissions and data.file_suffixes"
        )
    return b"\n".join(chunks)[:max_bytes]


def load_corpus(spec: DataSpec, min_tokens: int = 0) -> Corpus:
    """Read and split the corpus. `min_tokens` is the smallest usable split size."""
    src = spec.corpus
    if src == "stdlib":
        raw = _read_local(Path(stdlib_root()), spec)
    elif "://" in src and not src.startswith("file://"):
        raw = _read_fsspec(src, spec)
    else:
        raw = _read_local(Path(src.removeprefix("file://")).expanduser(), spec)
    arr = np.frombuffer(raw, dtype=np.uint8)
    split = int(arr.size * (1.0 - spec.heldout_fraction))
    corpus = Corpus(train=arr[:split], heldout=arr[split:], source=src)
    small = min(corpus.train.size, corpus.heldout.size)
    if small < min_tokens:
        raise CorpusError(
            f"data.corpus: {src} has {arr.size} bytes, too few for sequences of {min_tokens - 1} "
            f"tokens in both the train and held-out splits; add text, raise data.max_bytes or "
            "lower model.seq_len"
        )
    return corpus
