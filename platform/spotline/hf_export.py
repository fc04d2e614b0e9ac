"""`spotline export`: a committed checkpoint as a Hugging Face model directory.

Takes a committed step (the latest by default), reads its full fp32 weights from every
rank's shards (sha256-verified, never the optimizer state), and writes config.json, safetensors (sharded for big models)
and the job's tokenizer files to a local directory or any fsspec URI, so that
`transformers.AutoModelForCausalLM.from_pretrained` and `AutoTokenizer` load it.

A destination that holds anything is refused before a weight is read, naming what the
export would replace, unless `overwrite`; then the files of an earlier export that this
one does not write (the shards of a bigger model, its index) are removed, so the
directory holds one model. Files that are not a model's are left where they are.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

from spotline.checkpoint import (
    TOKENIZER_ARTIFACTS,
    CheckpointStore,
    CorruptCheckpointError,
    Manifest,
)
from spotline.checkpoint.layout import CheckpointFormatError
from spotline.config.loader import SpecError
from spotline.config.schema import JobSpec
from spotline.storage import files_under, some_names

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# What an export writes: config.json, safetensors (one file, or shards and their index)
# and the tokenizer's files.
_MODEL_FILE = re.compile(
    r"^(config\.json|model\.safetensors(\.index\.json)?|model-\d+-of-\d+\.safetensors)$"
)


def job_spec_of(manifest: Manifest) -> JobSpec:
    """The model and tokenizer a checkpoint was trained with, from its manifest."""
    flat = manifest.extra.get("spec")
    if not isinstance(flat, dict):
        raise SpecError(
            f"checkpoint step {manifest.step} records no spec (written by an older Spotline); "
            "it cannot be exported"
        )
    raw: dict[str, Any] = {}
    for key, value in flat.items():
        section, _, field = key.partition(".")
        if section in ("model", "tokenizer") and "." not in field:
            raw.setdefault(section, {})[field] = value
    raw.setdefault("model", {})["vocab_size"] = manifest.extra.get("vocab_size")
    raw["model"].pop("preset", None)  # the shape fields are all recorded
    tok = raw.setdefault("tokenizer", {})
    if tok.get("kind") == "huggingface":
        tok["path"] = "(recorded)"
    from spotline.config.loader import validate_dict

    raw["parallel"] = {"pipeline_stages": 1}
    return validate_dict(raw, f"checkpoint step {manifest.step}")


def _is_model_file(name: str) -> bool:
    return bool(_MODEL_FILE.match(name)) or name in TOKENIZER_FILES


def _claim(out: str, overwrite: bool) -> list[str]:
    """What is at `out` already (refused, unless `overwrite`): the files an export
    writes, which the next one replaces."""
    fs, root = _out_fs(out)
    found = files_under(fs, root)
    if found == [""]:
        raise SpecError(f"--out {out} is a file; give a directory for the model")
    if found and not overwrite:
        ours = [n for n in found if _is_model_file(n)]
        rest = [n for n in found if not _is_model_file(n)]
        what = [f"it would replace {some_names(ours)}"] if ours else []
        what += [f"it holds {some_names(rest)}"] if rest else []
        raise SpecError(
            f"--out {out} is not empty: {'; '.join(what)}; choose an empty or new directory, "
            "or pass --overwrite to replace the model there"
        )
    return [n for n in found if _is_model_file(n)]


def export_hf(
    store: CheckpointStore, out: str, step: int | None = None, *, overwrite: bool = False
) -> tuple[int, str]:
    """Export committed `step` (default: the latest) of `store` to `out`; (step, out). A
    non-empty `out` is refused unless `overwrite`."""
    from spotline.checkpoint import reshard
    from spotline.models import provider

    if store.root_missing():
        raise SpecError(
            f"{store.fields.uri} {store.uri} does not exist; give the job's checkpoint URI "
            "(its checkpoint.uri with {job} filled in)"
        )
    earlier = _claim(out, overwrite)
    steps = store.committed_steps()
    if not steps:
        raise SpecError(f"{store.uri} holds no committed checkpoint to export")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise SpecError(f"step {step} is not committed at {store.uri}; committed: {steps}")
    try:
        manifest = store.load_manifest(step)
        spec = job_spec_of(manifest)
        hf = getattr(provider(spec), "hf", None)
        if hf is None:
            raise SpecError(
                f"model.kind {spec.model.kind!r} has no Hugging Face format; export supports llama"
            )
        weights = reshard.full_params(manifest.extra["index"], reshard.store_reader(store, step))
    except (CorruptCheckpointError, CheckpointFormatError) as e:
        raise _corrupt(store, step, steps, e.path, e.reason) from None
    with tempfile.TemporaryDirectory(prefix="spotline-export-") as tmp:
        local = Path(tmp) / "hf"
        tok = _tokenizer_files(store)
        hf.save_hf(local, spec.model, spec.vocab_size(), weights, **_special_ids(tok))
        for name, data in tok.items():
            (local / name).write_bytes(data)
        _copy_out(local, out, stale=[n for n in earlier if not (local / n).exists()])
    return step, out


def _corrupt(
    store: CheckpointStore, step: int, steps: list[int], path: str, reason: str
) -> CorruptCheckpointError:
    """The refusal to export a step that fails verification, naming another one."""
    others = [s for s in steps if s != step]
    if others:
        fix = f"export another step with --step {others[-1]} (committed: {steps})"
    else:
        fix = (
            "no other step is committed there; restore the file from a copy, or resume "
            "the job to commit a new step"
        )
    return CorruptCheckpointError(
        step,
        path,
        reason,
        uri=store.uri,
        message=f"step {step} of {store.uri}: {path} is corrupt ({reason}); {fix}",
    )


def _tokenizer_files(store: CheckpointStore) -> dict[str, bytes]:
    files = {}
    for name in TOKENIZER_FILES:
        data = store.read_artifact(f"{TOKENIZER_ARTIFACTS}/{name}")
        if data is not None:
            files[name] = data
    return files


def _special_ids(tok: dict[str, bytes]) -> dict[str, int | None]:
    """bos/eos ids for config.json, from the tokenizer files (None when unknown)."""
    if "tokenizer.json" not in tok:
        return {}
    from tokenizers import Tokenizer

    t = Tokenizer.from_str(tok["tokenizer.json"].decode())
    cfg = json.loads(tok.get("tokenizer_config.json", b"{}"))
    out: dict[str, int | None] = {}
    for key in ("bos", "eos"):
        token = cfg.get(f"{key}_token")
        if isinstance(token, dict):
            token = token.get("content")
        out[f"{key}_token_id"] = t.token_to_id(token) if token else None
    return out


def _out_fs(out: str):
    """(fsspec filesystem, root path) of the destination."""
    import fsspec

    if "://" not in out or out.startswith("file://"):
        dest = Path(out.removeprefix("file://")).expanduser().resolve()
        return fsspec.filesystem("file"), str(dest)
    return fsspec.core.url_to_fs(out)


def _copy_out(local: Path, out: str, stale: list[str]) -> None:
    """Put the files of `local` at `out`, after removing `stale` ones of an earlier
    export that this one does not write."""
    fs, root = _out_fs(out)
    root = root.rstrip("/")
    for name in stale:
        fs.rm_file(f"{root}/{name}")
    fs.makedirs(root, exist_ok=True)
    for f in local.iterdir():
        fs.put_file(str(f), f"{root}/{f.name}")


__all__ = ["export_hf", "job_spec_of"]
