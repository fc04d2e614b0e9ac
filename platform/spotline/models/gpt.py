"""A GPT decoder as a flat layer list: embedding, N blocks, head.

The same list builds either a DeepSpeed `PipelineModule` (cut into stages at
block boundaries) or a plain `nn.Sequential` for pp=1. Each layer is seeded
from (base seed, layer index), so the initial weights do not depend on how
the model is split.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from spotline.config.schema import ModelSpec

VOCAB_SIZE = 256  # byte-level: every byte is a token, nothing to download


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def decode(tokens: list[int]) -> str:
    return bytes(int(t) & 0xFF for t in tokens).decode("utf-8", errors="replace")


class Embedding(nn.Module):
    def __init__(self, d_model: int, seq_len: int, dropout: float, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.tok = nn.Embedding(VOCAB_SIZE, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        return self.drop(self.tok(idx) + self.pos(pos)[None])


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention."""

    def __init__(self, d_model: int, n_heads: int, n_layers: int, dropout: float, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)
        self.dropout = dropout
        self.drop = nn.Dropout(dropout)
        for lin in (self.qkv, self.fc):
            nn.init.normal_(lin.weight, std=0.02)
            nn.init.zeros_(lin.bias)
        # GPT-2 scaling of the residual projections keeps deep stacks stable.
        for lin in (self.proj, self.out):
            nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * n_layers))
            nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class Head(nn.Module):
    def __init__(self, d_model: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.ln = nn.LayerNorm(d_model)
        self.lm = nn.Linear(d_model, VOCAB_SIZE, bias=False)
        nn.init.normal_(self.lm.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _layer_args(spec: ModelSpec, seed: int) -> list[tuple[type[nn.Module], tuple]]:
    """(class, args) per layer. Layer i is seeded with seed + i, so its initial weights
    are the same whichever stage builds it."""
    block = (spec.d_model, spec.n_heads, spec.n_layers, spec.dropout)
    return [
        (Embedding, (spec.d_model, spec.seq_len, spec.dropout, seed)),
        *[(Block, (*block, seed + 1 + i)) for i in range(spec.n_layers)],
        (Head, (spec.d_model, seed + 1 + spec.n_layers)),
    ]


def build_sequential(spec: ModelSpec, seed: int) -> nn.Sequential:
    """The whole model on one device (pp=1)."""
    return nn.Sequential(*[cls(*args) for cls, args in _layer_args(spec, seed)])


def build_pipeline_module(spec: ModelSpec, num_stages: int, seed: int):
    """A DeepSpeed PipelineModule; only this stage's layers are built."""
    from deepspeed.pipe import LayerSpec, PipelineModule

    layers = [LayerSpec(cls, *args) for cls, args in _layer_args(spec, seed)]
    return PipelineModule(
        layers=layers,
        num_stages=num_stages,
        loss_fn=lm_loss,
        partition_method="type:Block",
        activation_checkpoint_interval=0,
    )


def layer_param_counts(spec: ModelSpec) -> list[int]:
    """Parameters of each layer of the flat list: embedding, N blocks, head."""
    d, t = spec.d_model, spec.seq_len
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return [VOCAB_SIZE * d + t * d, *[block] * spec.n_layers, 2 * d + d * VOCAB_SIZE]


def count_params(spec: ModelSpec) -> int:
    return sum(layer_param_counts(spec))
