"""A user's own architecture, outside the Spotline package: a tiny causal "decoder" whose
blocks mix tokens with a causal running mean instead of attention.

The tests train it through `model: {kind: custom, provider: "custom_model:PROVIDER"}`,
with this directory shipped to the workers by Ray's runtime_env.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from spotline.models.provider import LayerDef, ModelDef, lm_loss


class MixerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    width: int = Field(32, gt=0)
    depth: int = Field(2, gt=0)
    api_token: str | None = None  # a provider may fetch its own assets with a credential


class Embed(nn.Module):
    def __init__(self, vocab: int, width: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.tok = nn.Embedding(vocab, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids)


class Mixer(nn.Module):
    def __init__(self, width: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Linear(width, width)
        self.ff = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=h.dtype)[None, :, None]
        causal_mean = h.cumsum(dim=1) / steps  # position t sees tokens <= t only
        return x + self.mix(causal_mean) + self.ff(h)


class Out(nn.Module):
    def __init__(self, width: int, vocab: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.lm = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(x)


class MixerProvider:
    config_model = MixerConfig
    block: type[nn.Module] = Mixer

    def build(self, config: MixerConfig, *, vocab_size: int, seq_len: int, seed: int) -> ModelDef:
        w = config.width
        layers = [
            LayerDef(Embed, (vocab_size, w, seed)),
            *[LayerDef(self.block, (w, seed + 1 + i)) for i in range(config.depth)],
            LayerDef(Out, (w, vocab_size, seed + 1 + config.depth)),
        ]
        per_block = 2 * w * w + 2 * w * 2 * w * 2
        return ModelDef(
            layers=layers,
            block_class=self.block,
            loss=lm_loss,
            flops_per_token=3.0 * (config.depth * per_block + 2 * w * vocab_size),
            vocab_size=vocab_size,
            seq_len=seq_len,
        )


PROVIDER = MixerProvider()
