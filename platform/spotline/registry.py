"""Named, pluggable parts: model kinds, tokenizers, datasets, notice sources and
backfill task kinds.

A spec names a part by a registered name (`aws`, `eval`) or by `module:attr` for
user code that reaches the workers through Ray's runtime_env. Built-in parts are
listed here as `module:attr` strings and imported only when first used, so this
module imports nothing from the rest of Spotline: the spec schema checks names
against it without pulling in the runtime.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib
import os
import re
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

_TARGET_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def is_import_path(name: str) -> bool:
    """True for a `package.module:attr` reference to user code."""
    return bool(_TARGET_RE.match(name))


# --- the user's own code -------------------------------------------------------------
#
# An exception is the user's when it was raised inside code the spec names by
# `module:attr` (or code of the same top-level package, or a layer class a custom
# provider returned). Which code that is gets recorded here as it is imported, in
# every process (driver, controller, workers, executors), so each one can tell its
# own traceback apart: a frame whose module belongs to a recorded package is theirs,
# unless what failed below it is the framework's (`_FRAMEWORK`). Only what a spec names is recorded, never "whatever lies outside Spotline", so a
# bug in Spotline called from a test or a library is still called Spotline's.

_USER_CODE: dict[str, list[tuple[str, str, str]]] = {}
"""Top-level package of user code -> (module, spec field, `module:attr`) of each part
of it that a spec named."""


class UserCodeError(Exception):
    """An exception raised inside the user's own code. Not retried: a restart runs the
    same code on the same input. The message names the user's module, file and line."""

    def __init__(self, message: str, module: str = "", field: str = ""):
        self.module = module
        self.field = field
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        # Ray ships exceptions between processes: keep the fields, not only the text.
        return (UserCodeError, (str(self), self.module, self.field))


def note_user_code(module_name: str, field: str, target: str) -> None:
    """Record `module_name`'s top-level package as user code brought in by `field`."""
    top = module_name.split(".", 1)[0]
    if top and top != "spotline":
        parts = _USER_CODE.setdefault(top, [])
        # Latest last: of parts that account for code equally well, the one the spec in
        # force named most recently is the one a message names.
        with contextlib.suppress(ValueError):
            parts.remove((module_name, field, target))
        parts.append((module_name, field, target))


def _named_by(module: str, function: str) -> tuple[str, str]:
    """(field, target) of the part of the spec that best accounts for code of `module`
    running `function`: the same attribute, else the same module, else its package."""
    head = function.split(".", 1)[0]

    def score(part: tuple[str, str, str]) -> tuple[bool, bool]:
        m, _, target = part
        same = m == module
        return same and target.partition(":")[2].split(".", 1)[0] == head, same

    parts = _USER_CODE[module.split(".", 1)[0]]
    _, field, target = max(reversed(parts), key=score)  # the latest named of equals
    return field, target


_FRAMEWORK = ("spotline.", "deepspeed.", "torch.distributed.", "ray.")
"""Modules whose failure inside a call from the user's code is not the user's: a lost
peer in a collective that a ZeRO-3 hook runs within their forward, or Spotline's own
check of what their code asked for."""


def _user_frame(exc: BaseException) -> tuple[str, traceback.FrameSummary] | None:
    """(module, frame) of the innermost frame of `exc`'s traceback (its causes
    included) that runs recorded user code, when nothing of the framework failed
    below it; None otherwise."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        found = None
        for frame, lineno in traceback.walk_tb(e.__traceback__):
            module = str(frame.f_globals.get("__name__", ""))
            if module.split(".", 1)[0] in _USER_CODE:
                code = frame.f_code
                name = getattr(code, "co_qualname", code.co_name)
                found = (module, traceback.FrameSummary(code.co_filename, lineno, name))
            elif found is not None and (module + ".").startswith(_FRAMEWORK):
                return None
        if found is not None:
            return found
        # What Spotline raised `from None` hides its context: that error was handled.
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return None


def user_code_error(exc: BaseException) -> UserCodeError | None:
    """`exc` as a UserCodeError when it was raised inside the user's code, else None."""
    if isinstance(exc, UserCodeError):
        return exc
    found = _user_frame(exc)
    if found is None:
        return None
    module, frame = found
    field, target = _named_by(module, frame.name)
    text = " ".join(str(exc).split()) or "(no message)"
    return UserCodeError(
        f"error in your code, not in Spotline: {type(exc).__name__}: {text} (raised in "
        f"{module}.{frame.name}, {os.path.basename(frame.filename)} line {frame.lineno}; "
        f"{field} {target!r}); fix it there and resubmit",
        module=module,
        field=field,
    )


F = TypeVar("F", bound=Callable[..., Any])


def blames_user_code(fn: F) -> F:
    """Re-raise an exception `fn` raised inside the user's code as a UserCodeError, in
    the process whose traceback shows it (a traceback does not cross Ray)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            theirs = user_code_error(e)
            if theirs is None or theirs is e:
                raise
            raise theirs from e

    return wrapper  # type: ignore[return-value]


def import_object(target: str, field: str) -> Any:
    """Import `package.module:attr`; ValueError naming `field` and the fix otherwise, and
    UserCodeError when the module raises as it is imported."""
    module_name, _, attr = target.partition(":")
    note_user_code(module_name, field, target)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"{field}: cannot import module {module_name!r} ({e}); make it importable on "
            "every node: install it, or ship it with the job's runtime_env "
            "(working_dir or py_modules)"
        ) from None
    except Exception as e:  # SyntaxError, or whatever its top level raises
        raise user_code_error(e) or UserCodeError(
            f"error in your code, not in Spotline: importing {module_name!r} ({field} "
            f"{target!r}) raised {type(e).__name__}: {' '.join(str(e).split())}; fix the "
            "module and resubmit",
            module=module_name,
            field=field,
        ) from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(
                f"{field}: module {module_name!r} has no attribute {attr!r}; check the "
                "name after the ':'"
            ) from None
    return obj


class Registry:
    """Parts of one kind, by name. Built-ins are import paths resolved on first use."""

    def __init__(self, what: str, builtins: dict[str, str]):
        self.what = what
        self._paths = dict(builtins)
        self._loaded: dict[str, Any] = {}

    def names(self) -> list[str]:
        return sorted(set(self._paths) | set(self._loaded))

    def register(self, name: str, obj: Any) -> Any:
        """Make `obj` available as `name` (user parts, or a built-in's own module)."""
        have = self._loaded.get(name)
        if have is not None and have is not obj:
            raise ValueError(f"{self.what} {name!r} is already registered ({have!r})")
        self._loaded[name] = obj
        return obj

    def check(self, name: str, field: str = "kind") -> str:
        """Return `name` if it is registered or an import path; ValueError otherwise."""
        if name in self._paths or name in self._loaded or is_import_path(name):
            return name
        names = self.names()
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(
            f"{field}: unknown {self.what} {name!r}; {hint}valid kinds: {', '.join(names)} "
            "(or 'package.module:attr' for your own)"
        )

    def load(self, name: str, field: str = "kind") -> Any:
        """The registered part (importing a built-in or a `module:attr` on first use)."""
        self.check(name, field)
        if name not in self._loaded:
            target = self._paths.get(name, name)
            obj = import_object(target, field)
            # A built-in's module registers itself on import; keep what it registered.
            self._loaded.setdefault(name, obj)
        return self._loaded[name]


NOTICE_SOURCES = Registry(
    "notice source",
    {
        "aws": "spotline.preemption.cloud:AwsSource",
        "gcp": "spotline.preemption.cloud:GcpSource",
        "azure": "spotline.preemption.cloud:AzureSource",
        "sigterm": "spotline.preemption.sources:SigtermSource",
        "ray-drain": "spotline.preemption.sources:RayDrainSource",
    },
)
"""Where preemption notices come from (`preemption.sources[].kind`)."""

MODELS = Registry(
    "model kind",
    {
        "gpt": "spotline.models.gpt:PROVIDER",
        "llama": "spotline.models.llama:PROVIDER",
    },
)
"""Model providers (`model.kind`); `custom` names its provider in `model.provider`."""

TOKENIZERS = Registry(
    "tokenizer kind",
    {
        "byte": "spotline.data.tokenizer:ByteTokenizer",
        "huggingface": "spotline.data.tokenizer:HuggingFaceTokenizer",
    },
)
"""How text becomes tokens (`tokenizer.kind`)."""

DATASETS = Registry(
    "data kind",
    {
        "text": "spotline.data.text:TextDataset",
        "tokens": "spotline.data.tokens:TokenDataset",
    },
)
"""Where training tokens come from (`data.kind`)."""

BACKFILL_TASKS = Registry(
    "backfill task kind",
    {
        "eval": "spotline.backfill.tasks:run_eval",
        "speculative": "spotline.backfill.tasks:run_speculative",
    },
)
"""What runs in the pipeline's bubbles (`backfill.tasks[].kind`)."""
