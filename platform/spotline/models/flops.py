"""What each layer of a `ModelDef` computes: its width and its share of the FLOPs.

Counted on the meta device, where nothing is allocated, so any model (a 70B one on a
laptop) is measured without its weights. `spotline.planning` cuts stages and predicts
step times from these figures; `spotline.metrics.mfu` counts HFU with them. The
conventions are those of `spotline.metrics.mfu` (6·N + 12·T·d per token).
"""

from __future__ import annotations

import torch
from torch import nn

from spotline.config.schema import JobSpec
from spotline.models import ModelDef, model_def


def model_width(spec: JobSpec, model: ModelDef | None = None) -> int:
    """The hidden width the blocks pass on: model.d_model of the built-in kinds; of a
    custom model, the last dimension of what its first layer (the embedding) returns,
    found on the meta device, where nothing is allocated."""
    d = getattr(spec.model, "d_model", None)
    if d:
        return int(d)
    model = model or model_def(spec)
    try:
        with torch.device("meta"):
            out = model.layers[0].build()(torch.zeros(1, model.seq_len, dtype=torch.long))
        return int(out.shape[-1])
    except Exception:  # noqa: BLE001 - a first layer that cannot run on meta: a guess
        return 1024


def layer_flops_per_token(spec: JobSpec, model: ModelDef | None = None) -> list[float]:
    """Training FLOPs per token of each layer: 6 x the weights of its matrix
    multiplications (nn.Linear: embeddings are gathers), plus 12·T·d of attention per
    block, scaled so the layers add up to the provider's own `flops_per_token`."""
    model = model or model_def(spec)
    d = model_width(spec, model)
    raw = []
    with torch.device("meta"):
        for ld in model.layers:
            layer = ld.build()
            linear = sum(m.weight.numel() for m in layer.modules() if isinstance(m, nn.Linear))
            attention = 12.0 * model.seq_len * d if ld.cls is model.block_class else 0.0
            raw.append(6.0 * linear + attention)
    scale = model.flops_per_token / sum(raw) if sum(raw) > 0 else 0.0
    return [scale * r for r in raw]
