"""The engine adapter: the only code that knows where DeepSpeed keeps a rank's state.

DeepSpeed keeps the fp32 master weights and the optimizer's moments in private,
layout-specific places, and this file is the one that reads and writes them there,
through `spotline.compat.deepspeed` for every private name (when DeepSpeed's internals
change, that seam fails at import and this file changes):

- "hp": ZeRO-1/2 and BF16_Optimizer: params with fragment mappings into a flat
  fp32 partition (`single_partition_of_fp32_groups` / `fp32_groups_flat_partition`);
- "unfused": bf16 without ZeRO at pp=1: FP16_UnfusedOptimizer's per-param fp32 copies
  (`fp32_groups` beside `fp16_groups`);
- "zero3": params with `ds_id`, each rank its partition (`ds_tensor`, DeepSpeed's
  safe_get/set_local_* accessors, `fp32_partitioned_groups_flat`);
- "plain": ZeRO-0 fp32: the client optimizer over the module's own params.

`EngineAdapter` turns each into one picture: per parameter (by stable name), the
element ranges this rank holds (`Slot`) with a getter and a setter per kind (fp32,
moments), and the module's whole low-precision copy where it is a separate tensor.
`HostCopier` copies what the getters return to the host for a snapshot.

Never here: files, indexes or hashes (spotline.checkpoint), collectives.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from spotline.checkpoint.layout import FP32, INDEX, MOMENTS, WEIGHT, CheckpointFormatError


@dataclass
class Slot:
    """One element range of one parameter held by this rank, and how to get/set it."""

    name: str
    start: int
    numel: int
    kinds: tuple[str, ...]
    owner: bool  # this rank writes it (ZeRO-0 replicas > 0 hold copies and do not)
    get: Callable[[str], torch.Tensor | None]  # None: optimizer state not created yet
    set: Callable[[str, torch.Tensor], None]


@dataclass
class Param:
    name: str
    param: torch.nn.Parameter
    shape: tuple[int, ...]
    numel: int
    slots: list[Slot] = field(default_factory=list)
    # The module's copy, when separate from the fp32 master: written whole as "weight"
    # entries, set whole on load (from "weight" entries, else from fp32).
    lp_get: Callable[[], torch.Tensor] | None = None
    lp_set: Callable[[torch.Tensor], None] | None = None
    lp_saved: bool = True  # False: leave it out of snapshots (ZeRO-3: no whole copy)


class EngineAdapter:
    """This rank's view of the engine's training state, by optimizer kind.

    kinds: "zero3" (params with `ds_id`), "hp" (ZeRO-1/2 and BF16_Optimizer: params
    with a fragment mapping into a flat fp32 partition), "unfused" (bf16 without ZeRO at
    pp=1: FP16_UnfusedOptimizer's per-param fp32 copies), "plain" (ZeRO-0 fp32: the
    client optimizer over the module's own params).
    """

    def __init__(self, engine, topo):
        self.engine = engine
        self.opt = engine.optimizer
        if self.opt is None:
            raise NotImplementedError("spotline.train.state needs an engine with an optimizer")
        self.base: torch.optim.Optimizer = getattr(self.opt, "optimizer", self.opt)
        self.replica = topo.replica
        from spotline.compat import deepspeed as internals

        named = list(engine.module.named_parameters())
        if any(hasattr(p, "ds_id") for _, p in named):
            self.kind = "zero3"
            self.flats = internals.zero3_fp32_partitions(self.opt)
        elif (flats := internals.flat_fp32_partitions(self.opt)) is not None:
            self.kind = "hp"
            self.flats = flats
        elif (copies := internals.unfused_fp32_copies(self.opt)) is not None:
            self.kind = "unfused"
            self.flats = [hp for _, hp in copies]
            self._master = {id(lp): hp for lp, hp in copies}
        elif isinstance(self.opt, torch.optim.Optimizer) and self.base is self.opt:
            self.kind = "plain"
            self.flats = [p for group in self.base.param_groups for p in group["params"]]
        else:
            raise NotImplementedError(
                f"spotline.train.state does not know DeepSpeed's {type(self.opt).__name__}"
            )
        self._in_opt = {id(t) for t in self.flats}
        self.params = [self._param(name, p) for name, p in named]

    # -- optimizer state ------------------------------------------------------------

    def optim_keys(self) -> list[str]:
        """The optimizer's per-element state tensors (Adam: exp_avg, exp_avg_sq)."""
        for flat in self.flats:
            st = self.base.state.get(flat)
            if st:
                return sorted(
                    k
                    for k, v in st.items()
                    if torch.is_tensor(v) and v.shape == flat.shape and k != "step"
                )
        return list(MOMENTS)

    def adam_step(self) -> float | None:
        steps = set()
        for flat in self.flats:
            st = self.base.state.get(flat)
            if st and "step" in st:
                steps.add(float(st["step"]))
        if len(steps) > 1:
            raise RuntimeError(f"optimizer state has several step counts {sorted(steps)}")
        return steps.pop() if steps else None

    def ensure_state(self, keys: list[str], step: float) -> None:
        """Create the optimizer state Adam would create lazily at its first step, and
        set every state's step count."""
        groups = {id(p): g for g in self.base.param_groups for p in g["params"]}
        for flat in self.flats:
            st = self.base.state.get(flat)
            if not st:
                g = groups.get(id(flat), {})
                on_device = g.get("capturable") or g.get("fused")
                st = self.base.state[flat] = {
                    "step": torch.tensor(
                        step, dtype=torch.float32, device=flat.device if on_device else "cpu"
                    )
                }
            for k in keys:
                if k not in st:
                    st[k] = torch.zeros_like(flat, memory_format=torch.contiguous_format)
            if torch.is_tensor(st.get("step")):
                st["step"].fill_(step)
            else:
                st["step"] = step

    def check_keys(self, keys: list[str]) -> None:
        for flat in self.flats:
            st = self.base.state.get(flat) or {}
            extra = [
                k
                for k, v in st.items()
                if torch.is_tensor(v) and v.shape == flat.shape and k != "step" and k not in keys
            ]
            if extra:
                raise CheckpointFormatError(
                    INDEX, f"the optimizer has state {extra} that the checkpoint does not"
                )

    def _moment(self, flat: torch.Tensor, key: str, start: int, numel: int):
        st = self.base.state.get(flat)
        if not st or key not in st:
            return None
        return st[key].view(-1).narrow(0, start, numel)

    # -- parameters -------------------------------------------------------------------

    def _param(self, name: str, p: torch.nn.Parameter) -> Param:
        shape = tuple(getattr(p, "ds_shape", p.shape))
        numel = math.prod(shape)
        rec = Param(name, p, shape, numel)
        if self.kind == "zero3":
            self._zero3(rec)
        elif self.kind == "hp":
            self._hp(rec)
        else:
            self._whole(rec)
        return rec

    def _hp(self, rec: Param) -> None:
        p = rec.param
        rec.lp_get = lambda: p.detach().reshape(-1)
        rec.lp_set = lambda v: p.data.view(-1).copy_(v)
        from spotline.compat.deepspeed import hp_fragment

        frag = hp_fragment(p)
        if frag is None:
            return  # not trained, or this rank holds none of it: its weight is all there is
        flat = self.flats[frag.param_group_index]
        hp_start = frag.hp_fragment_address.start
        n = frag.lp_fragment_address.numel
        expected = flat.narrow(0, hp_start, n)
        hp = frag.hp_fragment
        if (
            hp.data_ptr() != expected.data_ptr()
            or hp.numel() != n
            or frag.hp_fragment_address.numel != n
        ):
            raise RuntimeError(
                f"{rec.name}: DeepSpeed's fragment mapping does not point into its flat fp32 "
                "partition as expected (DeepSpeed internals changed?)"
            )

        def get(kind: str):
            return expected if kind == FP32 else self._moment(flat, kind, hp_start, n)

        def set_(kind: str, v: torch.Tensor) -> None:
            get(kind).copy_(v)

        rec.slots.append(Slot(rec.name, frag.lp_fragment_address.start, n, (), True, get, set_))

    def _whole(self, rec: Param) -> None:
        p = rec.param
        owner = self.replica == 0
        master = p if self.kind == "plain" else self._master.get(id(p))
        if master is not None and id(master) not in self._in_opt:
            master = None
        if master is None or master is not p:
            rec.lp_get = lambda: p.detach().reshape(-1)
            rec.lp_set = lambda v: p.data.view(-1).copy_(v)
        if master is None:
            return

        def get(kind: str):
            if kind == FP32:
                return master.detach().view(-1)
            return self._moment(master, kind, 0, rec.numel)

        def set_(kind: str, v: torch.Tensor) -> None:
            get(kind).copy_(v)

        rec.slots.append(Slot(rec.name, 0, rec.numel, (), owner, get, set_))

    def _zero3(self, rec: Param) -> None:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        from deepspeed.utils import (
            safe_get_local_fp32_param,
            safe_get_local_optimizer_state,
            safe_set_local_fp32_param,
            safe_set_local_optimizer_state,
        )

        from spotline.compat.deepspeed import zero3_partition_rank

        p = rec.param
        part = p.ds_tensor.ds_numel  # padded partition size
        start = zero3_partition_rank(self.opt, p) * part
        n = max(0, min(part, rec.numel - start))

        def available() -> bool:
            return p.ds_status == ZeroParamStatus.AVAILABLE and p.data.numel() == rec.numel

        # Persistent (small) params stay gathered between steps: their whole copy is
        # set on load too, or it would be stale until ZeRO-3 next gathers them.
        rec.lp_saved = False
        if available():
            rec.lp_set = lambda v: p.data.view(-1).copy_(v)
        if n == 0:
            return
        if not p.requires_grad:  # not trained: its partition of the weight is all there is

            def get_w(kind: str):
                return p.ds_tensor.view(-1).narrow(0, 0, n)

            def set_w(kind: str, v: torch.Tensor) -> None:
                get_w(kind).copy_(v)
                if available():
                    p.data.view(-1).narrow(0, start, n).copy_(v)

            rec.slots.append(Slot(rec.name, start, n, (WEIGHT,), True, get_w, set_w))
            return

        def get(kind: str):
            if kind != FP32 and not all(self.base.state.get(f) for f in self.flats):
                return None
            local = (
                safe_get_local_fp32_param(p)
                if kind == FP32
                else safe_get_local_optimizer_state(p, kind)
            )
            return local.view(-1).narrow(0, 0, n)

        def set_(kind: str, v: torch.Tensor) -> None:
            local = (
                safe_get_local_fp32_param(p)
                if kind == FP32
                else safe_get_local_optimizer_state(p, kind)
            )
            padded = local.detach().clone().view(-1)
            padded[:n].copy_(v)
            if kind == FP32:
                safe_set_local_fp32_param(p, padded)
            else:
                safe_set_local_optimizer_state(p, padded, kind)

        rec.slots.append(Slot(rec.name, start, n, (), True, get, set_))

    def finish_load(self) -> None:
        if self.kind == "zero3":  # low-precision partitions from the fp32 ones
            from spotline.compat.deepspeed import zero3_refresh_partitions

            zero3_refresh_partitions(self.opt)

    # -- the engine's counters and schedule -------------------------------------------

    def topology(self, topo) -> dict[str, Any]:
        """This rank's place in the job, and the engine's ZeRO stage."""
        engine = self.engine
        zero = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else 0
        return {
            "pipeline_stages": topo.pipeline_stages,
            "replicas": topo.replicas,
            "stage": topo.stage,
            "replica": topo.replica,
            "rank": topo.rank,
            "zero_stage": int(zero),
        }

    def progress(self) -> dict[str, Any]:
        """The lr scheduler's state and the engine's step and sample counts."""
        sched = self.engine.lr_scheduler
        return {
            "lr_scheduler": sched.state_dict() if sched is not None else None,
            "global_steps": int(self.engine.global_steps),
            "global_samples": int(self.engine.global_samples),
        }

    def restore_progress(self, meta: dict[str, Any]) -> None:
        """Set what `progress` returned (from a checkpoint's meta)."""
        sched = self.engine.lr_scheduler
        if sched is not None and meta.get("lr_scheduler") is not None:
            # The position in the schedule is the checkpoint's; the peak lr is this job's
            # (a resume with a retuned train.lr, e.g. a PBT exploit, must not undo it).
            base_lrs = list(sched.base_lrs)
            sched.load_state_dict(meta["lr_scheduler"])
            sched.base_lrs = base_lrs
        self.engine.global_steps = meta["global_steps"]
        self.engine.global_samples = meta["global_samples"]


class HostCopier:
    """Host copies of device tensors, each owned by the caller (nothing shared with the
    engine), contiguous and 1-D.

    CPU tensors are cloned. CUDA tensors are copied into freshly allocated pinned host
    buffers, each enqueued (non_blocking) on a side stream of its device that first
    waits for what the current stream has queued so far: the copies see every write
    queued before them, and the host only enqueues them instead of blocking on each.
    `wait()` blocks once, until all of them have landed; until it returns, a CUDA
    copy's contents are undefined, and its source must not be written. The buffers are
    fresh at every save, never reused by Spotline: the upload thread reads a snapshot
    while training goes on (torch's pinned-memory cache recycles a buffer once freed).
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._sources: list[torch.Tensor] = []  # alive until their copies have landed

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.device.type == "cpu":
            return t.reshape(-1).clone(memory_format=torch.contiguous_format)
        if t.device.type != "cuda":
            return t.reshape(-1).to("cpu", copy=True).contiguous()
        stream = self._streams.get(t.device)
        if stream is None:
            stream = self._streams[t.device] = torch.cuda.Stream(t.device)
        # Waited on at every copy: `t` may be the output of a kernel queued just now.
        stream.wait_stream(torch.cuda.current_stream(t.device))
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            out.copy_(t, non_blocking=True)
        # Kept alive so the allocator cannot hand its memory to the current stream
        # before the side stream has read it (a temporary from a getter, say).
        self._sources.append(t)
        return out.view(-1)

    def wait(self) -> None:
        """Block until every copy enqueued so far is on the host."""
        for stream in self._streams.values():
            stream.synchronize()
        self._sources.clear()
