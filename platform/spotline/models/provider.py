"""The model provider protocol: how Spotline learns an architecture.

A provider turns a validated config into a `ModelDef`: a flat list of layers, the
loss, and the FLOPs per token. Spotline builds everything else from it, for any
architecture:

- **Pipelines.** DeepSpeed's `PipelineModule` holds the list cut into contiguous
  stages at the layer bounds its caller passes (`spotline.planning.partition` cuts
  them: by default the `block_class` layers split evenly, or where the balanced
  partition measured); models/ never cuts by itself. At pp=1 the list is a plain
  `nn.Sequential`. Each layer maps one tensor to one tensor: token ids to hidden
  states, hidden states to hidden states, hidden states to logits.
- **Stable parameter names.** A parameter is named `<layer index>.<name inside the
  layer>` (e.g. `3.attn.q.weight`), the same at any number of stages; checkpoints,
  resharding and exports key on these names.
- **Weights that do not depend on the cut.** A layer seeds its own initialisation
  (`torch.manual_seed(seed + index)` in its constructor, for example), so a stage
  builds exactly the weights the whole model would have.
- **Built once, in place** (optional): a layer class with an `init_weights()` method
  that (re)initialises every parameter and buffer from the layer's own seed is built
  on the meta device and materialised once: initialised in place, or left empty when
  a checkpoint (a resume, `model.init_from`) will fill it, so a resume never runs the
  random init it then overwrites. The built-in layers do this; a layer without it is
  built by its constructor, as before.
- **Per-block options** (`BuildOptions`): activation checkpointing of every k-th
  block (`parallel.activation_checkpointing`) and `torch.compile` of each block
  (`parallel.compile`), applied in place to the `block_class` layers, at any cut.
- **MFU.** `flops_per_token` counts the training (forward + backward) model FLOPs of
  one token, the numerator of MFU.
- **Inference.** The same layers, applied in order, give logits from token ids:
  backfill evaluation and speculative decoding use that.

Two optional layer protocols make inference cheaper; the built-in `gpt` and `llama`
layers implement both, and `spotline.models.decode` drives them. A layer without one
still works, only whole or recomputed:

- **Halves** (blocks): `layer.halves() -> (attn_half, mlp_half)`, two callables
  `x -> x`, each including its residual, with `mlp_half(attn_half(x))` equal to
  `layer(x)` bit for bit. Backfill runs each half as its own unit, so a unit fits a
  shorter idle window. A layer without `halves` runs as one unit.
- **Cached decoding** (every layer of the model): `layer.decode(x, cache, start) -> y`
  computes the layer's output for the new positions start..start+t-1 only, given the
  layer's own slot of the sequence's KV cache (a `spotline.models.decode.LayerKV`):
  the embedding places positions start.. (token ids [B, t] -> [B, t, d]); a block's
  attention computes the new positions' keys and values (rotated, for RoPE),
  `cache.append(k, v)` returns all keys and values so far, and the queries attend
  causally over them (`spotline.models.decode.attend` builds the mask); the head is
  its plain forward. Layers without a cache ignore the slot; the driver owns the
  length and rolls the slots back (rejected draft tokens), so a layer never
  truncates. If any layer lacks `decode`, decoding recomputes the whole prefix for
  each new token instead (and says so: `kv_cache: false`).

Bring your own model with `model: {kind: custom, provider: "my_pkg.my_model:PROVIDER",
config: {...}}`, where PROVIDER has:

    config_model = MyConfig              # a pydantic model: validates model.config
    def build(self, config: MyConfig, *, vocab_size: int, seq_len: int, seed: int) -> ModelDef

and is importable on every node (ship it with the job's runtime_env working_dir or
py_modules, or install it in the image).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from pydantic import BaseModel
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class LayerDef:
    """One layer of the flat list, built only where it is needed (a pipeline stage
    builds its own layers, nothing else)."""

    cls: type[nn.Module]
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self, *, init: bool = True, meta: bool = True) -> nn.Module:
        """The layer on the host. A layer class with `init_weights()` (the built-in ones)
        is built on the meta device and materialised once, in place: initialised, or
        left empty (`init=False`) for weights a checkpoint will fill. Any other class,
        or any with `meta=False`, is built as its constructor builds it (which
        initialises it). Under an active `torch.device("meta")` nothing is allocated."""
        if torch.get_default_device().type == "meta":
            with _ConstructorInitSkipped():  # a meta tensor holds nothing to initialise
                return self.cls(*self.args, **self.kwargs)
        if not meta or not hasattr(self.cls, "init_weights"):
            return self.cls(*self.args, **self.kwargs)
        with torch.device("meta"), _ConstructorInitSkipped():
            layer = self.cls(*self.args, **self.kwargs)
        layer.to_empty(device="cpu")
        if init:
            layer.init_weights()
        return layer


_INITS = frozenset(
    getattr(nn.init, name)
    for name in dir(nn.init)
    if name.endswith("_") and not name.startswith("_") and callable(getattr(nn.init, name))
)


class _ConstructorInitSkipped(TorchFunctionMode):
    """While a layer is built on the meta device, its constructor's `torch.nn.init`
    calls return their tensor untouched: a meta tensor holds no values, and on one
    these calls run torch's Python reference kernels, whose first call imports
    torch._dynamo, about a second of CPU in a process that compiles nothing (the
    controller's plan and the launch's memory check build every layer on meta)."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        if func in _INITS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class ModelDef:
    """Everything Spotline needs to know about an architecture."""

    layers: list[LayerDef]
    """Embedding, blocks, head: the flat layer list."""
    block_class: type[nn.Module]
    """The class of the repeated blocks; the uniform partition splits these evenly."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """loss(logits [B, T, V], labels [B, T]) -> scalar mean over tokens."""
    flops_per_token: float
    """Training model FLOPs per token (forward + backward), for MFU."""
    vocab_size: int
    seq_len: int
    post_build: Callable[[nn.Module], nn.Module] | None = None
    """Applied to the whole built model (pp=1 and inference), e.g. to tie the embedding
    and the head, which are built as separate layers."""

    @property
    def n_blocks(self) -> int:
        return sum(1 for ld in self.layers if ld.cls is self.block_class)


class ModelProvider(Protocol):
    config_model: type[BaseModel]
    """Validates the provider's config (for custom models: `model.config`)."""

    def build(self, config: Any, *, vocab_size: int, seq_len: int, seed: int) -> ModelDef: ...


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


@dataclass(frozen=True)
class BuildOptions:
    """How a rank builds its layers. None of it changes what the model computes: losses
    are equal, within floating-point tolerance, whichever options are set."""

    init: bool = True
    """False: the weights are left empty (never randomly initialised), for a checkpoint
    or `model.init_from` to fill before the first step."""
    recompute_every: int = 0
    """Activation checkpointing: blocks 0, k, 2k, ... of the whole model (numbered the
    same at any pipeline cut) keep only their input and recompute the rest in the
    backward. 0: none; 1: every block."""
    compile: bool = False
    """`torch.compile` each block (in place: parameter names do not change)."""
    meta: bool = True
    """False: every layer is built by its constructor, never on the meta device (under
    DeepSpeed's `zero.Init`, which splits each layer's parameters as it is built)."""


def build_layer(model: ModelDef, index: int, opts: BuildOptions = BuildOptions()) -> nn.Module:
    """Layer `index` of the flat list, built (`LayerDef.build`) and, if it is a block,
    compiled and/or recomputed in the backward as `opts` say."""
    ld = model.layers[index]
    layer = ld.build(init=opts.init, meta=opts.meta)
    if ld.cls is model.block_class:
        block = sum(1 for other in model.layers[:index] if other.cls is model.block_class)
        if opts.compile:
            layer.compile()
        if opts.recompute_every and block % opts.recompute_every == 0:
            recompute_in_backward(layer)
    return layer


def recompute_in_backward(layer: nn.Module) -> nn.Module:
    """Make `layer` keep only its input for the backward, which runs its forward again
    (`torch.utils.checkpoint`, non-reentrant, with the forward's RNG state restored, so
    dropout draws the same mask). In place: the layer's parameters and their names are
    unchanged. Under `torch.no_grad` it runs as usual."""
    layer.forward = types.MethodType(_recomputed_forward, layer)
    return layer


def _recomputed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = type(self).forward.__get__(self)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def build_sequential(model: ModelDef, opts: BuildOptions = BuildOptions()) -> nn.Sequential:
    """The whole model on one device (pp=1, and inference); `.seq_len` is its context."""
    seq = nn.Sequential(*[build_layer(model, i, opts) for i in range(len(model.layers))])
    if model.post_build is not None:
        seq = model.post_build(seq)
    seq.seq_len = model.seq_len
    return seq


def build_pipeline_module(
    model: ModelDef,
    num_stages: int,
    bounds: list[int],
    opts: BuildOptions = BuildOptions(),
):
    """A DeepSpeed PipelineModule of `num_stages` stages, stage s holding layers
    bounds[s]:bounds[s+1] (the caller's cut, from `spotline.planning.partition`); only
    this stage's layers are built, each once (`build_layer`)."""
    from deepspeed.pipe import LayerSpec, PipelineModule

    parts = list(bounds)

    class StageLayer(LayerSpec):
        # DeepSpeed builds the layers of this rank's stage only, through this.
        def __init__(self, index: int):
            ld = model.layers[index]
            super().__init__(ld.cls, *ld.args, **ld.kwargs)
            self.index = index

        def build(self, log: bool = False) -> nn.Module:
            return build_layer(model, self.index, opts)

    class ExplicitPipelineModule(PipelineModule):
        # DeepSpeed cuts by a named method; Spotline decides the cut itself.
        def _partition_layers(self, method: str = "uniform") -> None:
            self.parts = parts
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=parts[stage], stop=parts[stage + 1])

    return ExplicitPipelineModule(
        layers=[StageLayer(i) for i in range(len(model.layers))],
        num_stages=num_stages,
        loss_fn=model.loss,
        activation_checkpoint_interval=0,  # Spotline's own, per block: BuildOptions
    )


def layer_param_counts(model: ModelDef) -> list[int]:
    """Parameters of each layer, counted on the meta device (nothing is allocated)."""
    return [sum(n for n in sizes) for sizes in layer_tensor_sizes(model)]


def layer_tensor_sizes(model: ModelDef) -> list[list[int]]:
    """Each layer's parameter tensors' sizes, on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return [[p.numel() for p in ld.build().parameters()] for ld in model.layers]


def seeded(seed: int) -> torch.Generator:
    """A host generator at `seed`: a layer's `init_weights` draws from its own, so its
    weights depend on its seed alone (not on what was drawn before, nor on the cut)."""
    return torch.Generator().manual_seed(seed)


def init_unless_meta(layer: nn.Module) -> None:
    """The end of a built-in layer's constructor: `layer.init_weights()`, unless the
    layer was built on the meta device (`LayerDef.build` then materialises it first)."""
    if any(p.device.type != "meta" for p in layer.parameters()):
        layer.init_weights()


def residual_std(n_layers: int, std: float = 0.02) -> float:
    """GPT-2's scaling of residual projections, which keeps deep stacks stable."""
    return std / math.sqrt(2 * n_layers)
