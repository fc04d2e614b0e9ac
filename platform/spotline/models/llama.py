"""A Llama-family decoder as a flat layer list: embedding, N blocks, head.

The architecture of Llama 2/3 (and of Hugging Face's `LlamaForCausalLM`, which it
matches weight for weight, see `spotline.models.hf`):

- `Embedding`: the token embedding only; positions enter as rotary embeddings.
- `Block`: pre-norm. RMSNorm -> grouped-query causal self-attention with rotary
  position embeddings (HF's "rotate_half" convention) -> residual; RMSNorm -> SwiGLU
  MLP (down(silu(gate(x)) * up(x))) -> residual. No biases anywhere.
- `Head`: the final RMSNorm and the d_model -> vocab projection.

The layers implement the optional `halves` and `decode` protocols
(`spotline.models.provider`): backfill slices a block in two, and decodes with a KV
cache (RoPE at the cached positions; the cache keeps n_kv_heads).

Stable parameter names (`<layer index>.<name>`, layer 0 the embedding, 1..L the
blocks, L+1 the head):

    0.tok.weight
    i.attn_norm.weight  i.attn.{q,k,v,o}.weight  i.mlp_norm.weight  i.mlp.{gate,up,down}.weight
    (L+1).norm.weight   (L+1).lm.weight          (absent when the embeddings are tied)

Each layer draws its initialisation from its own generator at `seed + <its index in the
flat list>` (`init_weights`, which also lets a rank build its stage on the meta device
and initialise it in place), so the initial weights do not depend on the pipeline cut.

**Tied embeddings** (`model.tie_embeddings: true`, pp=1 only). Layers are built
independently, so the tied `Head` owns no output matrix: `tie(model)` links it to the
`Embedding` of the same built model, after which the head projects with the
embedding's weight. The model then holds that matrix once, as ONE Parameter named
`0.tok.weight` (in `named_parameters()`, `parameters()` and `state_dict()` alike), so
checkpoints, optimizers and `spotline.models.hf` see it once. Call it on whatever
`build_sequential` returned:

    model = tie(build_sequential(model_def))

`tie` is idempotent and a no-op on a model without a tied head (or without llama
layers at all), so callers may apply it unconditionally. A tied head that was never
linked refuses to run (RuntimeError) rather than silently train untied. Under ZeRO-3
the link registers the embedding's weight as an external parameter of the head, so
DeepSpeed gathers it for the head's forward and backward too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from spotline.config.model import LlamaModelSpec
from spotline.models.decode import LayerKV, attend
from spotline.models.provider import (
    LayerDef,
    ModelDef,
    init_unless_meta,
    lm_loss,
    residual_std,
    seeded,
)

INIT_STD = 0.02


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 and cast back (as HF's LlamaRMSNorm)."""

    def __init__(self, d_model: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def rope_cos_sin(
    seq_len: int,
    head_dim: int,
    theta: float,
    device: torch.device,
    dtype: torch.dtype,
    start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, head_dim] of positions start..start+T-1, each frequency repeated
    over the two halves of the head (HF's layout). Computed in fp32 (elementwise ops only, which
    autocast leaves alone), then cast to `dtype`. Nothing is cached: no buffer to get
    cast to bf16 or left unmaterialised on the meta device."""
    idx = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
    inv_freq = 1.0 / (theta ** (idx / head_dim))
    pos = torch.arange(start, start + seq_len, dtype=torch.int64, device=device).float()
    freqs = pos[:, None] * inv_freq[None, :]  # the outer product, exact in fp32
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, hd] by position (cos, sin [T, hd])."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Grouped-query causal self-attention with rotary positions, no biases."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, rope_theta: float):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        self.rope_theta = rope_theta
        kv = n_kv_heads * self.head_dim
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.k = nn.Linear(d_model, kv, bias=False)
        self.v = nn.Linear(d_model, kv, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)

    def forward(
        self, x: torch.Tensor, cache: LayerKV | None = None, start: int = 0
    ) -> torch.Tensor:
        """Attention of x's positions start..start+t-1; with a `cache`, over the cached
        positions too (the cache gains the new, rotated k and v)."""
        b, t, d = x.shape
        hd = self.head_dim
        q = self.q(x).view(b, t, self.n_heads, hd).transpose(1, 2)
        k = self.k(x).view(b, t, self.n_kv_heads, hd).transpose(1, 2)
        v = self.v(x).view(b, t, self.n_kv_heads, hd).transpose(1, 2)
        cos, sin = rope_cos_sin(t, hd, self.rope_theta, x.device, q.dtype, start)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # cached k/v keep n_kv_heads: GQA's saving holds in the cache
            k, v = cache.append(k, v)
        y = attend(q, k, v)  # grouped k/v heads read in place, never repeated
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Embedding(nn.Module):
    """Token ids [B, T] -> hidden states [B, T, d] (no positions: RoPE adds them)."""

    def __init__(self, vocab_size: int, d_model: int, seed: int):
        super().__init__()
        self.seed = seed
        self.tok = nn.Embedding(vocab_size, d_model)
        init_unless_meta(self)

    def init_weights(self) -> None:
        nn.init.normal_(self.tok.weight, std=INIT_STD, generator=seeded(self.seed))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx)

    def decode(self, idx: torch.Tensor, cache: LayerKV, start: int) -> torch.Tensor:
        return self.tok(idx)  # positions enter in the blocks' attention (RoPE)


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        ffn_hidden: int,
        rope_theta: float,
        norm_eps: float,
        n_layers: int,
        seed: int,
    ):
        super().__init__()
        self.seed, self.n_layers = seed, n_layers
        self.attn_norm = RMSNorm(d_model, norm_eps)
        self.attn = Attention(d_model, n_heads, n_kv_heads, rope_theta)
        self.mlp_norm = RMSNorm(d_model, norm_eps)
        self.mlp = MLP(d_model, ffn_hidden)
        init_unless_meta(self)

    def init_weights(self) -> None:
        g = seeded(self.seed)
        nn.init.ones_(self.attn_norm.weight)
        nn.init.ones_(self.mlp_norm.weight)
        for lin in (self.attn.q, self.attn.k, self.attn.v, self.mlp.gate, self.mlp.up):
            nn.init.normal_(lin.weight, std=INIT_STD, generator=g)
        # GPT-2's scaling of the residual projections keeps deep stacks stable.
        for lin in (self.attn.o, self.mlp.down):
            nn.init.normal_(lin.weight, std=residual_std(self.n_layers, INIT_STD), generator=g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._mlp(self._attn(x))

    def halves(self) -> tuple[Callable[[torch.Tensor], torch.Tensor], ...]:
        """(attention + residual, MLP + residual): composed, exactly `forward`."""
        return self._attn, self._mlp

    def decode(self, x: torch.Tensor, cache: LayerKV, start: int) -> torch.Tensor:
        """The new positions start.. of x, attending over `cache` (which gains their k/v)."""
        return self._mlp(self._attn(x, cache, start))

    def _attn(self, x: torch.Tensor, cache: LayerKV | None = None, start: int = 0) -> torch.Tensor:
        return x + self.attn(self.attn_norm(x), cache, start)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.mlp_norm(x))


class Head(nn.Module):
    """Final RMSNorm and the projection to logits [B, T, V].

    With `tied=True` it owns no projection: `tie(model)` links it to the model's
    `Embedding`, whose weight it then uses (see the module docstring)."""

    def __init__(self, d_model: int, vocab_size: int, norm_eps: float, seed: int, tied: bool):
        super().__init__()
        self.seed, self.tied = seed, tied
        self.norm = RMSNorm(d_model, norm_eps)
        # A plain attribute (a tuple), not a submodule: the embedding's weight must stay
        # registered once, under the embedding's name.
        self._tied_to: tuple[Embedding, ...] = ()
        if not tied:
            self.lm = nn.Linear(d_model, vocab_size, bias=False)
        init_unless_meta(self)

    def init_weights(self) -> None:
        nn.init.ones_(self.norm.weight)
        if not self.tied:
            nn.init.normal_(self.lm.weight, std=INIT_STD, generator=seeded(self.seed))

    def projection(self) -> torch.Tensor:
        """The output projection [V, d]: its own, or the linked embedding's."""
        if not self.tied:
            return self.lm.weight
        if not self._tied_to:
            raise RuntimeError(
                "this llama Head has tied embeddings but was never linked to its embedding: "
                "call spotline.models.llama.tie(model) on the built model "
                "(tie(build_sequential(model_def)))"
            )
        return self._tied_to[0].tok.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(x), self.projection())

    def decode(self, x: torch.Tensor, cache: LayerKV, start: int) -> torch.Tensor:
        return self.forward(x)


def tie(model: nn.Module) -> nn.Module:
    """Link a tied `Head` to the `Embedding` of the same built model (in place; returns
    `model`). Idempotent; a no-op when the model has no tied head. ValueError when a
    tied head has no single embedding to share (e.g. a pipeline stage without it)."""
    heads = [m for m in model.modules() if isinstance(m, Head) and m.tied]
    if not heads:
        return model
    embeddings = [m for m in model.modules() if isinstance(m, Embedding)]
    if len(embeddings) != 1:
        raise ValueError(
            f"tie: a tied llama head needs exactly one Embedding in the same model, found "
            f"{len(embeddings)}; model.tie_embeddings needs parallel.pipeline_stages: 1"
        )
    (emb,) = embeddings
    for head in heads:
        # ZeRO-3 (zero.Init) keeps a partitioned parameter's full shape in ds_shape.
        width = getattr(emb.tok.weight, "ds_shape", emb.tok.weight.shape)[1]
        if width != getattr(head.norm.weight, "ds_shape", head.norm.weight.shape)[0]:
            raise ValueError(
                f"tie: the embedding {tuple(emb.tok.weight.shape)} does not fit a head of "
                f"width {head.norm.weight.shape[0]}"
            )
        head._tied_to = (emb,)
        _register_external(head, emb.tok.weight)
    return model


def _register_external(module: nn.Module, param: nn.Parameter) -> None:
    """Tell ZeRO-3 that `module` uses `param`, owned by another module (harmless under
    ZeRO 0-2; skipped where DeepSpeed is not installed)."""
    try:
        from deepspeed.runtime.zero.partition_parameters import register_external_parameter
    except Exception:  # no DeepSpeed here: nothing gathers parameters behind our back
        return
    register_external_parameter(module, param)


def flops_per_token(spec: LlamaModelSpec, vocab_size: int) -> float:
    """Training FLOPs per token: 6 * N_matmul + 12 * L * T * d, where

        N_matmul = L * (2*d*d + 2*d*kv*hd + 3*d*ffn) + d*V

    with L = n_layers, d = d_model, hd = d / n_heads, kv = n_kv_heads (kv_heads),
    ffn = the SwiGLU hidden size, V = vocab_size, T = seq_len. q and o are d x d, k and
    v d x (kv*hd), the MLP has three d x ffn matrices, the head d x V (counted even when
    tied to the embedding); embedding gathers cost 0. Each matmul weight costs 2 FLOPs
    per token forward and 4 backward (6N). Attention scores (QK^T) and values (AV) cost
    2*T*d each per token and layer forward, x3 for forward + backward (12LTd), over the
    full T: no causal discount. Norms, RoPE, SiLU and softmax are not counted.
    """
    d, t, L = spec.d_model, spec.seq_len, spec.n_layers
    hd = d // spec.n_heads
    kv = spec.kv_heads
    n_matmul = L * (2 * d * d + 2 * d * kv * hd + 3 * d * spec.ffn) + d * vocab_size
    return float(6 * n_matmul + 12 * L * t * d)


class LlamaProvider:
    """The `llama` model kind. `hf` is its Hugging Face interop (`spotline.models.hf`)."""

    config_model = LlamaModelSpec

    @property
    def hf(self):
        from spotline.models import hf

        return hf

    def build(
        self, config: LlamaModelSpec, *, vocab_size: int, seq_len: int, seed: int
    ) -> ModelDef:
        c = config
        block = (c.d_model, c.n_heads, c.kv_heads, c.ffn, c.rope_theta, c.norm_eps, c.n_layers)
        layers = [
            LayerDef(Embedding, (vocab_size, c.d_model, seed)),
            *[LayerDef(Block, (*block, seed + 1 + i)) for i in range(c.n_layers)],
            LayerDef(
                Head, (c.d_model, vocab_size, c.norm_eps, seed + 1 + c.n_layers, c.tie_embeddings)
            ),
        ]
        if seq_len != c.seq_len:
            c = c.model_copy(update={"seq_len": seq_len})
        return ModelDef(
            layers=layers,
            block_class=Block,
            loss=lm_loss,
            flops_per_token=flops_per_token(c, vocab_size),
            vocab_size=vocab_size,
            seq_len=seq_len,
            post_build=tie if c.tie_embeddings else None,
        )


PROVIDER = LlamaProvider()

__all__ = [
    "PROVIDER",
    "Attention",
    "Block",
    "Embedding",
    "Head",
    "LlamaProvider",
    "MLP",
    "RMSNorm",
    "apply_rope",
    "flops_per_token",
    "rope_cos_sin",
    "rotate_half",
    "tie",
]
