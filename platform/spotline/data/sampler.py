"""Deterministic, resumable batch sampling.

Batch k is a pure function of (seed, k): no iterator state to save beyond the
step number, so a resume at step k draws exactly what an uninterrupted run
would have drawn. The global batch does not depend on the number of replicas;
each replica takes a contiguous slice of it.
"""

from __future__ import annotations

import numpy as np
import torch


class Sampler:
    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int):
        if tokens.size < seq_len + 2:
            raise ValueError(f"need at least {seq_len + 2} tokens, got {tokens.size}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed

    def global_rows(self, step: int) -> np.ndarray:
        """[global_batch, seq_len + 1] windows of the corpus for this step."""
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, self.tokens.size - self.seq_len - 1, size=self.global_batch)
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        return self.tokens[idx]

    def micro_batches(
        self, step: int, replica: int, replicas: int, micro_batches: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This replica's share of step `step`, as (inputs, labels) micro-batches."""
        rows = self.global_rows(step)
        per_replica = self.global_batch // replicas
        mine = rows[replica * per_replica : (replica + 1) * per_replica]
        mbs = per_replica // micro_batches
        out = []
        for i in range(micro_batches):
            chunk = torch.from_numpy(mine[i * mbs : (i + 1) * mbs].astype(np.int64))
            out.append((chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()))
        return out

    def state(self, next_step: int) -> dict:
        return {"next_step": next_step, "seed": self.seed}
