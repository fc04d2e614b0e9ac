"""`spotline export`: a committed checkpoint as a Hugging Face model directory.

Takes a committed step (the latest by default), reads its full fp32 weights from every
rank's shards (sha256-verified, never the optimizer state), and writes config.json, safetensors (sharded for big models)
and the job's tokenizer files to a local directory or any fsspec URI, so that
`transformers.AutoModelForCausalLM.from_pretrained` and `AutoTokenizer` load it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from spotline.checkpoint import CheckpointStore, CorruptCheckpointError, Manifest
from spotline.checkpoint.layout import CheckpointFormatError
from spotline.config.loader import SpecError
from spotline.config.schema import JobSpec

TOKENIZER_ARTIFACTS = "tokenizer"
"""Where a job keeps copies of its tokenizer files, under the checkpoint's artifacts/."""


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


def export_hf(store: CheckpointStore, out: str, step: int | None = None) -> tuple[int, str]:
    """Export committed `step` (default: the latest) of `store` to `out`; (step, out)."""
    from spotline.models import provider
    from spotline.train import state

    if store.root_missing():
        raise SpecError(f"{store.uri} does not exist; give the job's checkpoint.uri")
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
        weights = state.full_params(manifest.extra["index"], state.store_reader(store, step))
    except (CorruptCheckpointError, CheckpointFormatError) as e:
        raise _corrupt(store, step, steps, e.path, e.reason) from None
    with tempfile.TemporaryDirectory(prefix="spotline-export-") as tmp:
        local = Path(tmp) / "hf"
        tok = _tokenizer_files(store)
        hf.save_hf(local, spec.model, spec.vocab_size(), weights, **_special_ids(tok))
        for name, data in tok.items():
            (local / name).write_bytes(data)
        _copy_out(local, out)
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
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    files = {}
    for name in names:
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


def _copy_out(local: Path, out: str) -> None:
    if "://" not in out or out.startswith("file://"):
        dest = Path(out.removeprefix("file://")).expanduser()
        dest.mkdir(parents=True, exist_ok=True)
        for f in local.iterdir():
            shutil.copy2(f, dest / f.name)
        return
    import fsspec

    fs, root = fsspec.core.url_to_fs(out)
    for f in local.iterdir():
        fs.put_file(str(f), f"{root.rstrip('/')}/{f.name}")


__all__ = ["TOKENIZER_ARTIFACTS", "export_hf", "job_spec_of"]
