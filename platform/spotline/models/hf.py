"""Hugging Face interop for the `llama` model kind: config.json, weight names, and
checkpoints in safetensors (the layout `LlamaForCausalLM.from_pretrained` reads).

Never pickle: only `config.json`, `*.safetensors` and `model.safetensors.index.json` are
read or written (the files and their headers: `hf_files.py`). Loading and saving work on local directories; fetching a remote
checkpoint (fsspec URIs) is the caller's business (`spotline.models`). `check_checkpoint`
reads through whatever fsspec filesystem it is given, and only config.json, the index
and each safetensors header (a ranged read), so the preflight checks a checkpoint in
object storage without downloading its weights.

A checkpoint that cannot be loaded raises `HFCheckpointError`, a `SpecError`: the same
bytes fail the same way on every restart, so a worker that meets one is never retried.

Names (L = n_layers, k = 0..L-1, Spotline layer i = k + 1):

    0.tok.weight              <-> model.embed_tokens.weight
    i.attn.{q,k,v,o}.weight   <-> model.layers.k.self_attn.{q,k,v,o}_proj.weight
    i.mlp.{gate,up,down}.weight <-> model.layers.k.mlp.{gate,up,down}_proj.weight
    i.attn_norm.weight        <-> model.layers.k.input_layernorm.weight
    i.mlp_norm.weight         <-> model.layers.k.post_attention_layernorm.weight
    (L+1).norm.weight         <-> model.norm.weight
    (L+1).lm.weight           <-> lm_head.weight      (neither exists when tied)

Both directions keep the tensors' dtypes; the caller casts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from spotline.config.model import LlamaModelSpec
from spotline.models.hf_files import (
    CONFIG,
    INDEX,
    RESAVE,
    SINGLE,
    HFCheckpointError,
    parse_config,
    safetensors_header,
    weight_files,
)

DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3
"""HF's usual shard size (5 GB)."""

# HF's defaults when a config.json leaves a key out (LlamaConfig in transformers 5).
_HF_DEFAULT_THETA = 10000.0
_HF_DEFAULT_EPS = 1e-6

_ATTN = ("q", "k", "v", "o")
_MLP = ("gate", "up", "down")

# --- config --------------------------------------------------------------------------


def hf_config(
    spec: LlamaModelSpec,
    vocab_size: int,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
) -> dict[str, Any]:
    """A config.json for `LlamaForCausalLM` of this shape.

    RoPE: transformers 5 reads and writes `rope_parameters: {rope_type, rope_theta}`;
    the top-level `rope_theta` is what transformers 4 (and other readers) look for, and
    transformers 5 accepts it next to `rope_parameters` (same value)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.d_model,
        "intermediate_size": spec.ffn,
        "num_hidden_layers": spec.n_layers,
        "num_attention_heads": spec.n_heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.d_model // spec.n_heads,
        "hidden_act": "silu",
        "rms_norm_eps": spec.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "rope_theta": spec.rope_theta,
        "max_position_embeddings": spec.seq_len,
        "vocab_size": vocab_size,
        "tie_word_embeddings": spec.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "dtype": "float32",
        "torch_dtype": "float32",
    }


def _rope(cfg: dict[str, Any], where: str) -> float:
    """The plain-RoPE theta of a config.json; ValueError for any scaled RoPE."""
    params = cfg.get("rope_parameters")
    legacy = cfg.get("rope_scaling")
    for key, section in (("rope_parameters", params), ("rope_scaling", legacy)):
        if section is None:
            continue
        if not isinstance(section, dict):
            raise ValueError(f"{key} in {where}/{CONFIG} is {section!r}, not a mapping")
        kind = section.get("rope_type", section.get("type", "default"))
        if kind != "default":
            raise ValueError(
                f"{key} in {where}/{CONFIG} asks for rope_type {kind!r}: Spotline's llama "
                "uses plain rotary embeddings (rope_type 'default', no scaling); point "
                "model.init_from at a checkpoint without RoPE scaling"
            )
        if section.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(
                f"{key}.partial_rotary_factor in {where}/{CONFIG} is "
                f"{section['partial_rotary_factor']}: Spotline's llama rotates whole heads"
            )
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"partial_rotary_factor in {where}/{CONFIG} is {cfg['partial_rotary_factor']}: "
            "Spotline's llama rotates whole heads"
        )
    for section in (params, legacy):
        if section and "rope_theta" in section:
            return float(section["rope_theta"])
    return float(cfg.get("rope_theta", _HF_DEFAULT_THETA))


def _yaml(v: Any) -> str:
    return json.dumps(v) if isinstance(v, bool) or v is None else str(v)


def check_hf_config(cfg: dict[str, Any], spec: LlamaModelSpec, vocab_size: int, where: str) -> None:
    """ValueError naming the Spotline field and the HF key where a Hugging Face
    config.json disagrees with `spec` (shape, vocabulary, RoPE, norm eps, tying), or
    describes something Spotline's llama is not (scaled RoPE, biases, another
    activation). `where` names the checkpoint in the messages."""
    src = f"{where}/{CONFIG}"
    fix = "or point model.init_from elsewhere"

    model_type = cfg.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(
            f"model_type in {src} is {model_type!r}, not 'llama': model.kind llama loads "
            f"Llama checkpoints only; point model.init_from elsewhere"
        )

    def same(field: str, mine: Any, key: str, theirs: Any) -> None:
        if isinstance(mine, bool):
            agree = mine is theirs
        elif isinstance(mine, float):
            agree = isinstance(theirs, (int, float)) and math.isclose(mine, theirs, rel_tol=1e-9)
        else:
            agree = mine == theirs
        if not agree:
            mine_s, theirs_s = _yaml(mine), _yaml(theirs)
            raise ValueError(
                f"model.{field} ({mine_s}) disagrees with {key} {theirs_s} in {src}; set "
                f"model.{field}: {theirs_s} {fix}"
            )

    def need(key: str) -> Any:
        if key not in cfg:
            raise ValueError(f"{src} has no {key}: it is not a complete Llama config")
        return cfg[key]

    n_heads = need("num_attention_heads")
    same("n_layers", spec.n_layers, "num_hidden_layers", need("num_hidden_layers"))
    same("d_model", spec.d_model, "hidden_size", need("hidden_size"))
    same("n_heads", spec.n_heads, "num_attention_heads", n_heads)
    kv = cfg.get("num_key_value_heads")
    same("n_kv_heads", spec.kv_heads, "num_key_value_heads", n_heads if kv is None else kv)
    same("ffn_hidden", spec.ffn, "intermediate_size", need("intermediate_size"))
    same("vocab_size", vocab_size, "vocab_size", need("vocab_size"))
    same("rope_theta", spec.rope_theta, "rope_theta", _rope(cfg, where))
    same("norm_eps", spec.norm_eps, "rms_norm_eps", cfg.get("rms_norm_eps", _HF_DEFAULT_EPS))
    tied = bool(cfg.get("tie_word_embeddings", False))
    same("tie_embeddings", spec.tie_embeddings, "tie_word_embeddings", tied)

    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim != spec.d_model // spec.n_heads:
        raise ValueError(
            f"head_dim {head_dim} in {src} is not hidden_size / num_attention_heads "
            f"({spec.d_model // spec.n_heads}): Spotline's llama has no separate head_dim; "
            f"{fix.removeprefix('or ')}"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(
            f"hidden_act {act!r} in {src}: Spotline's llama MLP is SwiGLU (silu); "
            f"{fix.removeprefix('or ')}"
        )
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key, False):
            raise ValueError(
                f"{key} is true in {src}: Spotline's llama has no biases; {fix.removeprefix('or ')}"
            )


# --- names ---------------------------------------------------------------------------


def _name_map(spec: LlamaModelSpec) -> dict[str, str]:
    """Spotline stable name -> HF name, in model order."""
    L = spec.n_layers
    names = {"0.tok.weight": "model.embed_tokens.weight"}
    for k in range(L):
        i, p = k + 1, f"model.layers.{k}"
        names[f"{i}.attn_norm.weight"] = f"{p}.input_layernorm.weight"
        for w in _ATTN:
            names[f"{i}.attn.{w}.weight"] = f"{p}.self_attn.{w}_proj.weight"
        names[f"{i}.mlp_norm.weight"] = f"{p}.post_attention_layernorm.weight"
        for w in _MLP:
            names[f"{i}.mlp.{w}.weight"] = f"{p}.mlp.{w}_proj.weight"
    names[f"{L + 1}.norm.weight"] = "model.norm.weight"
    if not spec.tie_embeddings:
        names[f"{L + 1}.lm.weight"] = "lm_head.weight"
    return names


def _shapes(spec: LlamaModelSpec, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Spotline stable name -> shape."""
    d, L, ffn = spec.d_model, spec.n_layers, spec.ffn
    kv = spec.kv_heads * (d // spec.n_heads)
    attn = {"q": (d, d), "k": (kv, d), "v": (kv, d), "o": (d, d)}
    mlp = {"gate": (ffn, d), "up": (ffn, d), "down": (d, ffn)}
    shapes: dict[str, tuple[int, ...]] = {"0.tok.weight": (vocab_size, d)}
    for i in range(1, L + 1):
        shapes[f"{i}.attn_norm.weight"] = (d,)
        shapes.update({f"{i}.attn.{w}.weight": s for w, s in attn.items()})
        shapes[f"{i}.mlp_norm.weight"] = (d,)
        shapes.update({f"{i}.mlp.{w}.weight": s for w, s in mlp.items()})
    shapes[f"{L + 1}.norm.weight"] = (d,)
    if not spec.tie_embeddings:
        shapes[f"{L + 1}.lm.weight"] = (vocab_size, d)
    return shapes


def _vocab(
    state: dict[str, torch.Tensor], key: str, spec: LlamaModelSpec, vocab_size: int | None
) -> int:
    if vocab_size is not None:
        return vocab_size
    if spec.vocab_size is not None:
        return spec.vocab_size
    t = state.get(key)
    if t is None or t.dim() != 2:
        raise ValueError(f"{key} is missing (or not a matrix): the vocabulary size is unknown")
    return int(t.shape[0])


def _check_shapes(
    found: dict[str, tuple[int, ...]],
    names: dict[str, str],
    shapes: dict[str, tuple[int, ...]],
    side: str,
    where: Callable[[str], str] = lambda name: "",
    source: str = "",
) -> None:
    """ValueError for a tensor of `names` (source names) missing from `found` (name ->
    shape), one of `found` not in `names`, or one whose shape is not `shapes`' (keyed
    by source name). `where(name)` says where a found tensor is (" in <file>"),
    `source` where they all come from (" from <dir>")."""
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(
            f"{side} tensor {missing[0]} is missing{source}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    extra = [n for n in found if n not in names]
    if extra:
        raise ValueError(
            f"{side} tensor {extra[0]}{where(extra[0])} is not part of this llama shape"
            + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
        )
    for src in names:
        if tuple(found[src]) != shapes[src]:
            raise ValueError(
                f"{side} tensor {src}{where(src)} has shape {tuple(found[src])}, expected "
                f"{shapes[src]}"
            )


def _convert(
    state: dict[str, torch.Tensor],
    names: dict[str, str],
    shapes: dict[str, tuple[int, ...]],
    side: str,
) -> dict[str, torch.Tensor]:
    """Rename `state` by `names` (source -> target), refusing missing, extra and
    wrong-shape tensors; `shapes` is keyed by source name."""
    _check_shapes({k: tuple(t.shape) for k, t in state.items()}, names, shapes, side)
    return {dst: state[src] for src, dst in names.items()}


def _hf_names(
    spec: LlamaModelSpec, vocab_size: int
) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
    """(HF name -> Spotline name, HF name -> shape) of this llama shape."""
    names, shapes = _name_map(spec), _shapes(spec, vocab_size)
    return {hf: sl for sl, hf in names.items()}, {hf: shapes[sl] for sl, hf in names.items()}


def to_hf(
    state: dict[str, torch.Tensor], spec: LlamaModelSpec, *, vocab_size: int | None = None
) -> dict[str, torch.Tensor]:
    """Spotline stable names -> Hugging Face names (no lm_head.weight when tied).
    ValueError naming the tensor for a missing, extra or wrong-shape one. The vocabulary
    is `vocab_size`, else `spec.vocab_size`, else the embedding's rows."""
    v = _vocab(state, "0.tok.weight", spec, vocab_size)
    return _convert(state, _name_map(spec), _shapes(spec, v), "Spotline")


def from_hf(
    hf_state: dict[str, torch.Tensor], spec: LlamaModelSpec, *, vocab_size: int | None = None
) -> dict[str, torch.Tensor]:
    """Hugging Face names -> Spotline stable names, the inverse of `to_hf`. ValueError
    naming the tensor for a missing, extra or wrong-shape one.

    Two HF artefacts are accepted: `*.rotary_emb.inv_freq` buffers (derived from theta,
    dropped), and, when tied, an `lm_head.weight` identical to the embedding (dropped;
    a different one is refused)."""
    hf_state = {k: t for k, t in hf_state.items() if not k.endswith("rotary_emb.inv_freq")}
    if spec.tie_embeddings and "lm_head.weight" in hf_state:
        head, emb = hf_state["lm_head.weight"], hf_state.get("model.embed_tokens.weight")
        if emb is None or head.shape != emb.shape or not torch.equal(head, emb):
            raise ValueError(
                "HF tensor lm_head.weight differs from model.embed_tokens.weight but "
                "model.tie_embeddings is true; set model.tie_embeddings: false"
            )
        hf_state = {k: t for k, t in hf_state.items() if k != "lm_head.weight"}
    v = _vocab(hf_state, "model.embed_tokens.weight", spec, vocab_size)
    return _convert(hf_state, *_hf_names(spec, v), "HF")


# --- checkpoints ---------------------------------------------------------------------


def save_hf(
    dir: Path,
    spec: LlamaModelSpec,
    vocab_size: int,
    state: dict[str, torch.Tensor],
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
) -> Path:
    """Write a Hugging Face checkpoint of `state` (Spotline names) into the local
    directory `dir`: config.json and model.safetensors, or, past `max_shard_bytes`,
    model-0000i-of-0000n.safetensors and model.safetensors.index.json (HF's sharded
    layout; a tensor bigger than a shard gets a shard of its own). Returns `dir`."""
    from safetensors.torch import save_file

    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    tensors = to_hf(state, spec, vocab_size=vocab_size)
    tensors = {k: t.detach().cpu().contiguous() for k, t in tensors.items()}
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    for old in [*dir.glob("model*.safetensors"), dir / INDEX]:
        old.unlink(missing_ok=True)  # no stale shards of an earlier, bigger layout

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(dir / SINGLE), metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(dir / fname), metadata=meta)
            weight_map.update(dict.fromkeys(shard, fname))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    cfg = hf_config(spec, vocab_size, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    (dir / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    return dir


def read_hf_config(dir: Path) -> dict[str, Any]:
    """config.json of a local Hugging Face checkpoint directory."""
    path = Path(dir) / CONFIG
    if not path.is_file():
        raise HFCheckpointError(f"{path} does not exist: not a Hugging Face checkpoint")
    return parse_config(path.read_bytes(), str(path))


def check_checkpoint(fs, root: str, spec: LlamaModelSpec, vocab_size: int, where: str) -> list[str]:
    """Check everything about the Hugging Face checkpoint at `root` (through the fsspec
    filesystem `fs`) that can be known without reading its weights: config.json against
    `spec`; which safetensors files hold the weights (never pickles); every header; and
    every tensor's name, dtype and shape against the model `spec` describes. Returns the
    safetensors files' names. HFCheckpointError naming the file (as `where`/name) and
    the tensor."""
    root = root.rstrip("/")
    try:
        listing = fs.ls(root, detail=True)
    except FileNotFoundError:
        raise HFCheckpointError(
            f"model.init_from: {where} does not exist; give a Hugging Face checkpoint "
            "directory (config.json and *.safetensors)"
        ) from None
    files = {
        e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
        for e in listing
        if e.get("type") == "file"
    }
    if CONFIG not in files:
        raise HFCheckpointError(
            f"model.init_from: {where} has no {CONFIG}; give a Hugging Face checkpoint "
            "directory (config.json and *.safetensors)"
        )
    cfg = parse_config(fs.cat_file(f"{root}/{CONFIG}"), f"{where}/{CONFIG}")
    try:
        check_hf_config(cfg, spec, vocab_size, where)
    except ValueError as e:
        raise HFCheckpointError(str(e)) from None
    names, weight_map = weight_files(files, lambda: fs.cat_file(f"{root}/{INDEX}"), where)
    found: dict[str, tuple[int, ...]] = {}
    home: dict[str, str] = {}
    for fname in names:
        path = f"{root}/{fname}"
        header = safetensors_header(
            lambda a, b, path=path: fs.cat_file(path, start=a, end=b),
            files[fname],
            f"{where}/{fname}",
        )
        for tensor, (_, shape) in header.items():
            if weight_map is not None and weight_map.get(tensor) != fname:
                raise HFCheckpointError(
                    f"model.init_from: HF tensor {tensor} is in {where}/{fname} but {INDEX} "
                    f"puts it in {weight_map.get(tensor)}; {RESAVE}"
                )
            found[tensor], home[tensor] = shape, f"{where}/{fname}"
    if weight_map is not None:
        missing = [n for n in weight_map if n not in found]
        if missing:
            raise HFCheckpointError(
                f"model.init_from: HF tensor {missing[0]} is in {where}/{INDEX} but in none "
                f"of its shards; {RESAVE}"
            )
    found = {k: v for k, v in found.items() if not k.endswith("rotary_emb.inv_freq")}
    if spec.tie_embeddings and "lm_head.weight" in found:  # its values are compared on load
        if found["lm_head.weight"] != found.get("model.embed_tokens.weight"):
            raise HFCheckpointError(
                f"model.init_from: HF tensor lm_head.weight in {home['lm_head.weight']} differs "
                "from model.embed_tokens.weight but model.tie_embeddings is true; set "
                "model.tie_embeddings: false"
            )
        del found["lm_head.weight"]
    try:
        _check_shapes(found, *_hf_names(spec, vocab_size), "HF", lambda n: f" in {home[n]}",
                      f" from {where}")  # fmt: skip
    except ValueError as e:
        raise HFCheckpointError(
            f"model.init_from: {e}; it is not a checkpoint of this model: fix the model "
            "section, or point model.init_from elsewhere"
        ) from None
    return names


def load_hf(dir: Path, spec: LlamaModelSpec, vocab_size: int) -> dict[str, torch.Tensor]:
    """The weights of a local Hugging Face Llama checkpoint, by Spotline name, in the
    checkpoint's dtype. Everything `check_checkpoint` checks is checked first; only
    safetensors are read (model.safetensors, or the shards its index lists)."""
    import fsspec
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    dir = Path(dir)
    names = check_checkpoint(fsspec.filesystem("file"), str(dir.resolve()), spec, vocab_size,
                             str(dir))  # fmt: skip
    state: dict[str, torch.Tensor] = {}
    for fname in names:
        try:
            state.update(load_file(str(dir / fname)))
        except SafetensorError as e:
            raise HFCheckpointError(f"model.init_from: {dir / fname}: {e}; {RESAVE}") from None
    try:
        return from_hf(state, spec, vocab_size=vocab_size)
    except ValueError as e:
        raise HFCheckpointError(f"model.init_from: {dir}: {e}") from None
