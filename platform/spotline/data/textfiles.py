"""Text files as every reader of a text corpus sees them: where the default corpus (the
standard library's source) lies, which files of a directory are read, and how a file is
told to be text, not binary. Used by the text dataset, `prepare` and the tokenizer
trainer; imports nothing else from data/.
"""

from __future__ import annotations

import codecs
import functools
import os
import sysconfig
from pathlib import Path

TEXT_SAMPLE_BYTES = 1 << 16
"""How much of a file is looked at to tell text from binary before reading it whole."""


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def text_problem(data: bytes, final: bool = True) -> str | None:
    """Why `data` is not text, or None. Text is UTF-8 with no NUL byte: random bytes,
    binaries, UTF-16 and legacy encodings (Latin-1, Big5...) all fail, so a file that
    merely carries a text suffix is never trained on. `final=False`: `data` is the
    head of a file, and may end inside a character."""
    nul = data.find(b"\0")
    if nul >= 0:
        return f"it holds a NUL byte at offset {nul} (binary data, or UTF-16 text)"
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=final)
    except UnicodeDecodeError as e:
        return f"byte {e.start} (0x{data[e.start]:02x}) is not UTF-8"
    return None


def not_text(where: str, why: str) -> str:
    """The one-line refusal of a file that is not text."""
    return (
        f"{where} is not text: {why}; convert it to UTF-8 (e.g. iconv -f LATIN1 -t UTF-8) "
        "or leave it out"
    )


@functools.lru_cache
def stdlib_files(suffixes: tuple[str, ...]) -> tuple[Path, ...]:
    """The 'stdlib' corpus: Python's own source files with these suffixes, less the few
    test fixtures written in other encodings (Latin-1, Big5...), which are not text by
    `text_problem`'s rule and are no one's mistake to fix."""
    return tuple(
        p
        for p in local_files(Path(stdlib_root()), suffixes)
        if text_problem(p.read_bytes()) is None
    )


def local_files(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    if root.is_file():
        return [root]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        # site-packages holds third-party code; keep the stdlib corpus the same everywhere.
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        out.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(suffixes))
    return out
