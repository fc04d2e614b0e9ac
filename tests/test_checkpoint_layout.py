"""A rank's checkpoint files (spotline.checkpoint.layout) and reads at another shape
(spotline.checkpoint.reshard), on hand-made snapshots: no engine, no DeepSpeed.

The engine side (what a rank holds, at every ZeRO stage and pipeline shape) is
tests/test_sharded_state.py's.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from spotline.checkpoint import layout, reshard
from spotline.checkpoint.layout import CheckpointFormatError
from spotline.storage.fs import hash_file

pytestmark = pytest.mark.unit

SHAPE = [8, 16]  # 128 elements: 512 bytes in fp32, 256 in bf16


def _snapshot(rank: int, ranks: int) -> layout.RankSnapshot:
    """Rank `rank` of `ranks` holding an equal fp32 range of "0.w", and (rank 0) the
    whole bf16 weight and a small fp32 param "1.b"."""
    full = torch.arange(128, dtype=torch.float32)
    n = 128 // ranks
    tensors, entries = {}, []

    def add(param: str, kind: str, start: int, t: torch.Tensor, shape: list[int]) -> None:
        key = f"{param}/{kind}/{start}"
        tensors[key] = t
        entries.append(
            {
                "key": key,
                "param": param,
                "kind": kind,
                "start": start,
                "numel": t.numel(),
                "shape": shape,
                "dtype": layout.dtype_name(t.dtype),
                "rank": rank,
            }
        )

    add("0.w", "fp32", rank * n, full[rank * n : (rank + 1) * n].clone(), SHAPE)
    add("0.w", "exp_avg", rank * n, -full[rank * n : (rank + 1) * n].clone(), SHAPE)
    if rank == 0:
        add("0.w", "weight", 0, full.to(torch.bfloat16), SHAPE)
        add("1.b", "fp32", 0, torch.ones(4), [4])
    meta = {
        "format": layout.FORMAT,
        "adam_step": 1.0,
        "optim_keys": ["exp_avg"],
        "lr_scheduler": None,
        "global_steps": 1,
        "global_samples": 8,
        "topology": {
            "pipeline_stages": 1,
            "replicas": ranks,
            "stage": 0,
            "replica": rank,
            "rank": rank,
            "zero_stage": 1,
        },
    }
    return layout.RankSnapshot(tensors, entries, meta)


def _write(root: Path, ranks: int, chunk_bytes: int) -> list[layout.RankFiles]:
    return [
        layout.write_rank(_snapshot(r, ranks), layout.rank_dir(root, r), chunk_bytes=chunk_bytes)
        for r in range(ranks)
    ]


def test_the_writer_hashes_each_file_once_and_knows_its_sha256(tmp_path: Path) -> None:
    written = _write(tmp_path, 2, chunk_bytes=128)
    for rank, files in enumerate(written):
        rdir = layout.rank_dir(tmp_path, rank)
        assert sorted(files.files) == [layout.META_FILE, layout.STATE_FILE]
        for name, digest in files.files.items():
            data = (rdir / name).read_bytes()
            # What the upload would compute from the file: the writer already has it.
            assert digest == (len(data), hashlib.sha256(data).hexdigest())
            assert digest.sha256 == hash_file(rdir / name)
        raw = (rdir / layout.STATE_FILE).read_bytes()
        for e in files.entries:
            assert e["file"] == f"rank_{rank:05d}/{layout.STATE_FILE}"
            body = raw[e["offset"] : e["offset"] + e["nbytes"]]
            assert hashlib.sha256(body).hexdigest() == e["sha256"]
            assert e["chunk_sha256"] == [
                hashlib.sha256(body[i : i + 128]).hexdigest() for i in range(0, len(body), 128)
            ]
            layout.check_entry(e)
        assert not (rdir / (layout.STATE_FILE + ".tmp")).exists()
        doc = json.loads((rdir / layout.META_FILE).read_bytes())
        assert doc["entries"] == files.entries and doc["format"] == layout.FORMAT


def test_the_file_is_safetensors_own_and_the_same_state_gives_the_same_bytes(
    tmp_path: Path,
) -> None:
    from safetensors.torch import load_file, save_file

    snap = _snapshot(0, 1)
    a = layout.write_rank(snap, tmp_path / "a" / "r", chunk_bytes=64)
    b = layout.write_rank(snap, tmp_path / "b" / "r", chunk_bytes=64)
    assert a.files == b.files and a.entries == b.entries
    save_file(
        snap.tensors,
        str(tmp_path / "ref.safetensors"),
        metadata={"spotline": json.dumps({"format": layout.FORMAT}, sort_keys=True)},
    )
    written = (tmp_path / "a" / "r" / layout.STATE_FILE).read_bytes()
    assert written == (tmp_path / "ref.safetensors").read_bytes()
    back = load_file(str(tmp_path / "a" / "r" / layout.STATE_FILE))
    assert all(torch.equal(back[k], t) for k, t in snap.tensors.items())


def test_an_entry_of_one_chunk_has_its_chunks_hash(tmp_path: Path) -> None:
    files = layout.write_rank(_snapshot(0, 1), tmp_path / "r", chunk_bytes=layout.CHUNK_BYTES)
    for e in files.entries:
        assert e["chunk_sha256"] == [e["sha256"]]


def test_a_dtype_named_by_an_index_is_only_ever_a_checkpoint_dtype() -> None:
    assert layout.torch_dtype("bfloat16") is torch.bfloat16
    assert layout.ITEMSIZE["bfloat16"] == torch.bfloat16.itemsize
    with pytest.raises(KeyError, match="not a checkpoint dtype"):
        layout.torch_dtype("load")  # an attribute of torch, never a dtype of a checkpoint


def test_reads_at_another_shape_are_verified_and_chunk_aligned(tmp_path: Path) -> None:
    _write(tmp_path, 4, chunk_bytes=32)  # written by 4 ranks, 32 elements each
    index, meta = reshard.read_index(tmp_path)
    assert meta["topology"] == {"pipeline_stages": 1, "replicas": 4, "zero_stage": 1}
    read = reshard.directory_reader(tmp_path)
    full = reshard.full_params(index, read)
    assert list(full) == ["0.w", "1.b"]
    assert torch.equal(full["0.w"], torch.arange(128, dtype=torch.float32).reshape(SHAPE))

    # One reader of another shape: elements [20, 50) of the fp32 master, and the whole
    # bf16 copy (from the saved weight of that dtype).
    plan = reshard.Plan(index)
    plan.param("0.w", tuple(SHAPE))
    plan.need("0.w", "fp32", 20, 50)
    assert plan.whole("0.w", torch.bfloat16) == "weight"
    got = plan.read(read)
    assert torch.equal(got.get("0.w", "fp32", 20, 30), torch.arange(20, 50, dtype=torch.float32))
    assert torch.equal(got.all("0.w", "weight"), torch.arange(128).to(torch.bfloat16))
    # [20, 50) spans two saved entries; of each, only the 32-byte chunks it touches.
    assert got.stats["bytes_by_kind"] == {"fp32": 64 + 96, "weight": 256}
    assert got.stats["entries_read"] == 3

    def corrupt(entry: dict, start: int, length: int) -> bytes:
        data = bytearray(read(entry, start, length))
        data[0] ^= 1
        return bytes(data)

    with pytest.raises(CheckpointFormatError, match="sha256 mismatch"):
        _read_all(index, corrupt)
    with pytest.raises(CheckpointFormatError, match="saved shape"):
        reshard.Plan(index).param("0.w", (128,))
    missing = reshard.Plan([e for e in index if not (e["kind"] == "fp32" and e["rank"] == 1)])
    missing.need("0.w", "fp32", 0, 128)
    with pytest.raises(CheckpointFormatError, match="not covered by the saved fragments"):
        missing.read(read)


def _read_all(index: list[dict], read: reshard.Reader) -> None:
    plan = reshard.Plan(index)
    plan.need("0.w", "fp32", 0, 128)
    plan.read(read)
