"""The quickstart's GPT decoder as a flat layer list: embedding, N blocks, head.

Learned positions, pre-norm LayerNorm blocks with causal self-attention and a GELU
MLP. The layers implement the optional `halves` and `decode` protocols
(`spotline.models.provider`): backfill slices a block in two, and decodes with a KV
cache. Each layer draws its initialisation (`init_weights`) from its own generator,
seeded from (base seed, layer index), so the initial weights do not depend on how the
model is split into pipeline stages.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from spotline.config.model import GptModelSpec
from spotline.models.decode import LayerKV, attend
from spotline.models.provider import LayerDef, ModelDef, init_unless_meta, lm_loss, seeded


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, d_model: int, seq_len: int, dropout: float, seed: int):
        super().__init__()
        self.seed = seed
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        init_unless_meta(self)

    def init_weights(self) -> None:
        g = seeded(self.seed)
        nn.init.normal_(self.tok.weight, std=0.02, generator=g)
        nn.init.normal_(self.pos.weight, std=0.02, generator=g)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.decode(idx, None, 0)

    def decode(self, idx: torch.Tensor, cache: LayerKV | None, start: int) -> torch.Tensor:
        """Token ids at positions start..start+t-1 (cached decoding; no cache of its own)."""
        pos = torch.arange(start, start + idx.shape[1], device=idx.device)
        return self.drop(self.tok(idx) + self.pos(pos)[None])


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention."""

    def __init__(self, d_model: int, n_heads: int, n_layers: int, dropout: float, seed: int):
        super().__init__()
        self.seed, self.n_layers = seed, n_layers
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)
        self.dropout = dropout
        self.drop = nn.Dropout(dropout)
        init_unless_meta(self)

    def init_weights(self) -> None:
        g = seeded(self.seed)
        for ln in (self.ln1, self.ln2):
            nn.init.ones_(ln.weight)
            nn.init.zeros_(ln.bias)
        for lin in (self.qkv, self.fc):
            nn.init.normal_(lin.weight, std=0.02, generator=g)
            nn.init.zeros_(lin.bias)
        # GPT-2 scaling of the residual projections keeps deep stacks stable.
        for lin in (self.proj, self.out):
            nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * self.n_layers), generator=g)
            nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._mlp(self._attn(x))

    def halves(self) -> tuple[Callable[[torch.Tensor], torch.Tensor], ...]:
        """(attention + residual, MLP + residual): composed, exactly `forward`."""
        return self._attn, self._mlp

    def decode(self, x: torch.Tensor, cache: LayerKV, start: int) -> torch.Tensor:
        """The new positions start.. of x, attending over `cache` (which gains their k/v)."""
        return self._mlp(self._attn(x, cache))

    def _attn(self, x: torch.Tensor, cache: LayerKV | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        if cache is not None:
            k, v = cache.append(k, v)
        y = attend(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class Head(nn.Module):
    def __init__(self, d_model: int, vocab_size: int, seed: int):
        super().__init__()
        self.seed = seed
        self.ln = nn.LayerNorm(d_model)
        self.lm = nn.Linear(d_model, vocab_size, bias=False)
        init_unless_meta(self)

    def init_weights(self) -> None:
        nn.init.ones_(self.ln.weight)
        nn.init.zeros_(self.ln.bias)
        nn.init.normal_(self.lm.weight, std=0.02, generator=seeded(self.seed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))

    def decode(self, x: torch.Tensor, cache: LayerKV, start: int) -> torch.Tensor:
        return self.forward(x)


def flops_per_token(spec: GptModelSpec, vocab_size: int) -> float:
    """Training FLOPs per token: 3 x forward, forward = L x (24d^2 + 4Td) + 2dV.

    Only matmuls count (2mnk each); attention over the full T (no causal discount);
    the embeddings are gathers (0). This is PaLM's 6N + 12LTd (see metrics/mfu.py).
    """
    d, t = spec.d_model, spec.seq_len
    block = 2 * d * 3 * d + 2 * d * d + 2 * d * 4 * d * 2 + 2 * 2 * t * d
    return 3.0 * (spec.n_layers * block + 2 * d * vocab_size)


class GptProvider:
    config_model = GptModelSpec

    def build(self, config: GptModelSpec, *, vocab_size: int, seq_len: int, seed: int) -> ModelDef:
        c = config
        block = (c.d_model, c.n_heads, c.n_layers, c.dropout)
        layers = [
            LayerDef(Embedding, (vocab_size, c.d_model, seq_len, c.dropout, seed)),
            *[LayerDef(Block, (*block, seed + 1 + i)) for i in range(c.n_layers)],
            LayerDef(Head, (c.d_model, vocab_size, seed + 1 + c.n_layers)),
        ]
        return ModelDef(
            layers=layers,
            block_class=Block,
            loss=lm_loss,
            flops_per_token=flops_per_token(c, vocab_size),
            vocab_size=vocab_size,
            seq_len=seq_len,
        )


PROVIDER = GptProvider()
