"""`prepare` with a pool of worker processes: the output is byte-identical whatever the
number of workers (the rest of `prepare` runs in one process: test_data_tokens.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

import spotline.data.prepare as prep
from spotline.data.prepare import prepare
from test_data_tokens import bpe, bpe_dir, corpus_dir  # noqa: F401 - its fixtures

pytestmark = pytest.mark.procs


def test_prepare_is_deterministic_whatever_the_workers(
    bpe,  # noqa: F811 - the fixture
    corpus_dir: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch,
) -> None:
    monkeypatch.setattr(prep, "PART_BYTES", 20_000)  # several parts, so the pool is used
    runs = {}
    for name, workers in (("a", 1), ("b", 1), ("c", 2)):
        out = tmp_path / name
        prepare(str(corpus_dir), bpe, str(out), shard_tokens=7_000, workers=workers, progress=False)
        runs[name] = {p.name: p.read_bytes() for p in out.glob("*.npy")} | {
            "index.json": (out / "index.json").read_bytes()
        }
    assert runs["a"] == runs["b"] == runs["c"]
    assert len(runs["a"]) > 4
