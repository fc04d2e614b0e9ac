"""Sliced and cached inference over a flat layer list, for any model.

The models own their math (`forward`, and the optional `halves` and `decode` layer
protocols documented in `spotline.models.provider`); this module only drives it:

- `layerwise_forward` runs a model one unit at a time (a layer, or half a layer where
  the layer has `halves()`), yielding a label after each unit.
- `KVCache` holds one sequence's keys and values, one slot per layer, and rolls back
  to a shorter length (rejected draft tokens).
- `Decoder` feeds a sequence to a model a few tokens at a time and hands back the
  logits at the new positions: through the KV cache where every layer has `decode`,
  by recomputing the whole prefix otherwise (`Decoder.kv_cache` says which).

Every unit runs under `torch.no_grad()` that closes before the yield: grad mode is
thread-global, and a `no_grad` block held open across a yield would leak into whatever
the caller (the training step) runs meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

Units = Generator[str, None, torch.Tensor]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0
) -> torch.Tensor:
    """Causal attention of the last q.shape[2] positions over all k.shape[2] positions.

    q [B, H, t, hd]; k, v [B, H_kv, S, hd] with S >= t, the queries being positions
    S-t..S-1. H_kv < H is grouped-query attention: k/v head j serves the H/H_kv
    consecutive query heads from j*H/H_kv (HF's `repeat_kv` order); SDPA reads the
    shared heads where they are (`enable_gqa`) instead of a repeated copy of the cache.
    SDPA's `is_causal` aligns its mask top-left (query i sees keys <= i), which is right
    only when t == S, so a shorter q gets an explicit mask (query i sees keys <= S-t+i).
    One new token sees everything and needs none.
    """
    t, s = q.shape[2], k.shape[2]
    kw = {"dropout_p": dropout_p, "enable_gqa": k.shape[1] != q.shape[1]}
    if t == s:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
    if t == 1:
        return F.scaled_dot_product_attention(q, k, v, **kw)
    mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)


class LayerKV:
    """One layer's cached keys and values [B, H, length, hd].

    The buffer is allocated at the first `append`, `capacity` positions long, so a
    decoding step writes into it instead of copying the whole cache."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new positions' k, v [B, H, t, hd]; returns all cached k, v so far."""
        b, h, t, hd = k.shape
        end = self.length + t
        if end > self.capacity:
            raise ValueError(
                f"KV cache holds at most {self.capacity} positions (the model's seq_len); "
                f"{self.length} cached + {t} new do not fit"
            )
        if self._k is None:
            self._k = k.new_empty(b, h, self.capacity, hd)
            self._v = v.new_empty(b, h, self.capacity, hd)
        self._k[:, :, self.length : end] = k
        self._v[:, :, self.length : end] = v
        self.length = end
        return self._k[:, :, :end], self._v[:, :, :end]

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


class KVCache:
    """One sequence's cached state in a model: a `LayerKV` per layer (the embedding and
    the head ignore theirs) and the number of positions held."""

    def __init__(self, n_layers: int, capacity: int):
        self.capacity = capacity
        self.layers = [LayerKV(capacity) for _ in range(n_layers)]
        self.length = 0

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (no-op if fewer are held)."""
        self.length = min(self.length, length)
        for layer in self.layers:
            layer.truncate(self.length)


def supports_kv_cache(model: nn.Sequential) -> bool:
    """Every layer has the cached-decoding protocol (`decode(x, cache, start)`)."""
    return all(callable(getattr(layer, "decode", None)) for layer in model)


def layer_units(layer: nn.Module) -> Sequence[tuple[str, Callable[[torch.Tensor], torch.Tensor]]]:
    """A layer's units for a sliced forward: its two halves where it has `halves()`
    (label suffixes "/attn", "/mlp"), else the whole layer ("")."""
    halves = getattr(layer, "halves", None)
    if callable(halves):
        attn, mlp = halves()
        return (("/attn", attn), ("/mlp", mlp))
    return (("", layer),)


def layerwise_forward(model: nn.Sequential, x: torch.Tensor, label: str = "target") -> Units:
    """Run `model` one unit at a time; returns the final output.

    A unit is half a layer where the layer has `halves()`, labelled
    "<label>/<layer index>/attn" and ".../mlp", else the whole layer, "<label>/<index>".
    """
    for i, layer in enumerate(model):
        for suffix, fn in layer_units(layer):
            with torch.no_grad():
                x = fn(x)
            yield f"{label}/{i}{suffix}"
    return x


def cached_forward(
    model: nn.Sequential, ids: torch.Tensor, cache: KVCache, label: str, sliced: bool = True
) -> Units:
    """Logits of the new tokens `ids` [B, t] at positions cache.length.., appending their
    keys and values to `cache`. One unit per layer ("<label>/<index>"), or the whole
    forward as one unit ("<label>") when not `sliced`."""
    start = cache.length
    if start + ids.shape[1] > cache.capacity:
        raise ValueError(
            f"positions {start}..{start + ids.shape[1] - 1} do not fit the model's "
            f"seq_len ({cache.capacity})"
        )
    x = ids
    for i, (layer, kv) in enumerate(zip(model, cache.layers, strict=True)):
        with torch.no_grad():
            x = layer.decode(x, kv, start)
        if sliced:
            yield f"{label}/{i}"
    cache.length = start + ids.shape[1]
    if not sliced:
        yield label
    return x


class Decoder:
    """One sequence decoded by one model, fed a few tokens at a time.

    `feed(tokens)` appends tokens to the sequence and returns the model's logits at
    their positions, [len(tokens), V]; `rollback(n)` forgets everything after the
    first n tokens. With a KV cache (`kv_cache`, when every layer has `decode`) a feed
    computes only the new positions; without one it recomputes the whole prefix, so
    any model decodes, only slower.
    """

    def __init__(self, model: nn.Sequential, capacity: int | None = None):
        self.model = model
        self.capacity = capacity if capacity is not None else model.seq_len
        self.kv_cache = supports_kv_cache(model)
        self.cache = KVCache(len(model), self.capacity) if self.kv_cache else None
        self.tokens: list[int] = []
        self.device = next(model.parameters()).device

    @property
    def length(self) -> int:
        """Tokens whose state the model holds."""
        return len(self.tokens)

    def feed(self, tokens: list[int], label: str, sliced: bool = True) -> Units:
        """Logits [len(tokens), V] at the new positions; units as `cached_forward`
        (with a KV cache) or `layerwise_forward` (without), or one unit if not `sliced`."""
        if not tokens:
            raise ValueError("feed needs at least one token")
        if self.cache is not None:
            ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
            logits = yield from cached_forward(self.model, ids, self.cache, label, sliced)
        else:
            ids = torch.tensor([self.tokens + tokens], dtype=torch.long, device=self.device)
            if ids.shape[1] > self.capacity:
                raise ValueError(
                    f"{ids.shape[1]} tokens do not fit the model's seq_len ({self.capacity})"
                )
            if sliced:
                logits = yield from layerwise_forward(self.model, ids, label)
            else:
                with torch.no_grad():
                    logits = self.model(ids)
                yield label
        self.tokens += tokens
        return logits[0, -len(tokens) :]

    def rollback(self, length: int) -> None:
        """Keep only the first `length` tokens (no-op if fewer are held)."""
        del self.tokens[length:]
        if self.cache is not None:
            self.cache.truncate(len(self.tokens))


__all__ = [
    "Decoder",
    "KVCache",
    "LayerKV",
    "attend",
    "cached_forward",
    "layer_units",
    "layerwise_forward",
    "supports_kv_cache",
]
