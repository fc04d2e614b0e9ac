"""No path taken from an index, a manifest or a receipt leaves its root.

Each reader is given an entry that climbs out of its root, is absolute, names another
location, or (on a local disk) is a symlink to a file outside, with the right sha256
where it has one: every one is refused, naming the entry, and the outside file is
never opened. S3 datasets are in test_data_s3.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

from spotline.checkpoint import (
    CheckpointStore,
    CorruptCheckpointError,
    Manifest,
    ManifestError,
    reshard,
)
from spotline.checkpoint.coordinator import CommitCoordinator
from spotline.checkpoint.layout import CheckpointFormatError
from spotline.config import load_spec
from spotline.data import ByteTokenizer, DataError, ShardError, TokenDataset, read_index
from spotline.data.prepare import prepare
from spotline.storage import UnsafePathError, check_relpath, join_under

pytestmark = pytest.mark.unit

BAD_PATHS = [
    ("../outside.npy", r"holds '\.\.'"),
    ("a/../../outside.npy", r"holds '\.\.'"),
    ("/abs/outside.npy", r"is absolute"),
    ("s3://other-bucket/shard.npy", r"names a scheme or drive \(s3:\)"),
    ("file:/etc/passwd", r"names a scheme or drive \(file:\)"),
    ("C:shard.npy", r"names a scheme or drive \(C:\)"),
    ("a\\..\\outside.npy", r"holds a backslash"),
    ("shard\x00.npy", r"holds a NUL byte"),
    ("a//b.npy", r"holds an empty or '\.' segment"),
    ("./shard.npy", r"holds an empty or '\.' segment"),
    ("", r"is not a non-empty string"),
    (3, r"is not a non-empty string"),
]


# --- the one rule ----------------------------------------------------------------------


@pytest.mark.parametrize(("path", "why"), BAD_PATHS)
def test_check_relpath_refuses_what_leaves_a_root(path, why) -> None:
    with pytest.raises(UnsafePathError, match=why):
        check_relpath(path)
    with pytest.raises(UnsafePathError, match=why):
        join_under("bucket/prefix", path)


def test_join_under_keeps_a_path_inside_its_root(tmp_path: Path) -> None:
    assert join_under("bucket/ds/", "shard-00001.npy") == "bucket/ds/shard-00001.npy"
    assert join_under("bucket", "a-1f/rank_00000/x") == "bucket/a-1f/rank_00000/x"
    # Locally, links are resolved: one inside the root is followed, one leaving it is not.
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "real.npy").write_bytes(b"x")
    (tmp_path / "outside.npy").write_bytes(b"x")
    (root / "inside.npy").symlink_to(root / "sub" / "real.npy")
    (root / "out.npy").symlink_to(tmp_path / "outside.npy")
    (root / "up").symlink_to(tmp_path)
    assert join_under(root, "inside.npy", local=True) == str(root / "sub" / "real.npy")
    for name in ("out.npy", "up/outside.npy"):
        with pytest.raises(UnsafePathError, match="resolves through a symlink to .*, outside"):
            join_under(root, name, local=True)
    # Without `local` (object storage has no links) the name is only joined.
    assert join_under(root, "out.npy") == f"{root}/out.npy"


# --- prepared datasets -----------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corpus")
    for i in range(6):
        (out / f"doc{i}.txt").write_text(f"document {i} " + "lorem ipsum dolor " * 150)
    return out


@pytest.fixture
def dataset(corpus: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ds"
    prepare(str(corpus), ByteTokenizer(), str(out), shard_tokens=4_000, workers=1, progress=False)
    return out


def _spec(tmp_path: Path, uri: Path):
    return load_spec(
        None,
        {
            "data.kind": "tokens",
            "data.uri": str(uri),
            "data.cache_dir": str(tmp_path / "cache"),
            "model.seq_len": 32,
        },
    )


def _edit_shard(ds: Path, i: int, **fields) -> None:
    index = json.loads((ds / "index.json").read_text())
    index["shards"][i].update(fields)
    (ds / "index.json").write_text(json.dumps(index))


def _outside_copy(ds: Path, name: str = "shard-00000.npy") -> Path:
    """A file outside the dataset with exactly the bytes (and sha256) of one of its shards."""
    outside = ds.parent / "outside.npy"
    outside.write_bytes((ds / name).read_bytes())
    return outside


@pytest.mark.parametrize(("path", "why"), BAD_PATHS)
def test_an_index_whose_shard_path_leaves_the_dataset_is_refused(
    dataset: Path, tmp_path: Path, path, why
) -> None:
    outside = _outside_copy(dataset)
    if path == "/abs/outside.npy":
        path = str(outside)
    _edit_shard(dataset, 0, path=path)
    with pytest.raises(DataError) as ei:
        read_index(str(dataset))  # what the preflight reads, before any worker starts
    msg = str(ei.value)
    assert msg.startswith(f"data.uri: {dataset}/index.json shard 0 path {path!r} leaves the ")
    assert msg.endswith("; prepare the dataset again") and "\n" not in msg
    with pytest.raises(DataError, match=why):
        TokenDataset(_spec(tmp_path, dataset))


def test_a_climbing_shard_path_names_the_entry(dataset: Path, tmp_path: Path) -> None:
    _outside_copy(dataset)
    _edit_shard(dataset, 1, path="../outside.npy")
    with pytest.raises(DataError) as ei:
        TokenDataset(_spec(tmp_path, dataset))
    assert str(ei.value) == (
        f"data.uri: {dataset}/index.json shard 1 path '../outside.npy' leaves the dataset "
        "(holds '..'); prepare the dataset again"
    )


def test_the_preflight_refuses_it_naming_the_source(dataset: Path, tmp_path: Path) -> None:
    from spotline.preflight import resolve_datasets

    _edit_shard(dataset, 0, docs_path="../../etc/passwd")
    spec = load_spec(
        None,
        {
            "data.kind": "tokens",
            "data.sources": [{"uri": str(dataset)}, {"uri": str(dataset)}],
            "model.seq_len": 32,
        },
    )
    with pytest.raises(
        DataError,
        match=r"^data\.sources\[0\]\.uri: .*index\.json shard 0 docs_path '\.\./\.\./etc/passwd' "
        r"leaves the dataset \(holds '\.\.'\)",
    ):
        resolve_datasets(spec)


def test_a_shard_sha256_cannot_name_a_file_outside_the_cache(dataset: Path, tmp_path: Path):
    """The sha256 is the shard's file name in the node-local cache (and of its verified
    stamp): one that is a path would write there."""
    _edit_shard(dataset, 0, sha256="../../../escaped")
    with pytest.raises(DataError, match=r"shard 0 sha256 '\.\./\.\./\.\./escaped' is not 64"):
        read_index(str(dataset))


def test_a_symlinked_shard_leaving_the_dataset_is_refused(dataset: Path, tmp_path: Path):
    outside = _outside_copy(dataset)
    (dataset / "shard-00000.npy").unlink()
    (dataset / "shard-00000.npy").symlink_to(outside)
    with pytest.raises(
        DataError,
        match=rf"^data\.uri: {dataset}/index\.json shard 0 path 'shard-00000\.npy' leaves the "
        rf"dataset \(resolves through a symlink to {outside}, outside {dataset}\)",
    ):
        TokenDataset(_spec(tmp_path, dataset))


def test_a_symlink_inside_the_dataset_is_followed(dataset: Path, tmp_path: Path) -> None:
    (dataset / "keep").mkdir()
    (dataset / "shard-00000.npy").rename(dataset / "keep" / "s0.npy")
    (dataset / "shard-00000.npy").symlink_to(dataset / "keep" / "s0.npy")
    ds = TokenDataset(_spec(tmp_path, dataset))
    assert ds.train.windows(np.array([0]), 8).shape == (1, 8)


def test_a_link_planted_after_the_index_was_read_is_refused_on_open(
    dataset: Path, tmp_path: Path
) -> None:
    ds = TokenDataset(_spec(tmp_path, dataset))
    outside = _outside_copy(dataset, "shard-00001.npy")
    (dataset / "shard-00001.npy").unlink()
    (dataset / "shard-00001.npy").symlink_to(outside)
    ds.train.windows(np.array([10]), 8)  # shard 0 is untouched
    with pytest.raises(ShardError, match=r"shard 1 path 'shard-00001\.npy' leaves the dataset"):
        ds.train.windows(np.array([4_010]), 8)


def test_a_resume_record_leaving_the_dataset_is_refused(
    corpus: Path, dataset: Path, tmp_path: Path
) -> None:
    """prepare's own resume records (out/_parts/) are read back too."""
    outside = _outside_copy(dataset)
    record = dataset / "_parts" / "shard-00000.json"
    rec = json.loads(record.read_text())
    rec["entry"]["path"] = os.path.relpath(outside, dataset)
    record.write_text(json.dumps(rec))
    (dataset / "index.json").unlink()  # an interrupted prepare: it resumes from the records
    with pytest.raises(
        DataError,
        match=rf"^out: {dataset}/_parts/shard-00000\.json path '\.\./outside\.npy' leaves the "
        rf"dataset \(holds '\.\.'\); delete {dataset}/_parts and run prepare again$",
    ):
        prepare(str(corpus), ByteTokenizer(), str(dataset), shard_tokens=4_000, progress=False)


# --- checkpoints -----------------------------------------------------------------------


def _commit_one(store: CheckpointStore, tmp_path: Path, step: int = 1) -> Manifest:
    src = tmp_path / "src.bin"
    src.write_bytes(b"checkpoint bytes")
    entry = store.upload_file(src, step, "a-g1/rank_00000/state.safetensors")
    index = [{"file": entry.path, "key": "k"}]
    m = Manifest(
        step=step,
        files=[entry],
        topology={},
        data_position={"next_step": step},
        spec_hash="h",
        created_at=0.0,
        extra={"index": index},
    )
    store.commit(m)
    return m


def test_a_manifest_index_entry_leaving_the_step_is_refused(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "ckpt"))
    good = _commit_one(store, tmp_path)
    raw = json.loads(good.to_json())
    raw["extra"]["index"].append({"file": "../../../outside.bin", "key": "k2"})
    with pytest.raises(
        ManifestError,
        match=r"^manifest of step 1: index entry 1 file '\.\./\.\./\.\./outside\.bin' holds "
        r"'\.\.' \(it must be a relative path inside the step directory\)$",
    ):
        Manifest.from_json(json.dumps(raw))
    # In storage, such a manifest is a corrupt step: a restore falls back past it.
    (tmp_path / "ckpt" / "step_00000001" / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(CorruptCheckpointError, match=r"index entry 1 file '\.\./\.\./\.\./out"):
        store.load_manifest(1)


def test_a_checkpoint_file_symlinked_out_of_its_step_is_never_read(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "ckpt"))
    m = _commit_one(store, tmp_path)
    rel = m.files[0].path
    target = tmp_path / "ckpt" / "step_00000001" / rel
    outside = tmp_path / "outside.bin"
    outside.write_bytes(target.read_bytes())  # same bytes: only the path gives it away
    target.unlink()
    target.symlink_to(outside)
    with pytest.raises(
        CorruptCheckpointError,
        match=rf"{rel}: leaves the step directory \(resolves through a symlink to {outside}",
    ):
        store.read_range(1, rel, 0, 4)
    with pytest.raises(CorruptCheckpointError, match="leaves the step directory"):
        store.verify_remote(m)
    # A path that climbs out is a corrupt checkpoint too, not a crash of the reader.
    with pytest.raises(CorruptCheckpointError, match=r"\.\./\.\./outside\.bin: leaves the step"):
        store.read_range(1, "../../outside.bin", 0, 4)


def _receipt(root: Path, spec, attempt: str, files: list, index: list, folder=None) -> None:
    """A well-formed receipt of this job and spec, so only its paths can refuse it."""
    body = {
        "job": spec.name,
        "spec_hash": spec.spec_hash(),
        "spec": spec.hashed_fields(),
        "step": 5,
        "attempt": attempt,
        "rank": 0,
        "world_size": 1,
        "files": files,
        "index": index,
        "batch": None,
    }
    where = root / "step_00000005" / "_receipts" / (folder or attempt) / "rank_00000.json"
    where.parent.mkdir(parents=True, exist_ok=True)
    where.write_text(json.dumps(body))


def test_receipts_whose_paths_leave_the_step_are_never_committed(tmp_path: Path) -> None:
    spec = load_spec(None, {"checkpoint.uri": f"file://{tmp_path}/ckpt"})
    store = CheckpointStore(spec.resolved_checkpoint_uri())
    with tempfile.NamedTemporaryFile() as f:
        f.write(b"x")
        f.flush()
        entry = store.upload_file(f.name, 5, "a-good/rank_00000/state.safetensors")
    root, good = tmp_path / "ckpt", dataclasses.asdict(entry)
    climbing = {**good, "path": "../../../outside.bin"}
    _receipt(root, spec, "files", [climbing], [])
    _receipt(root, spec, "index", [good], [{"file": "../outside.bin", "key": "k"}])
    _receipt(root, spec, "../../..", [good], [], folder="planted")
    _receipt(root, spec, "absolute", [{**good, "path": "/etc/passwd"}], [])
    scan = store.read_receipts(5)
    assert scan.receipts == {}
    assert len(scan.refused) == 4
    reasons = " | ".join(why for _, why in scan.refused)
    assert "../../../outside.bin" in reasons and "../outside.bin" in reasons
    assert "/etc/passwd" in reasons and "group '../../..'" in reasons
    events: list[str] = []
    coord = CommitCoordinator(spec, store, lambda msg, *a: events.append(msg))
    assert coord.commit_from_storage() == []
    assert store.committed_steps() == []


# --- training state and Hugging Face weights --------------------------------------------


def test_the_sharded_state_reader_never_opens_a_file_outside_its_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "rank_00000").mkdir(parents=True)
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"0123456789")
    read = reshard.directory_reader(root)
    with pytest.raises(CheckpointFormatError, match=r"k: leaves the checkpoint \(holds '\.\.'\)"):
        read({"file": "../outside.safetensors", "key": "k", "offset": 0}, 0, 4)
    (root / "rank_00000" / "state.safetensors").symlink_to(outside)
    with pytest.raises(CheckpointFormatError, match="resolves through a symlink"):
        read({"file": "rank_00000/state.safetensors", "key": "k", "offset": 0}, 0, 4)


def test_a_safetensors_index_naming_a_file_outside_the_folder_is_refused(tmp_path: Path):
    from spotline.models import build_sequential, model_def
    from spotline.models import hf as hfmod

    shape = {"kind": "llama", "n_layers": 2, "d_model": 64, "n_heads": 4, "ffn_hidden": 96}
    spec = load_spec(None, {"model": shape, "parallel.pipeline_stages": 1})
    vocab = spec.vocab_size()
    state_dict = build_sequential(model_def(spec)).state_dict()
    hfmod.save_hf(tmp_path / "m", spec.model, vocab, state_dict, max_shard_bytes=40_000)
    index_path = tmp_path / "m" / hfmod.INDEX
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    shard = index["weight_map"][first]
    (tmp_path / shard).write_bytes((tmp_path / "m" / shard).read_bytes())
    for bad, why in [
        (f"../{shard}", r"holds '\.\.'"),
        (str(tmp_path / shard), "is absolute"),
        (5, "is not a non-empty string"),
    ]:
        index["weight_map"][first] = bad
        index_path.write_text(json.dumps(index))
        with pytest.raises(ValueError, match=rf"names shard {bad!r}, which {why}: not a shard"):
            hfmod.load_hf(tmp_path / "m", spec.model, vocab)


def test_the_storage_rules_import_nothing_else_of_spotline() -> None:
    """storage/ sits below data/ and checkpoint/: it imports no other room, only the
    foundation beside it (the constants, and config's one redaction function, which
    every message of the checkpoint backends goes through)."""
    import ast

    import spotline.storage

    foundation = ("spotline.storage", "spotline.constants", "spotline.config.redact")
    for f in Path(spotline.storage.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "spotline":
                names = [f"spotline.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                assert not name.startswith("spotline") or name.startswith(foundation), (
                    f"{f.name} imports {name}"
                )


def test_a_tune_reference_cannot_start_a_run_outside_the_sweep(tmp_path: Path) -> None:
    """A PBT exploit starts a trial's new run under the sweep, named after the donor trial
    its reference file names."""
    from types import SimpleNamespace

    from spotline.tune.trial import REFERENCE_FILE, SpotlineTrial

    trial = SimpleNamespace(_root="s3://b/sweep", trial_id="t2")
    ref = {"trial": "t1", "uri": "s3://b/sweep/t1/run", "step": 20}
    (tmp_path / REFERENCE_FILE).write_text(json.dumps(ref))
    SpotlineTrial.load_checkpoint(trial, str(tmp_path))
    assert trial._uri == "s3://b/sweep/t2/from-t1-00000020"
    (tmp_path / REFERENCE_FILE).write_text(json.dumps({**ref, "trial": "x/../../../../other"}))
    with pytest.raises(ValueError, match=r"would start a run outside the sweep \(holds '\.\.'\)"):
        SpotlineTrial.load_checkpoint(trial, str(tmp_path))
