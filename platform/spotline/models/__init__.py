"""Model providers: `gpt` (the quickstart), `llama`, and your own (`kind: custom`).

`model_def(spec)` is the one way to get a job's architecture: it finds the provider
in the registry, validates its config, and builds the `ModelDef` that pipelines,
checkpoints, FLOPs and backfill all use (see `spotline.models.provider`);
`spotline.models.flops` counts each layer's width and FLOPs on the meta device;
`hf` maps weights to and from Hugging Face names, and `hf_files` reads a checkpoint's
files and headers without loading a weight.

A provider describes and builds layers; it must never start anything, read storage,
or decide how a job is cut into stages (the caller passes the bounds:
`spotline.planning.partition` owns the cut), and never imports planning/, train/, the
runtime or the controller (DeepSpeed appears only to wrap a stage's layers in its
PipelineModule).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ValidationError
from torch import nn

from spotline.config.loader import SpecError
from spotline.config.schema import JobSpec
from spotline.models.provider import (
    BuildOptions,
    LayerDef,
    ModelDef,
    ModelProvider,
    build_pipeline_module,
    build_sequential,
    layer_param_counts,
    layer_tensor_sizes,
    lm_loss,
)
from spotline.registry import MODELS, note_user_code

__all__ = [
    "BuildOptions",
    "LayerDef",
    "ModelDef",
    "ModelProvider",
    "build_pipeline_module",
    "build_sequential",
    "hf_checkpoint_dir",
    "hf_checkpoint_fs",
    "init_from_hf",
    "layer_param_counts",
    "layer_tensor_sizes",
    "lm_loss",
    "model_def",
    "provider",
]


def provider(spec: JobSpec) -> ModelProvider:
    """The job's model provider (importing a custom one); SpecError naming the field."""
    m = spec.model
    name, field = (m.provider, "model.provider") if m.kind == "custom" else (m.kind, "model.kind")
    try:
        found = MODELS.load(name, field)
    except ValueError as e:
        raise SpecError(str(e)) from None
    if not callable(getattr(found, "build", None)) or not isinstance(
        getattr(found, "config_model", None), type
    ):
        raise SpecError(
            f"{field}: {name!r} is {found!r}, not a model provider: it needs a `config_model` "
            "(a pydantic model) and a `build(config, *, vocab_size, seq_len, seed)` method "
            "(see spotline.models.provider)"
        )
    return found


def provider_config(spec: JobSpec, prov: ModelProvider) -> Any:
    """The validated config the provider builds from: the model section itself for the
    built-in kinds, `model.config` validated by the provider's own model for custom."""
    m = spec.model
    if m.kind != "custom":
        return m
    cls: type[BaseModel] = prov.config_model
    try:
        return cls.model_validate(m.config)
    except ValidationError as e:
        problems = "; ".join(
            f"model.config.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
            for err in e.errors()
        )
        raise SpecError(f"model.config is not valid for {m.provider}: {problems}") from None


def model_def(spec: JobSpec) -> ModelDef:
    """The job's architecture, built from its provider."""
    prov = provider(spec)
    md = prov.build(
        provider_config(spec, prov),
        vocab_size=spec.vocab_size(),
        seq_len=spec.model.seq_len,
        seed=spec.train.seed,
    )
    if spec.model.kind == "custom":
        # The layers may live in other modules than the provider: an error in their
        # forward is the user's too (see spotline.registry.user_code_error). Parts taken
        # from installed libraries (a torch layer, a torch loss) are not.
        parts = [ld.cls for ld in md.layers] + [md.block_class, md.loss, md.post_build]
        for module in {getattr(p, "__module__", None) for p in parts if p is not None}:
            if module and not _installed(module):
                note_user_code(module, "model.provider", spec.model.provider)
    return md


def _installed(module: str) -> bool:
    """True for a module of the standard library or an installed package."""
    import sys
    import sysconfig

    path = getattr(sys.modules.get(module), "__file__", None)
    if path is None:
        return True  # built in, or not a file: not the user's source
    roots = {sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    path = os.path.realpath(path)
    return any(path.startswith(os.path.realpath(r) + os.sep) for r in roots if r)


def hf_checkpoint_fs(spec: JobSpec, uri: str):
    """(fsspec filesystem, root path) of the Hugging Face checkpoint at `uri`: a local
    path or file:// URI, or any fsspec URI, reached with data's credentials."""
    import fsspec

    if "://" not in uri or uri.startswith("file://"):
        local = Path(uri.removeprefix("file://")).expanduser().resolve()
        return fsspec.filesystem("file"), str(local)
    from spotline.data.text import fsspec_options

    return fsspec.core.url_to_fs(uri, **fsspec_options(uri, spec.data, "model.init_from"))


def hf_checkpoint_dir(spec: JobSpec, uri: str) -> Path:
    """A local directory holding the Hugging Face checkpoint at `uri` (a local path as
    is; any other fsspec URI copied into data.cache_dir once, with data's credentials)."""
    if "://" not in uri or uri.startswith("file://"):
        return Path(uri.removeprefix("file://")).expanduser()
    import hashlib

    local = Path(spec.data.cache_dir) / "hf" / hashlib.sha256(uri.encode()).hexdigest()[:16]
    if (local / "config.json").is_file():
        return local
    fs, root = hf_checkpoint_fs(spec, uri)
    tmp = local.with_name(local.name + ".part")
    tmp.mkdir(parents=True, exist_ok=True)
    for name in fs.ls(root, detail=False):
        base = name.rstrip("/").rsplit("/", 1)[-1]
        if base == "config.json" or base.endswith((".safetensors", ".safetensors.index.json")):
            fs.get_file(name, str(tmp / base))
    tmp.replace(local)
    return local


def init_from_hf(module: nn.Module, spec: JobSpec) -> None:
    """Load `model.init_from` (a Hugging Face checkpoint) into `module`: the whole model,
    or one pipeline stage of it (only that stage's parameters are copied). A checkpoint
    that cannot be loaded raises a SpecError, which no restart retries."""
    m = spec.model
    hf = getattr(provider(spec), "hf", None)
    if hf is None:
        raise SpecError(f"model.init_from: model.kind {m.kind!r} has no Hugging Face format")
    try:
        state = hf.load_hf(hf_checkpoint_dir(spec, m.init_from), m, spec.vocab_size())
    except SpecError:
        raise
    except ValueError as e:  # a provider's own loader: its refusal is as final
        raise SpecError(f"model.init_from: {m.init_from}: {e}") from None
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name not in state:
                raise SpecError(f"model.init_from: {m.init_from} has no weights for {name}")
            p.copy_(state[name].to(p.dtype))
