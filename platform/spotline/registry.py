"""Named, pluggable parts: model kinds, tokenizers, datasets, notice sources and
backfill task kinds.

A spec names a part by a registered name (`aws`, `eval`) or by `module:attr` for
user code that reaches the workers through Ray's runtime_env. Built-in parts are
listed here as `module:attr` strings and imported only when first used, so this
module imports nothing from the rest of Spotline: the spec schema checks names
against it without pulling in the runtime.
"""

from __future__ import annotations

import difflib
import importlib
import re
from typing import Any

_TARGET_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def is_import_path(name: str) -> bool:
    """True for a `package.module:attr` reference to user code."""
    return bool(_TARGET_RE.match(name))


def import_object(target: str, field: str) -> Any:
    """Import `package.module:attr`; ValueError naming `field` and the fix otherwise."""
    module_name, _, attr = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"{field}: cannot import module {module_name!r} ({e}); make it importable on "
            "every node: install it, or ship it with the job's runtime_env "
            "(working_dir or py_modules)"
        ) from None
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
        "aws": "spotline.preemption.sources:AwsSource",
        "gcp": "spotline.preemption.sources:GcpSource",
        "azure": "spotline.preemption.sources:AzureSource",
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
        "text": "spotline.data.corpus:TextDataset",
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
