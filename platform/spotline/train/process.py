"""A rank's process: where it sits in the job (`Topology`), DeepSpeed imported the
way a worker should, its device (CUDA or the host, TF32 on a GPU), whether a CUDA error
left that device unusable to the process (`sticky_cuda_error`), and its process group.
No Ray here, and nothing of the training loop (`spotline.train.trainer`).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from spotline import constants
from spotline.compat.torch import set_default_group_timeout, stale_extension_locks
from spotline.train.comms import settle_nccl_error_handling
from spotline.train.watch import CommsHung, watched

log = logging.getLogger("spotline.worker")


@dataclass(frozen=True)
class Topology:
    """Where this rank sits. Rank = stage * replicas + replica (DeepSpeed's pipe-major grid)."""

    pipeline_stages: int
    replicas: int
    rank: int

    @property
    def world_size(self) -> int:
        return self.pipeline_stages * self.replicas

    @property
    def stage(self) -> int:
        return self.rank // self.replicas

    @property
    def replica(self) -> int:
        return self.rank % self.replicas


def training_device() -> str:
    """'gpu' where DeepSpeed places this rank's engine on CUDA, else 'cpu'."""
    from deepspeed.accelerator import get_accelerator

    return "gpu" if get_accelerator().device_name() == "cuda" else "cpu"


def import_deepspeed() -> ModuleType:
    """DeepSpeed as a rank's process needs it: without the MLflow import of its
    autotuner (`deepspeed_without_mlflow`), and with DeepSpeed's Muon optimizer
    compiling lazily. Called where a rank's process starts, where nothing else imports
    MLflow."""
    deepspeed = deepspeed_without_mlflow()
    _import_muon_compiling_lazily()
    return deepspeed


def deepspeed_without_mlflow(hide: bool = True) -> ModuleType:
    """DeepSpeed, imported without the MLflow import of its autotuner.

    `import deepspeed` loads deepspeed.autotuning, which imports MLflow whenever it is
    installed (`spotline[tracking]` installs it) to log autotuning experiments, which a
    Spotline job never runs. That import is most of DeepSpeed's import time (about 1.0 s of
    1.3 s on a quiet core), paid by every worker a restart starts before its first step
    and by the controller as a job starts. MLflow stays importable afterwards; while
    DeepSpeed loads, an import of MLflow by another thread would fail, so a process that
    may import it meanwhile (a controller with an MLflow tracker) passes `hide=False`.
    """
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    hide = hide and "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # `import mlflow` raises ImportError; DeepSpeed expects that
    try:
        import deepspeed
    finally:
        if hide:
            sys.modules.pop("mlflow", None)
    return deepspeed


_MUON = "deepspeed.runtime.zero.muon.muon_optimizer"


def _import_muon_compiling_lazily() -> None:
    """DeepSpeed's Muon optimizer, imported with its `torch.compile` deferred to the
    first call of each compiled function.

    Building an engine imports it (`is_zero_supported_optimizer` checks the optimizer
    against Muon's class), and its module decorates three functions with
    `torch.compile`, which loads torch's inductor compiler right away: about 1.1 s of
    each new rank's start on a quiet core, for an optimizer a Spotline job does not
    use. Deferred, a job that did call them would compile them on first use, as before.
    """
    if _MUON in sys.modules:
        return
    real = torch.compile
    torch.compile = compile_on_first_call(real)
    try:
        importlib.import_module(_MUON)
    except ImportError:  # a DeepSpeed without Muon: nothing to defer
        pass
    finally:
        torch.compile = real


def compile_on_first_call(compile_fn: Any) -> Any:
    """`compile_fn` (torch.compile's signature), deferred: the function it is given is
    compiled when it is first called, with the same options."""

    def deferred(fn: Any = None, **options: Any) -> Any:
        if fn is None:  # used as @torch.compile(...)
            return lambda f: deferred(f, **options)
        compiled = None

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(fn, **options)
            return compiled(*args, **kwargs)

        return call

    return deferred


def float32_matmul_precision(device: str) -> str:
    """torch's float32 matmul precision on `device`: 'high' (TF32 tensor cores) on a
    GPU, for any fp32 matmul left under bf16 and for fp32 jobs; 'highest' on CPU."""
    return "high" if device == "gpu" else "highest"


def use_device(device: str, local_rank: int, rank: int) -> None:
    """Make this process drive its one device: on 'gpu', cuda:`local_rank` of the GPUs it
    sees (its node's, shared), with TF32 on for fp32 matmuls. A rank that Ray gave a GPU
    but whose torch cannot use CUDA fails here, never falling back to CPU."""
    if device != "gpu":
        return
    if not torch.cuda.is_available():
        from spotline.config.loader import SpecError

        raise SpecError(
            f"rank {rank} was given a GPU by Ray "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}), but its "
            f"torch {torch.__version__} cannot use CUDA: install a CUDA build of torch in "
            "the GPU nodes' image, or set resources.device: cpu"
        )
    torch.cuda.set_device(local_rank)
    torch.set_float32_matmul_precision(float32_matmul_precision(device))
    torch.backends.cudnn.allow_tf32 = True


_STICKY_CUDA = (
    "an illegal memory access was encountered",
    "the launch timed out and was terminated",
    "device-side assert triggered",
    "hardware stack error",
    "an illegal instruction was encountered",
    "misaligned address",
    "operation not supported on global/shared address space",
    "invalid program counter",
    "unspecified launch failure",
    "uncorrectable ecc error encountered",
)
"""CUDA's texts (cudaGetErrorString) for the errors that leave the process's CUDA
context unusable: any further CUDA work fails the same way, and only a new process
clears it (CUDA documents this for 700, 702, 710, 714-719; an uncorrectable ECC error,
214, is counted with them). Their texts reach Python unchanged, inside torch's and
NCCL's messages alike."""


def sticky_cuda_error(text: str) -> str | None:
    """The sticky CUDA error `text` (an error's message) reports, or None: a rank whose
    step failed with one cannot train again in its process."""
    low = text.lower()
    return next((m for m in _STICKY_CUDA if m in low), None)


def backend_for(device: str) -> str:
    """The process-group backend of a group on `device`: nccl on 'gpu', else gloo."""
    return "nccl" if device == "gpu" else "gloo"


def init_distributed(
    topo: Topology,
    master_addr: str,
    master_port: int,
    device: str = "cpu",
    local_rank: int = 0,
    store: dist.TCPStore | None = None,
    timeout_s: float = 600.0,
) -> str:
    """Join the job's process group; returns its backend.

    `device` is the group's ('gpu': nccl on this rank's own GPU, cuda:`local_rank`;
    'cpu': gloo), never guessed from what this process happens to see. `store`: rank 0's
    TCPStore, already listening (it took its port from the kernel, so no other process
    can have taken it in between); the other ranks connect to master_addr:master_port.
    `timeout_s`: how long one collective or rendezvous wait may take before the rank
    raises (failure.collective_timeout_s, the backstop behind hang detection).

    On NCCL, torch's watchdog is told to leave a failed communicator to this rank's own
    abort (TORCH_NCCL_ASYNC_ERROR_HANDLING=0; `comms.settle_nccl_error_handling` says
    why), not to end the process (its default): a survivor keeps its process to
    re-form in. A value the user set is kept, with a warning where it works against
    that."""
    deepspeed = import_deepspeed()
    clear_stale_build_locks(topo.rank)
    os.environ.update(
        RANK=str(topo.rank),
        WORLD_SIZE=str(topo.world_size),
        LOCAL_RANK=str(local_rank),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
    )
    timeout = timedelta(seconds=timeout_s)
    # Every group created from here on (DeepSpeed's data-parallel and pipeline groups,
    # the trainer's control group) waits as long as the default one: torch gives a
    # group made without a timeout its own default (30 minutes for gloo), not this one.
    set_default_group_timeout(timeout)
    kwargs: dict[str, Any] = {}
    use_device(device, local_rank, topo.rank)
    if device == "gpu" and topo.world_size > 1:  # binds the communicator to this rank's GPU
        kwargs["device_id"] = torch.device("cuda", local_rank)
    backend = backend_for(device)
    if backend == "nccl":
        said = settle_nccl_error_handling(os.environ)
        if said is not None and topo.rank == 0:  # the same environment on every rank
            log.warning("%s", said)
    if store is None:
        store = dist.TCPStore(
            master_addr,
            master_port,
            topo.world_size,
            is_master=topo.rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
    dist.init_process_group(
        backend,
        store=store,
        rank=topo.rank,
        world_size=topo.world_size,
        timeout=timeout,
        **kwargs,
    )
    # DeepSpeed adopts the process group that exists.
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout)
    return backend


def clear_stale_build_locks(rank: int) -> list[str]:
    """Remove the build locks of DeepSpeed's JIT-compiled ops that a killed build left
    on this node (`compat.torch.stale_extension_locks`), each with a warning; returns
    their paths. Called before DeepSpeed loads an op (its process group loads one, its
    optimizer another), so a rank that was killed while building one cannot leave every
    later start on the node waiting forever. Ranks starting together on one node may
    each find the same lock: the first removes it."""
    removed = []
    for lock, quiet_s in stale_extension_locks(constants.SPOTLINE_STALE_BUILD_LOCK_S):
        try:
            lock.unlink()
        except FileNotFoundError:
            continue
        removed.append(str(lock))
        log.warning(
            "rank %d: removed %s, the build lock of DeepSpeed op %r, untouched for %.0f min: "
            "a build killed before it finished left it, and every load of the op on this "
            "node would have waited on it forever; the op is built again",
            rank,
            lock,
            lock.parent.name,
            quiet_s / 60,
        )
    return removed


def leave_distributed(rank: int = 0, node: str = "", timeout_s: float | None = None) -> None:
    """Leave the process group this rank is in, and DeepSpeed's view of it, keeping the
    process: the next `init_distributed` joins a new group at a new rank and world
    size as a fresh process would. Call it once the engine built on the old group is
    dropped. After an NCCL abort there is nothing left to destroy.

    The destroy runs on a thread of its own under a watchdog (`timeout_s`, else
    SPOTLINE_COMM_DESTROY_TIMEOUT_S): one that has not returned by then raises
    CommsHung (naming `rank` and `node`), and the process is not to be used again."""
    from spotline.compat.deepspeed import forget_groups

    if dist.is_initialized():
        limit = constants.SPOTLINE_COMM_DESTROY_TIMEOUT_S if timeout_s is None else timeout_s
        w = watched(dist.destroy_process_group, limit, f"spotline-destroy-{rank}")
        if w.hung:
            what = "destroying its old process group"
            raise CommsHung(rank, node, what, limit, "SPOTLINE_COMM_DESTROY_TIMEOUT_S")
        if w.error is not None:
            raise w.error
    forget_groups()
