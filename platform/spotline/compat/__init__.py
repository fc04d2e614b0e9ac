"""The only code touching private names of torch, Ray and DeepSpeed.

One module per library (`torch`, `ray`, `deepspeed`), one function per need, each name
looked up when the module is imported: a version bump that moves one fails there, in
one line naming the library, its version and the pin, rather than deep inside a
failure path. `Pinned` is how each module looks its names up.

Never here: logic of Spotline's own, or a Spotline import from outside this room. A
function does what its private name does, no more.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any


class Pinned:
    """The installed version of one library, and the lookups of its private names.

    `module` and `attribute` find what they name now; `defined` reads a module's source
    without running it, for names that only exist once an object is built (an instance
    attribute, a parameter's mapping) or in a subpackage too slow to import with every
    importer of the seam (Ray Data, Ray Tune: about a second each)."""

    def __init__(self, library: str, version: str, pin: str) -> None:
        self.library, self.version, self.pin = library, version, pin

    def missing(self, what: str) -> ImportError:
        return ImportError(
            f"{self.library} {self.version} has no {what}, which Spotline needs; install the "
            f"pinned {self.pin} (pyproject.toml)"
        )

    def module(self, name: str, *names: str) -> ModuleType:
        """The module `name`, checked to hold each of `names` (dotted: `Class.method`).
        A seam calls through the module at each use, so a patch of the library's own
        module (a test's) reaches the seam too."""
        try:
            found = importlib.import_module(name)
        except ImportError:
            raise self.missing(f"module {name}") from None
        for dotted in names:
            self.attribute(found, dotted)
        return found

    def attribute(self, owner: Any, dotted: str) -> Any:
        """`owner.<dotted>`; `owner` a module, a class or a module's name."""
        found = self.module(owner) if isinstance(owner, str) else owner
        for part in dotted.split("."):
            found = getattr(found, part, _MISSING)
            if found is _MISSING:
                where = owner if isinstance(owner, str) else _qualname(owner)
                raise self.missing(f"{where}.{dotted}")
        return found

    def defined(self, module: str, *names: str) -> None:
        """Check that the source of `module` defines each of `names`, without running it:
        "name" (a function, class or global of the module), "Class.member" (the class,
        and a method or attribute of that name: set in its body or on self) or ".attr"
        (an attribute set on any object). A text search, not a parse: it is read at
        every import, on every rank's start."""
        spec = importlib.util.find_spec(module.split(".")[0])
        path = Path(spec.origin).parent.joinpath(*module.split(".")[1:]) if spec else None
        path = path.with_suffix(".py") if path is not None else None
        if path is None or not path.is_file():
            raise self.missing(f"module {module}")
        text = path.read_text()
        for name in names:
            if not all(re.search(p, text, re.MULTILINE) for p in _patterns(name)):
                raise self.missing(f"{module}.{name.lstrip('.')}")


_MISSING = object()


def _qualname(obj: Any) -> str:
    return getattr(obj, "__module__", "") + "." + getattr(obj, "__qualname__", repr(obj))


def _patterns(name: str) -> list[str]:
    """What the source of a module that defines `name` (see `Pinned.defined`) matches."""
    owner, dot, attr = name.rpartition(".")
    attr = re.escape(attr)
    assign = r"\s*(?::|=(?!=))"  # `x = ...` or `x: T`, never `x == ...`
    if not dot:
        return [rf"^(?:async\s+)?(?:def|class)\s+{attr}\b|^{attr}{assign}"]
    if not owner:
        return [rf"\.{attr}{assign}"]
    member = rf"^\s+(?:async\s+)?def\s+{attr}\b|^\s+{attr}{assign}|self\.{attr}{assign}"
    return [rf"^class\s+{re.escape(owner)}\b", member]
