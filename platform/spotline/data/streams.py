"""Token streams: what a `Sampler` draws windows from.

A stream is a 1-D sequence of token ids with a `size` and
`windows(starts, length) -> int64 [n, length]`. `ArrayStream` wraps an array in
memory (a text corpus); `ShardedStream` reads memory-mapped shards of a prepared
dataset, across shard boundaries, opening each shard only when a window first
touches it; `Mixture` is weighted streams (one per dataset of a mixture).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class TokenStream(Protocol):
    size: int

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """int64 [len(starts), length]: tokens[s : s + length] for each start s."""
        ...


def _check_starts(starts: np.ndarray, length: int, size: int) -> np.ndarray:
    starts = np.asarray(starts, dtype=np.int64).reshape(-1)
    if starts.size and (starts.min() < 0 or starts.max() + length > size):
        raise IndexError(
            f"windows of {length} tokens at starts {int(starts.min())}..{int(starts.max())} "
            f"run past the stream's {size} tokens"
        )
    return starts


class ArrayStream:
    """An in-memory token array as a stream."""

    def __init__(self, tokens: np.ndarray):
        self.tokens = np.asarray(tokens).reshape(-1)
        self.size = int(self.tokens.size)

    def rows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """The windows in the array's own dtype (what `Sampler.global_rows` returns)."""
        idx = np.asarray(starts)[:, None] + np.arange(length)[None, :]
        return self.tokens[idx]

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        starts = _check_starts(starts, length, self.size)
        return self.rows(starts, length).astype(np.int64)

    def __repr__(self) -> str:
        return f"ArrayStream({self.size} tokens, {self.tokens.dtype})"


class ShardedStream:
    """Positions [lo, hi) of the concatenation of shards, each memory-mapped on first use.

    `open_shard(i)` returns shard i's 1-D array (a read-only memmap from the node-local
    cache); `sizes[i]` is its length in tokens. Reading a window copies only the pages
    it touches, so no process ever holds a dataset in RAM.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        open_shard: Callable[[int], np.ndarray],
        lo: int = 0,
        hi: int | None = None,
        *,
        name: str = "",
        _shared: dict | None = None,
    ):
        self.sizes = [int(s) for s in sizes]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)])
        total = int(self.offsets[-1])
        self.lo = int(lo)
        self.hi = total if hi is None else int(hi)
        if not 0 <= self.lo <= self.hi <= total:
            raise ValueError(f"bad range [{lo}, {hi}) of {total} tokens")
        self.size = self.hi - self.lo
        self.name = name
        self._open = open_shard
        # Opened shards are shared by the views of one dataset (train, held-out).
        self._shared = _shared if _shared is not None else {"maps": {}, "lock": threading.Lock()}

    def view(self, lo: int, hi: int, name: str = "") -> ShardedStream:
        """Positions [lo, hi) of this stream, as a stream sharing its open shards."""
        if not 0 <= lo <= hi <= self.size:
            raise ValueError(f"bad range [{lo}, {hi}) of {self.size} tokens")
        return ShardedStream(
            self.sizes,
            self._open,
            self.lo + lo,
            self.lo + hi,
            name=name or self.name,
            _shared=self._shared,
        )

    def shard(self, i: int) -> np.ndarray:
        maps = self._shared["maps"]
        arr = maps.get(i)
        if arr is None:
            with self._shared["lock"]:
                arr = maps.get(i)
                if arr is None:
                    arr = maps[i] = self._open(i)
        return arr

    def opened(self) -> list[int]:
        """Indices of the shards opened so far (by any view of this dataset)."""
        return sorted(self._shared["maps"])

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        starts = _check_starts(starts, length, self.size) + self.lo
        out = np.empty((starts.size, length), dtype=np.int64)
        first = np.searchsorted(self.offsets, starts, side="right") - 1
        for row, (pos, k) in enumerate(zip(starts.tolist(), first.tolist(), strict=True)):
            done = 0
            while done < length:
                # Shards may be empty: skip to the one that holds `pos`.
                while pos >= self.offsets[k + 1]:
                    k += 1
                begin = pos - int(self.offsets[k])
                take = min(length - done, self.sizes[k] - begin)
                out[row, done : done + take] = self.shard(k)[begin : begin + take]
                done += take
                pos += take
        return out

    def __repr__(self) -> str:
        return (
            f"ShardedStream({self.name or 'tokens'} [{self.lo}, {self.hi}) of "
            f"{len(self.sizes)} shards)"
        )


class Mixture:
    """Weighted streams: a `Sampler` picks each row's stream by normalised weight. As a
    stream itself, the streams' concatenation (in order)."""

    def __init__(self, parts: Sequence[tuple[TokenStream, float]]):
        if not parts:
            raise ValueError("a mixture needs at least one stream")
        self.parts = [(s, float(w)) for s, w in parts]
        for _, w in self.parts:
            if not w > 0:
                raise ValueError(f"mixture weights must be > 0, got {w}")
        total = sum(w for _, w in self.parts)
        self.weights = np.array([w / total for _, w in self.parts])
        self.offsets = np.concatenate([[0], np.cumsum([s.size for s, _ in self.parts])])
        self.size = int(self.offsets[-1])

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        starts = _check_starts(starts, length, self.size)
        out = np.empty((starts.size, length), dtype=np.int64)
        which = np.searchsorted(self.offsets, starts, side="right") - 1
        for j, (stream, _) in enumerate(self.parts):
            rows = np.nonzero(which == j)[0]
            if rows.size == 0:
                continue
            local = starts[rows] - self.offsets[j]
            if (local + length > stream.size).any():
                raise IndexError("a window of a mixture may not span two of its streams")
            out[rows] = stream.windows(local, length)
        return out

    def __repr__(self) -> str:
        inner = ", ".join(
            f"{s!r} x {w:.3g}"
            for s, w in zip([s for s, _ in self.parts], self.weights, strict=True)
        )
        return f"Mixture({inner})"


def split_point(n_tokens: int, heldout_fraction: float) -> int:
    """Where the held-out tail of a stream of `n_tokens` starts."""
    return int(n_tokens * (1.0 - heldout_fraction))
