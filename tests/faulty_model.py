"""A user's model with a bug in its own code: the blocks' forward raises.

It builds (so the driver's checks pass) and fails on the first step in the workers,
where the failure must be called the user's, name this module, and not be retried.
"""

from __future__ import annotations

import torch

from custom_model import Mixer, MixerConfig, MixerProvider
from spotline.models.provider import ModelDef


class BrokenMixer(Mixer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"width {x.shape[-1]} is not supported by this block")


class BrokenProvider(MixerProvider):
    block = BrokenMixer


class RaisingProvider(BrokenProvider):
    """Its build() itself raises."""

    def build(self, config: MixerConfig, **kwargs) -> ModelDef:
        raise ValueError(f"depth {config.depth} must be a multiple of 3")


PROVIDER = BrokenProvider()
RAISES = RaisingProvider()
