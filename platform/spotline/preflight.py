"""Checks that touch the outside world, run in the driver before any worker starts.

A bad storage URI, missing credentials, another job's checkpoints at the URI, an
unwritable staging directory, a model that cannot fit its devices or an unreadable
corpus must fail here, in seconds, with one line that names the field and the fix,
not minutes later inside a worker. Every check here only reads, except the storage
probe, which runs last, once the URI is known to be this job's.
"""

from __future__ import annotations

from pathlib import Path

from spotline.checkpoint import CheckpointMismatchError, CheckpointStore
from spotline.checkpoint.staging import GB, check_local_dir
from spotline.config.backfill import SpeculativeTaskSpec
from spotline.config.loader import SpecError
from spotline.config.schema import JobSpec
from spotline.data import load_corpus
from spotline.plan import checkpoint_bytes, memory_per_device


def open_store(spec: JobSpec) -> CheckpointStore:
    """The job's checkpoint store (checks the URI and storage options; no network)."""
    c = spec.checkpoint
    return CheckpointStore(
        spec.resolved_checkpoint_uri(),
        endpoint_url=c.endpoint_url,
        storage_options=c.storage_options,
        signing_key_env=c.signing_key_env,
    )


def resolve_prompts(task: SpeculativeTaskSpec, field: str) -> None:
    """Read a prompts file into the task (in the driver, before any worker starts)."""
    if isinstance(task.prompts, list):
        prompts = task.prompts
    else:
        path = Path(task.prompts)
        try:
            prompts = [line for line in path.read_text().splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or e
            raise SpecError(
                f"{field}.prompts: cannot read {str(path)!r} ({why}); give a path relative "
                "to where you run spotline, or list the prompts inline"
            ) from None
    if not prompts:
        raise SpecError(f"{field}.prompts is empty; give at least one prompt")
    task.prompts = prompts


def device_memory_bytes(spec: JobSpec, local_cluster: bool) -> tuple[int, str] | None:
    """Memory of one device and where the figure comes from; None when it is unknown
    here (a remote GPU cluster without resources.device_memory_gb)."""
    r = spec.resources
    if r.device_memory_gb is not None:
        return int(r.device_memory_gb * GB), "resources.device_memory_gb"
    if not local_cluster:
        return None
    gpu = _local_gpu_memory() if r.device != "cpu" else None
    if gpu is not None:
        return gpu, "this machine's GPU"
    if r.device == "gpu":
        return None
    import psutil

    # Every CPU worker of a local cluster shares this host's memory.
    world = spec.parallel.pipeline_stages * spec.elastic.max_replicas
    return psutil.virtual_memory().total // world, f"host RAM shared by {world} CPU workers"


def _local_gpu_memory() -> int | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVIDIA driver: not a GPU machine
        return None


def check_memory(spec: JobSpec, local_cluster: bool) -> None:
    """Refuse a model whose weights, gradients and optimizer state (plus activations)
    cannot fit one device."""
    have = device_memory_bytes(spec, local_cluster)
    if have is None:
        return
    capacity, source = have
    worst = max(memory_per_device(spec), key=lambda m: m.total_bytes)
    if worst.total_bytes <= capacity:
        return
    p = spec.parallel
    raise SpecError(
        f"model: stage {worst.stage} holds {worst.params:,} parameters and needs about "
        f"{worst.total_bytes / GB:,.1f} GB per device ({worst.state_bytes / GB:,.1f} GB of "
        f"weights, gradients and Adam state under ZeRO-{p.zero_stage}, "
        f"{worst.activation_bytes / GB:,.1f} GB of activations), but a device has "
        f"{capacity / GB:,.1f} GB ({source}); lower model.d_model or model.n_layers, add "
        "parallel.pipeline_stages, raise parallel.zero_stage, use parallel.precision: bf16, "
        "or lower train.global_batch_size"
    )


def check_offline(spec: JobSpec, local_cluster: bool = True) -> CheckpointStore:
    """Every check that needs no network: prompts, URI and storage options, memory, and
    the driver node's staging directory. Returns the (unopened) store."""
    for i, task in enumerate(spec.backfill.tasks):
        if isinstance(task, SpeculativeTaskSpec):
            resolve_prompts(task, f"backfill.tasks[{i}]")
    store = open_store(spec)
    check_memory(spec, local_cluster)
    check_local_dir(spec.checkpoint.staging_dir, "checkpoint.staging_dir", checkpoint_bytes(spec))
    if spec.checkpoint.signing_key_env is not None:
        store.signing_key()  # the key must be here, or the first commit would fail
    return store


def preflight(spec: JobSpec, local_cluster: bool = True) -> CheckpointStore:
    """All checks, in order: offline ones, whose URI it is (read-only), that the storage
    is writable (a probe object), and the corpus. Returns the store."""
    store = check_offline(spec, local_cluster)
    store.check_credentials()
    try:
        store.check_owner(spec)
    except CheckpointMismatchError as e:
        raise SpecError(str(e)) from None
    store.check_writable()
    load_corpus(spec.data, min_tokens=spec.model.seq_len + 2)
    return store
