"""The `model` and `tokenizer` sections: which architecture, its shape, and its vocabulary.

`model.kind` picks a provider from the registry (`spotline.registry.MODELS`): `gpt`
(the byte-level quickstart model), `llama` (a Llama-family decoder, with named
presets), or `custom` (your own provider, `model.provider: "pkg.module:attr"`, whose
`model.config` its own pydantic model validates before any worker starts).

`vocab_size` is taken from the tokenizer unless given. The preflight resolves it,
and the tokenizer's identity (`tokenizer.sha256`), into the spec before the job
starts, so every process sees the same values and the spec hash covers them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from spotline.registry import TOKENIZERS, is_import_path


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class GptModelSpec(_Section):
    """The GPT decoder of the quickstart: learned positions, LayerNorm, GELU MLP."""

    kind: Literal["gpt"] = "gpt"
    n_layers: int = Field(4, gt=0)
    """Number of transformer blocks. Pipeline stages split these blocks."""
    d_model: int = Field(128, gt=0)
    """Width of the residual stream."""
    n_heads: int = Field(4, gt=0)
    """Attention heads per block; must divide d_model."""
    seq_len: int = Field(128, gt=1)
    """Tokens per training sequence (context length)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout probability inside blocks. 0 keeps runs bit-reproducible across resumes."""
    vocab_size: int | None = Field(None, gt=0)
    """Vocabulary size; None takes the tokenizer's (256 for the byte tokenizer)."""

    @model_validator(mode="after")
    def _heads_divide_width(self) -> GptModelSpec:
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_heads "
                f"({self.n_heads}); pick n_heads from the divisors of d_model"
            )
        return self


LLAMA_PRESETS: dict[str, dict[str, Any]] = {
    # The shapes of Llama 3.2 1B and 3B and Llama 3.1 8B. The vocabulary comes from the
    # tokenizer, the context length from seq_len.
    "llama-1b": dict(
        n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8, ffn_hidden=8192,
        rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True,
    ),
    "llama-3b": dict(
        n_layers=28, d_model=3072, n_heads=24, n_kv_heads=8, ffn_hidden=8192,
        rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True,
    ),
    "llama-8b": dict(
        n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
        rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=False,
    ),
}  # fmt: skip
PRESET_VOCAB: dict[str, int] = {"llama-1b": 128256, "llama-3b": 128256, "llama-8b": 128256}
"""The vocabulary of the model each preset is shaped like (Llama 3's): what a plan made
without reading the tokenizer assumes. A job always takes its tokenizer's."""


class LlamaModelSpec(_Section):
    """A Llama-family decoder: RMSNorm, rotary positions, SwiGLU MLP, grouped-query
    attention, optionally tied embeddings."""

    kind: Literal["llama"] = "llama"
    preset: str | None = None
    """A named shape ('llama-1b', 'llama-3b', 'llama-8b'); fields given next to it
    override it."""
    n_layers: int = Field(2, gt=0)
    """Number of decoder blocks. Pipeline stages split these blocks."""
    d_model: int = Field(128, gt=0)
    """Width of the residual stream (HF: hidden_size)."""
    n_heads: int = Field(4, gt=0)
    """Query heads per block; must divide d_model."""
    n_kv_heads: int | None = Field(None, gt=0)
    """Key/value heads (grouped-query attention); must divide n_heads. None: n_heads."""
    ffn_hidden: int | None = Field(None, gt=0)
    """Hidden size of the SwiGLU MLP (HF: intermediate_size). None: Llama's rule,
    8/3 x d_model rounded up to a multiple of 256."""
    rope_theta: float = Field(10000.0, gt=0.0)
    """Base of the rotary position embedding's frequencies."""
    norm_eps: float = Field(1e-5, gt=0.0)
    """Epsilon of RMSNorm."""
    tie_embeddings: bool = False
    """Share the token embedding with the output head (needs pipeline_stages: 1)."""
    seq_len: int = Field(128, gt=1)
    """Tokens per training sequence (context length)."""
    vocab_size: int | None = Field(None, gt=0)
    """Vocabulary size; None takes the tokenizer's."""
    init_from: str | None = None
    """A Hugging Face Llama checkpoint to start from (a directory or fsspec URI holding
    config.json and *.safetensors): continued pretraining or fine-tuning. Its
    config.json must agree with this shape; a resume from a Spotline checkpoint ignores
    it."""

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, raw: Any) -> Any:
        if not isinstance(raw, dict) or raw.get("preset") is None:
            return raw
        name = raw["preset"]
        if name not in LLAMA_PRESETS:
            raise ValueError(
                f"model.preset: unknown preset {name!r}; valid presets: {', '.join(LLAMA_PRESETS)}"
            )
        return {**LLAMA_PRESETS[name], **raw}

    @model_validator(mode="after")
    def _shapes(self) -> LlamaModelSpec:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_heads "
                f"({self.n_heads}); pick n_heads from the divisors of d_model"
            )
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"model.d_model / model.n_heads ({self.d_model // self.n_heads}) must be even: "
                "rotary embeddings rotate pairs of channels"
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"model.n_kv_heads ({self.n_kv_heads}) must divide model.n_heads "
                f"({self.n_heads}): each key/value head serves a whole group of query "
                "heads; pick n_kv_heads from the divisors of n_heads"
            )
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        hidden = int(2 * 4 * self.d_model / 3)
        return 256 * ((hidden + 255) // 256)


class CustomModelSpec(_Section):
    """Your own architecture: a provider (see `spotline.models.provider`) importable on
    every node, with its own config model."""

    kind: Literal["custom"] = "custom"
    provider: str
    """'package.module:attr' of a ModelProvider. Ship the package with the job's
    runtime_env (working_dir or py_modules) or install it in the image."""
    config: dict[str, Any] = Field(default_factory=dict)
    """The provider's own settings, validated by its `config_model` before any worker
    starts (errors name model.config.<field>)."""
    seq_len: int = Field(128, gt=1)
    """Tokens per training sequence (context length)."""
    vocab_size: int | None = Field(None, gt=0)
    """Vocabulary size; None takes the tokenizer's."""

    @model_validator(mode="after")
    def _provider_shape(self) -> CustomModelSpec:
        if not is_import_path(self.provider):
            raise ValueError(
                f"model.provider: {self.provider!r} must look like 'package.module:attr'"
            )
        return self


def _model_kind(raw: Any) -> str:
    if isinstance(raw, dict):
        return raw.get("kind", "gpt")
    return getattr(raw, "kind", "gpt")


ModelSpec = Annotated[
    Annotated[GptModelSpec, Tag("gpt")]
    | Annotated[LlamaModelSpec, Tag("llama")]
    | Annotated[CustomModelSpec, Tag("custom")],
    Discriminator(_model_kind),
]
"""`model:` is one of these, chosen by `kind` (default 'gpt')."""


class TokenizerSpec(_Section):
    """How text becomes tokens: in `spotline prepare`, for speculative-decoding prompts,
    and for a text corpus read at start-up."""

    kind: str = "byte"
    """'byte' (every byte a token, 256 of them: nothing to download) or 'huggingface'
    (a tokenizer.json read with the `tokenizers` library), or 'package.module:attr'."""
    path: str | None = None
    """huggingface: a directory holding tokenizer.json, the file itself, or an fsspec
    URI of either (read with data.endpoint_url and data.storage_options). Nothing is
    ever downloaded from a model hub."""
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    """The tokenizer's identity: sha256 of its tokenizer.json ('byte' for the byte
    tokenizer). Filled in by the preflight; if you set it, the file must match."""
    vocab_size: int | None = Field(None, gt=0)
    """Filled in by the preflight from the tokenizer."""

    @model_validator(mode="after")
    def _kind_and_path(self) -> TokenizerSpec:
        TOKENIZERS.check(self.kind, "tokenizer.kind")
        if self.kind == "huggingface" and not self.path:
            raise ValueError(
                "tokenizer.path is required for tokenizer.kind 'huggingface': a directory "
                "with tokenizer.json, the file, or its URI (`spotline tokenizer train` makes one)"
            )
        if self.kind == "byte" and self.path:
            raise ValueError("tokenizer.path is set but tokenizer.kind 'byte' reads no file")
        return self
