"""A user's model with a bug in its own code: the blocks' forward raises.

It builds (so the driver's checks pass) and fails on the first step in the workers,
where the failure must be called the user's, name this module, and not be retried.
"""

from __future__ import annotations

import torch

from custom_model import Embed, Mixer, MixerConfig, Out
from spotline.models.provider import LayerDef, ModelDef, lm_loss


class BrokenMixer(Mixer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"width {x.shape[-1]} is not supported by this block")


class BrokenProvider:
    config_model = MixerConfig

    def build(self, config: MixerConfig, *, vocab_size: int, seq_len: int, seed: int) -> ModelDef:
        w = config.width
        layers = [
            LayerDef(Embed, (vocab_size, w, seed)),
            *[LayerDef(BrokenMixer, (w, seed + 1 + i)) for i in range(config.depth)],
            LayerDef(Out, (w, vocab_size, seed + 1 + config.depth)),
        ]
        return ModelDef(
            layers=layers,
            block_class=BrokenMixer,
            loss=lm_loss,
            flops_per_token=1.0,
            vocab_size=vocab_size,
            seq_len=seq_len,
        )


class RaisingProvider(BrokenProvider):
    """Its build() itself raises."""

    def build(self, config: MixerConfig, **kwargs) -> ModelDef:
        raise ValueError(f"depth {config.depth} must be a multiple of 3")


PROVIDER = BrokenProvider()
RAISES = RaisingProvider()
