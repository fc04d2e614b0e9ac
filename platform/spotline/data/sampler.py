"""Deterministic, resumable batch sampling.

Batch k is a pure function of (seed, k, its size): no iterator state to save
beyond the step number, so a resume at step k draws exactly what an
uninterrupted run would have drawn. Under the constant batch policy the size
does not depend on the number of replicas: the step's rows are drawn first, then
each replica takes a contiguous slice of them and cuts it into micro-batches of
a fixed size.

A sampler draws from one token stream (an array, an `ArrayStream` or a
`ShardedStream`) or from a weighted mixture of streams: there, each row first
picks its stream with the step's generator, by normalised weight, then a start in
it. For one stream the draws are exactly those of the byte-array sampler this
replaced (the same generator calls), so runs stay bit-for-bit reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from spotline.data.streams import ArrayStream, Mixture, TokenStream

Source = np.ndarray | TokenStream | Mixture | Sequence[tuple[TokenStream, float]]


def _as_stream(s) -> TokenStream:
    return ArrayStream(s) if isinstance(s, np.ndarray) else s


class Sampler:
    def __init__(self, tokens: Source, seq_len: int, micro_batch_size: int, seed: int):
        if isinstance(tokens, Mixture):
            parts = tokens.parts
        elif isinstance(tokens, (list, tuple)):
            parts = [(_as_stream(s), float(w)) for s, w in tokens]
        else:
            parts = [(_as_stream(tokens), 1.0)]
        for stream, _ in parts:
            if stream.size < seq_len + 2:
                raise ValueError(f"need at least {seq_len + 2} tokens, got {stream.size}")
        # One stream: no source draw at all (a one-source mixture samples as its stream).
        self.mixture = Mixture(parts) if len(parts) > 1 else None
        self.stream = parts[0][0]
        self.tokens = tokens if isinstance(tokens, np.ndarray) else None
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.seed = seed

    def draw(self, step: int, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
        """(stream index, start) of each of the step's `n_rows` rows: the whole draw."""
        rng = np.random.default_rng([self.seed, step])
        if self.mixture is None:
            starts = rng.integers(0, self.stream.size - self.seq_len - 1, size=n_rows)
            return np.zeros(n_rows, dtype=np.int64), starts
        m = self.mixture
        which = rng.choice(len(m.parts), size=n_rows, p=m.weights)
        highs = np.array([s.size - self.seq_len - 1 for s, _ in m.parts], dtype=np.int64)
        return which, rng.integers(0, highs[which])

    def _read(self, which: np.ndarray, starts: np.ndarray) -> np.ndarray:
        length = self.seq_len + 1
        if self.mixture is None:
            if isinstance(self.stream, ArrayStream):
                return self.stream.rows(starts, length)
            return self.stream.windows(starts, length)
        out = np.empty((starts.size, length), dtype=np.int64)
        for j, (stream, _) in enumerate(self.mixture.parts):
            rows = np.nonzero(which == j)[0]
            if rows.size:
                out[rows] = stream.windows(starts[rows], length)
        return out

    def global_rows(self, step: int, n_rows: int) -> np.ndarray:
        """[n_rows, seq_len + 1] windows of the stream(s) for this step (int64, or the
        array's own dtype when the sampler was given an array)."""
        return self._read(*self.draw(step, n_rows))

    def micro_batches(
        self, step: int, replica: int, replicas: int, micro_batches: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This replica's `micro_batches` (inputs, labels) micro-batches of step `step`:
        the rows of global_rows(step, ...) in its contiguous slice (only those are read)."""
        mbs = self.micro_batch_size
        per_replica = mbs * micro_batches
        which, starts = self.draw(step, per_replica * replicas)
        mine = slice(replica * per_replica, (replica + 1) * per_replica)
        rows = self._read(which[mine], starts[mine])
        out = []
        for i in range(micro_batches):
            chunk = torch.from_numpy(rows[i * mbs : (i + 1) * mbs].astype(np.int64))
            out.append((chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()))
        return out

    def state(self, next_step: int) -> dict:
        return {"next_step": next_step, "seed": self.seed}
