"""Checks that touch the outside world, run in the driver before any worker starts.

A bad storage URI, missing credentials, another job's checkpoints at the URI, an
unwritable staging directory, a model that cannot fit its devices or an unreadable
corpus must fail here, in seconds, with one line that names the field and the fix,
not minutes later inside a worker. Every check here only reads, except the storage
probe, which runs last, once the URI is known to be this job's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from pathlib import Path

from spotline.checkpoint import (
    CheckpointMismatchError,
    CheckpointStore,
    CorruptCheckpointError,
    StorageError,
)
from spotline.checkpoint.lease import check_free
from spotline.checkpoint.staging import GB, check_local_dir
from spotline.config.backfill import SpeculativeTaskSpec
from spotline.config.identity import RETUNABLE_FIELDS
from spotline.config.loader import SpecError
from spotline.config.redact import redact
from spotline.config.schema import JobSpec
from spotline.data import open_dataset
from spotline.planning.checkpoint_time import checkpoint_bytes
from spotline.planning.memory_model import memory_problem
from spotline.storage.fs import explain_read_error


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
            prompts = [line for line in path.read_text("utf-8").splitlines() if line.strip()]
        except UnicodeDecodeError as e:
            raise SpecError(
                f"{field}.prompts: {str(path)!r} is not UTF-8 text (byte {e.start} cannot be "
                "decoded); save it as UTF-8"
            ) from None
        except OSError as e:
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


def node_shape(spec: JobSpec, local_cluster: bool) -> tuple[int, int | None]:
    """(ranks on one node, its host RAM in bytes or None) for the per-node figures of
    the plan: resources.ranks_per_node and resources.node_memory_gb, else on a local
    cluster every rank on this machine and its RAM, else 8 ranks and an unknown RAM."""
    r = spec.resources
    ram = int(r.node_memory_gb * GB) if r.node_memory_gb is not None else None
    if local_cluster:
        import psutil

        world = spec.parallel.pipeline_stages * spec.elastic.max_replicas
        return r.ranks_per_node or world, ram or psutil.virtual_memory().total
    return r.ranks_per_node or 8, ram


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
    problem = memory_problem(spec, *have)
    if problem:
        raise SpecError(problem)


def resolve_tokenizer(spec: JobSpec) -> None:
    """Read the tokenizer and write what it is into the spec (tokenizer.sha256 and
    vocab_size); the spec hash covers them, so resuming onto another tokenizer is
    refused, saying what changed."""
    from spotline.data import job_tokenizer

    tok = job_tokenizer(spec)
    t = spec.tokenizer
    if t.sha256 is not None and t.sha256 != tok.sha256:
        raise SpecError(
            f"tokenizer.sha256 is {t.sha256[:12]}... but {t.path} hashes to "
            f"{tok.sha256[:12]}...: it is another tokenizer; point tokenizer.path at the "
            "right one, or drop tokenizer.sha256"
        )
    if t.kind != "byte":
        t.sha256 = tok.sha256
    t.vocab_size = tok.vocab_size
    given = getattr(spec.model, "vocab_size", None)
    if given is not None and given < tok.vocab_size:
        raise SpecError(
            f"model.vocab_size ({given}) is smaller than the tokenizer's vocabulary "
            f"({tok.vocab_size}, {t.path or t.kind}); raise model.vocab_size or leave it out"
        )


def resolve_datasets(spec: JobSpec) -> None:
    """Read each prepared dataset's index (never its shards) and write its identity into
    the spec (data.sources[i].index_sha256), after checking it fits the tokenizer and
    the model."""
    from spotline.data.tokens import read_index

    d, t = spec.data, spec.tokenizer
    for i, src in enumerate(d.sources):
        field = f"data.sources[{i}].uri" if len(d.sources) > 1 else "data.uri"
        index, sha = read_index(
            src.uri, endpoint_url=d.endpoint_url, storage_options=d.storage_options, field=field
        )
        if src.index_sha256 is not None and src.index_sha256 != sha:
            raise SpecError(
                f"{field}: the index at {src.uri} hashes to {sha[:12]}..., not "
                f"{src.index_sha256[:12]}...: the dataset changed; drop index_sha256 to "
                "take it as it is now"
            )
        theirs = index.get("tokenizer_sha256")
        mine = t.sha256 or ("byte" if t.kind == "byte" else None)
        if theirs is not None and mine is not None and theirs != mine:
            raise SpecError(
                f"{field}: {src.uri} was prepared with tokenizer {str(theirs)[:12]}... and "
                f"this job's tokenizer is {mine[:12]}... ({t.path or t.kind}); prepare it "
                "again with this tokenizer, or point tokenizer.path at the one it used"
            )
        if int(index.get("vocab_size", 0)) > spec.vocab_size():
            raise SpecError(
                f"{field}: {src.uri} was prepared with a vocabulary of {index['vocab_size']}, "
                f"more than model.vocab_size ({spec.vocab_size()})"
            )
        src.index_sha256 = sha


@contextlib.contextmanager
def user_code_on_path(spec: JobSpec):
    """Make runtime_env's working_dir and py_modules importable here, as they will be in
    the job's actors, while the preflight imports a custom provider."""
    env = spec.runtime_env.ray() or {}
    paths = ([env["working_dir"]] if "working_dir" in env else []) + [
        str(Path(m).parent) for m in env.get("py_modules", [])
    ]
    added = [p for p in paths if p not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for p in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(p)


def check_model(spec: JobSpec) -> None:
    """The provider imports, its config validates, the pipeline can be cut, and an
    init_from checkpoint has the spec's shape: its config.json, and every safetensors
    header's tensor names, dtypes and shapes (the headers only, never the weights)."""
    from spotline.models import hf_checkpoint_fs, model_def, provider

    with user_code_on_path(spec):
        md = model_def(spec)
    if md.n_blocks < spec.parallel.pipeline_stages:
        raise SpecError(
            f"parallel.pipeline_stages ({spec.parallel.pipeline_stages}) must be <= the "
            f"model's {md.n_blocks} block(s) ({md.block_class.__name__}); lower "
            "pipeline_stages or add layers"
        )
    init_from = getattr(spec.model, "init_from", None)
    if init_from:
        hf = getattr(provider(spec), "hf", None)
        if hf is None:
            raise SpecError(f"model.init_from: model.kind {spec.model.kind!r} has no HF format")
        fs, root = hf_checkpoint_fs(spec, init_from)
        try:
            hf.check_checkpoint(fs, root, spec.model, spec.vocab_size(), init_from)
        except SpecError:
            raise
        except Exception as e:  # noqa: BLE001 - storage: unreachable, no credentials
            why = explain_read_error(init_from, e)
            raise SpecError(f"model.init_from: {redact(why)}") from None


def package_installed(name: str) -> bool:
    """True when `name` can be imported here (found, not imported: no side effects)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def check_trackers(spec: JobSpec) -> None:
    """Every tracker's package is installed (the controller imports it on the head node,
    which runs the same image as this driver), and its local directory is absolute, as
    checkpoint.uri is: relative to where the job was started, not to the controller's
    working directory."""
    for i, t in enumerate(spec.tracking):
        if not package_installed(t.package):
            raise SpecError(
                f"tracking[{i}] ({t.kind}) needs the {t.package} package: "
                "pip install 'spotline[tracking]'"
            )
        if getattr(t, "dir", None):
            t.dir = os.path.abspath(os.path.expanduser(t.dir))
        uri = getattr(t, "tracking_uri", "")
        if uri.startswith("sqlite:"):
            missing = [m for m in ("sqlalchemy", "alembic") if not package_installed(m)]
            if missing:
                raise SpecError(
                    f"tracking[{i}] ({t.kind} {uri}) needs {' and '.join(missing)} for an "
                    "sqlite store: pip install 'spotline[tracking]'"
                )
            t.tracking_uri = absolute_sqlite_uri(uri)


def absolute_sqlite_uri(uri: str) -> str:
    """sqlite:///relative.db made absolute (sqlite:////abs/relative.db), against where
    the job is started, not the controller's working directory; other URIs unchanged."""
    head, sep, path = uri.partition(":///")
    if head != "sqlite" or not sep or not path or path.startswith("/") or path == ":memory:":
        return uri
    return f"sqlite:///{os.path.abspath(os.path.expanduser(path))}"


def check_offline(
    spec: JobSpec,
    local_cluster: bool = True,
    unchecked: list[str] | None = None,
    read_tokenizer: bool = True,
) -> CheckpointStore:
    """Every check that needs no storage or data service: prompts, tracker packages, URI
    and storage options, the model, memory, and the driver node's staging directory.
    Returns the (unopened) store.

    `unchecked`: for arithmetic on the spec (`spotline plan`, `validate --offline`), what
    needs a credential or a read is said there instead of failing: a tokenizer not read
    (none with `read_tokenizer` False, or one that cannot be read) gives way to the
    vocabulary of model.vocab_size or the preset, and a signing key not set here, or a
    local directory short of room here, is noted."""
    for i, task in enumerate(spec.backfill.tasks):
        if isinstance(task, SpeculativeTaskSpec):
            resolve_prompts(task, f"backfill.tasks[{i}]")
    check_trackers(spec)
    store = open_store(spec)
    if unchecked is None:
        resolve_tokenizer(spec)
    else:
        _tokenizer_or_assumed(spec, unchecked, read_tokenizer)
    check_model(spec)
    check_memory(spec, local_cluster)
    try:
        ckpt = checkpoint_bytes(spec)
        check_local_dir(spec.checkpoint.staging_dir, "checkpoint.staging_dir", ckpt)
        if spec.data.kind == "tokens":
            check_local_dir(spec.data.cache_dir, "data.cache_dir")
    except SpecError as e:
        if unchecked is None:
            raise
        unchecked.append(f"{e} (on this machine; each node's is checked where it runs)")
    if spec.checkpoint.signing_key_env is not None:
        try:
            store.signing_key()  # the key must be here, or the first commit would fail
        except StorageError as e:
            if unchecked is None:
                raise
            unchecked.append(f"the manifest signing key: {e}")
    return store


def _tokenizer_or_assumed(spec: JobSpec, unchecked: list[str], read: bool) -> None:
    """`resolve_tokenizer`, or (not `read`, or it cannot be read) the vocabulary of
    model.vocab_size or the preset, with what that leaves unchecked."""
    from spotline.config.model import PRESET_VOCAB
    from spotline.data import DataError

    t = spec.tokenizer
    why = "--offline"
    if read or t.kind == "byte":  # a byte tokenizer is read from nowhere
        try:
            resolve_tokenizer(spec)
            return
        except DataError as e:
            why = f"it could not be read: {e}"
    given = getattr(spec.model, "vocab_size", None)
    preset = getattr(spec.model, "preset", None)
    if given is not None:
        vocab, source = given, "model.vocab_size"
    elif preset in PRESET_VOCAB:
        vocab, source = PRESET_VOCAB[preset], f"the {preset} preset's"
    else:
        raise SpecError(
            f"tokenizer.path {t.path} was not read ({why}), and the vocabulary it would "
            "give is needed: set model.vocab_size to plan without reading it"
        )
    t.vocab_size = vocab
    unchecked.append(
        f"tokenizer.path {t.path} was not read ({why}); the vocabulary is taken as "
        f"{vocab:,} ({source}): the embedding and output layers, the first and last "
        "stages' memory, the checkpoint's size, the step time and the cost assume it, and "
        "the tokenizer itself (its sha256, the data's fit to it) is not checked"
    )


def check_resume_from(spec: JobSpec, store: CheckpointStore) -> None:
    """checkpoint.resume_from, when the job has no checkpoint of its own to resume: the
    step is committed there, and this spec may go on from it (reads one manifest)."""
    source_spec = spec.checkpoint.resume_from
    if source_spec is None or store.committed_steps():
        return
    field = "checkpoint.resume_from"
    try:
        source = store.sibling(source_spec.uri)
        steps = source.committed_steps()
    except (ValueError, StorageError) as e:
        raise SpecError(f"{field}.uri: {e}") from None
    step = source_spec.step or (steps[-1] if steps else None)
    if step not in steps:
        have = f"its committed steps are {steps}" if steps else "it holds no committed step"
        raise SpecError(
            f"{field}: step {step or '(newest)'} is not committed at {source.uri} ({have}); "
            f"set {field}.step to one of them, or fix {field}.uri"
        )
    try:
        m = source.load_manifest(step)
    except (CorruptCheckpointError, FileNotFoundError) as e:
        raise SpecError(f"{field}: step {step} at {source.uri} does not load: {e}") from None
    if spec.retuned_fields(m.spec_hash, m.extra.get("spec")) is None:
        diff = spec.changed_fields(m.extra.get("spec") or {})
        raise SpecError(
            f"{field}: step {step} at {source.uri} was trained with another model, data or "
            f"batch (differs in {', '.join(diff[:6]) or 'its spec hash'}); only "
            f"{', '.join(sorted(RETUNABLE_FIELDS))} may change when resuming from it"
        )


def preflight(spec: JobSpec, local_cluster: bool = True) -> CheckpointStore:
    """All checks, in order: the tokenizer and dataset indexes (resolved into the spec),
    the offline ones, whose URI it is (read-only), that the storage is writable (a probe
    object), and a text corpus. Returns the store."""
    store = check_offline(spec, local_cluster)
    resolve_datasets(spec)  # before the owner check: the spec hash covers what it resolves
    store.check_credentials()
    try:
        check_free(store, spec.name)  # a running job's first: it says the most
        store.check_owner(spec)
    except CheckpointMismatchError as e:
        raise SpecError(str(e)) from None
    store.check_writable()
    check_resume_from(spec, store)
    if spec.data.kind == "text":  # a small corpus read whole; a token dataset's index was
        open_dataset(spec)  # read above, and its shards are read by the workers only
    return store
