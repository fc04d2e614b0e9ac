"""Nothing the user made is replaced without --overwrite (`spotline prepare`, `export`,
`tokenizer train`), and a file that is not text is refused, naming it, before any work
starts. Through the CLI, in process; no Ray."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from spotline.cli import main

pytestmark = pytest.mark.unit

TEXT = "def f(x):\n    return x + 1\n" * 40


def _err(capsys) -> str:
    """The one line of the refusal (after prepare's progress bar, if it drew one)."""
    err = capsys.readouterr().err.strip()
    lines = [ln for ln in err.splitlines() if ln.startswith("spotline:")]
    assert len(lines) == 1 and lines[0] == err.splitlines()[-1] and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def corpus(tmp_path) -> Path:
    src = tmp_path / "in"
    src.mkdir()
    for i in range(3):
        (src / f"doc{i}.txt").write_text(TEXT * (i + 1))
    return src


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> Path:
    from spotline.data.tokenizer import train_bpe

    out = tmp_path_factory.mktemp("bpe") / "tok"
    train_bpe("stdlib", str(out), vocab_size=300, max_bytes=100_000)
    return out


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _prepare(src, tok, out, *more) -> list[str]:
    return ["prepare", str(src), "--tokenizer", str(tok), "--out", str(out), "--workers", "1",
            *more]  # fmt: skip


def test_prepare_refuses_a_finished_dataset_and_overwrite_replaces_it_cleanly(
    corpus, bpe_dir, tmp_path, capsys, monkeypatch
):
    import spotline.data.prepare as prep

    out = tmp_path / "ds"
    assert main(_prepare(corpus, "byte", out)) == 0
    before = _snapshot(out)
    capsys.readouterr()

    # Another tokenizer onto the finished dataset: refused, nothing touched.
    assert main(_prepare(corpus, bpe_dir, out)) == 2
    err = _err(capsys)
    assert f"--out {out} holds a finished dataset" in err and "tokenizer byte" in err
    assert "--overwrite" in err
    assert _snapshot(out) == before
    # The same command again is refused too: the dataset is finished.
    assert main(_prepare(corpus, "byte", out)) == 2
    assert "finished dataset" in _err(capsys)

    # --overwrite: the new dataset, and no shard of the old one that its index omits.
    monkeypatch.setattr(prep, "PART_BYTES", 500)
    assert main(_prepare(corpus, bpe_dir, out, "--overwrite")) == 0
    index = json.loads((out / "index.json").read_text())
    assert index["tokenizer_sha256"] != "byte"
    listed = {s["path"] for s in index["shards"]} | {s["docs_path"] for s in index["shards"]}
    assert {p.name for p in out.glob("shard-*")} == listed
    assert {p.name for p in (out / "_parts").glob("shard-*")} == {
        f"shard-{k:05d}.json" for k in range(len(index["shards"]))
    }


def test_prepare_resumes_its_own_unfinished_run_and_refuses_another(
    corpus, bpe_dir, tmp_path, capsys
):
    out = tmp_path / "ds"
    assert main(_prepare(corpus, bpe_dir, out)) == 0
    index = (out / "index.json").read_bytes()
    (out / "index.json").unlink()  # interrupted before its last write
    capsys.readouterr()
    assert main(_prepare(corpus, bpe_dir, out)) == 0  # the same plan: taken up again
    assert (out / "index.json").read_bytes() == index
    capsys.readouterr()

    (out / "index.json").unlink()
    assert main(_prepare(corpus, "byte", out)) == 2
    err = _err(capsys)
    assert "holds an unfinished dataset of another tokenizer" in err and "--overwrite" in err
    (corpus / "doc9.txt").write_text(TEXT)
    assert main(_prepare(corpus, bpe_dir, out)) == 2
    assert "unfinished dataset of other input files" in _err(capsys)
    assert main(_prepare(corpus, "byte", out, "--overwrite")) == 0


def test_prepare_refuses_a_folder_that_is_not_a_dataset(corpus, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.md").write_text("mine")
    assert main(_prepare(corpus, "byte", out)) == 2
    err = _err(capsys)
    assert "is not empty and not a prepared dataset" in err and "notes.md" in err
    assert [p.name for p in out.iterdir()] == ["notes.md"]
    assert main(_prepare(corpus, "byte", out, "--overwrite")) == 0
    assert (out / "notes.md").read_text() == "mine" and (out / "index.json").is_file()


def test_export_refuses_a_non_empty_destination_naming_what_it_would_replace(tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "mistral"}')
    (out / "model.safetensors").write_bytes(b"theirs")
    (out / "README.md").write_text("their model")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    assert main(["export", str(ckpt), "--out", str(out)]) == 2
    err = _err(capsys)
    assert f"--out {out} is not empty" in err
    assert "it would replace config.json, model.safetensors" in err and "README.md" in err
    assert "--overwrite" in err
    assert (out / "config.json").read_text() == '{"model_type": "mistral"}'
    # With --overwrite the destination is no obstacle: the next check is the checkpoint's.
    assert main(["export", str(ckpt), "--out", str(out), "--overwrite"]) == 2
    assert "holds no committed checkpoint" in _err(capsys)


def test_tokenizer_train_refuses_a_non_empty_destination(corpus, tmp_path, capsys):
    out = tmp_path / "tok"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    args = ["tokenizer", "train", str(corpus), "--vocab-size", "300", "--out", str(out)]
    assert main(args) == 2
    err = _err(capsys)
    assert f"--out {out} is not empty" in err and "tokenizer.json" in err
    assert (out / "tokenizer.json").read_text() == "{}"
    assert main([*args, "--overwrite"]) == 0
    assert json.loads((out / "tokenizer.json").read_text())["model"]["type"] == "BPE"


# --- text --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, why",
    [
        (random.Random(0).randbytes(4096), "is not text"),
        (b"caf\xe9 au lait\n" * 10, "byte 3 (0xe9) is not UTF-8"),
        ("utf-16 text".encode("utf-16"), "NUL byte"),
    ],
    ids=["random bytes", "latin-1", "utf-16"],
)
def test_prepare_refuses_a_file_that_is_not_text(corpus, tmp_path, capsys, content, why):
    (corpus / "random.txt").write_bytes(content)
    out = tmp_path / "ds"
    assert main(_prepare(corpus, "byte", out)) == 2
    err = _err(capsys)
    assert "input random.txt is not text" in err and why in err and "UTF-8" in err
    assert not out.exists()  # refused before any work started


def test_prepare_refuses_bad_text_past_the_sample(corpus, tmp_path, capsys):
    (corpus / "long.txt").write_bytes(b"a" * (1 << 17) + b"\xff")
    assert main(_prepare(corpus, "byte", tmp_path / "ds")) == 2
    assert "input long.txt is not text: byte 131072 (0xff) is not UTF-8" in _err(capsys)


def test_a_text_corpus_refuses_a_file_that_is_not_text(corpus, tmp_path, capsys):
    import yaml

    from spotline.config import load_spec
    from spotline.data import CorpusError, load_corpus

    bad = corpus / "random.txt"
    bad.write_bytes(os.urandom(2048))
    spec = load_spec(None, {"data.corpus": str(corpus)})
    with pytest.raises(CorpusError) as ei:
        load_corpus(spec.data)
    msg = str(ei.value)
    assert msg.startswith(f"data.corpus: {bad} is not text") and "\n" not in msg
    # `spotline validate` finds it before any worker would start.
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({
        "name": "text", "data": {"corpus": str(corpus)},
        "checkpoint": {"uri": f"file://{tmp_path}/ckpt", "staging_dir": str(tmp_path / "st")},
    }))  # fmt: skip
    assert main(["validate", str(config)]) == 2
    assert _err(capsys) == f"spotline: {msg}"


def test_the_stdlib_corpus_is_text(capsys):
    from spotline.data.textfiles import stdlib_files, text_problem
    from spotline.data.tokenizer import text_files

    files = stdlib_files((".py", ".txt"))
    assert len(files) > 500 and all(text_problem(p.read_bytes()) is None for p in files[:50])
    assert text_files("stdlib") == list(stdlib_files((".txt", ".md", ".py", ".rst")))


def test_tokenizer_train_refuses_a_file_that_is_not_text(corpus, tmp_path, capsys):
    (corpus / "random.txt").write_bytes(b"\x00\x01binary")
    args = ["tokenizer", "train", str(corpus), "--vocab-size", "300", "--out", str(tmp_path / "t")]
    assert main(args) == 2
    assert f"{corpus / 'random.txt'} is not text" in _err(capsys)
