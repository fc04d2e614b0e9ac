"""A destination the user names (`--out` of prepare, export, tokenizer train): what is
already there, said in a few words.

Something a user made is never replaced without `--overwrite`: each writer looks at its
destination first with `files_under` and refuses a non-empty one, naming some of what
it holds with `some_names`. This module only lists; it never writes or removes.
"""

from __future__ import annotations

__all__ = ["files_under", "some_names"]


def files_under(fs, root: str) -> list[str]:
    """The files under `root` (recursively) as sorted paths relative to it, through the
    fsspec filesystem `fs`; [] when nothing is there. `root` being a file is reported
    as that file alone ([""])."""
    root = root.rstrip("/")
    try:
        if fs.isfile(root):
            return [""]
        found = fs.find(root)
    except FileNotFoundError:
        return []
    prefix = root + "/"
    return sorted(p[len(prefix) :] if p.startswith(prefix) else p for p in found)


def some_names(names: list[str], limit: int = 4) -> str:
    """'a, b, c and 5 more': the first `limit` names and how many are left out."""
    shown = ", ".join(names[:limit])
    left = len(names) - limit
    return f"{shown} and {left} more" if left > 0 else shown
