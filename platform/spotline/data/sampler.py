"""Deterministic, resumable batch sampling.

Batch k is a pure function of (seed, k, its size): no iterator state to save
beyond the step number, so a resume at step k draws exactly what an
uninterrupted run would have drawn. Under the constant batch policy the size
does not depend on the number of replicas; each replica takes a contiguous
slice of the step's rows and cuts it into micro-batches of a fixed size.
"""

from __future__ import annotations

import numpy as np
import torch


class Sampler:
    def __init__(self, tokens: np.ndarray, seq_len: int, micro_batch_size: int, seed: int):
        if tokens.size < seq_len + 2:
            raise ValueError(f"need at least {seq_len + 2} tokens, got {tokens.size}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.seed = seed

    def global_rows(self, step: int, n_rows: int) -> np.ndarray:
        """[n_rows, seq_len + 1] windows of the corpus for this step."""
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, self.tokens.size - self.seq_len - 1, size=n_rows)
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        return self.tokens[idx]

    def micro_batches(
        self, step: int, replica: int, replicas: int, micro_batches: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This replica's `micro_batches` (inputs, labels) micro-batches of step `step`."""
        mbs = self.micro_batch_size
        per_replica = mbs * micro_batches
        rows = self.global_rows(step, per_replica * replicas)
        mine = rows[replica * per_replica : (replica + 1) * per_replica]
        out = []
        for i in range(micro_batches):
            chunk = torch.from_numpy(mine[i * mbs : (i + 1) * mbs].astype(np.int64))
            out.append((chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()))
        return out

    def state(self, next_step: int) -> dict:
        return {"next_step": next_step, "seed": self.seed}
