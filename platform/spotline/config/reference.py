"""The spec reference: every section and field of a job spec (and of a sweep file),
with its type, default and the docstring written under it, as Markdown.

    python -m spotline.config.reference > docs/reference/spec.md

The models are the source: this page is generated from them, never written by hand,
and a test compares the committed page with what this produces. Pure: it reads the
models and their source, and writes nothing itself.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import sys
import textwrap
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

import annotated_types as at
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

COMMAND = "python -m spotline.config.reference > docs/reference/spec.md"

_HEADER = f"""\
# Job spec reference

<!-- Generated from the pydantic models in spotline/config/ by
     `{COMMAND}`; do not edit by hand. -->

Every field of a job spec, as YAML or as the typed models in `spotline.config`, with its
type, default and meaning. A field left out takes its default. Overrides name the same
fields with dots: `--set train.steps=50`, `with_overrides({{"train.lr": 1e-3}})`.
An unknown key is refused with a did-you-mean, at any depth.
"""


@dataclass
class _Section:
    path: str
    model: type[BaseModel]
    anchor: str
    when: str = ""
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)


def attribute_docs(model: type[BaseModel]) -> dict[str, str]:
    """The string written under each field of `model` (and of the models it inherits
    from), by field name."""
    docs: dict[str, str] = {}
    for klass in reversed(model.__mro__):
        if not (isinstance(klass, type) and issubclass(klass, BaseModel)) or klass is BaseModel:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _models_in(tp: Any) -> list[type[BaseModel]]:
    """The models an annotation holds, in the order written (unions, lists, Annotated)."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [tp]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(tp):
        for m in _models_in(arg):
            if m not in found:
                found.append(m)
    return found


def _kind(model: type[BaseModel]) -> str | None:
    """The `kind` a model of a tagged union answers to."""
    f = model.model_fields.get("kind")
    if f is None:
        return None
    args = typing.get_args(f.annotation)
    if typing.get_origin(f.annotation) is Literal and len(args) == 1:
        return str(args[0])
    return None


def _is_list(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        return True
    if origin in (Union, types.UnionType, typing.Annotated):
        return any(_is_list(a) for a in typing.get_args(tp))
    return False


def _type(tp: Any, anchors: dict[type, str]) -> str:
    """A type as a YAML author reads it."""
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        name = f"{_kind(tp)} section" if _kind(tp) else "section"
        return f"[{name}](#{anchors[tp]})" if tp in anchors else name
    if isinstance(tp, type):
        return {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(
            tp.__name__, tp.__name__
        )
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return _type(args[0], anchors)
    if origin is Literal:
        return "one of " + ", ".join(f"`{json.dumps(a)}`" for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(dict.fromkeys(_type(a, anchors) for a in args))
    if origin in (list, tuple):
        return f"list of {_type(args[0], anchors)}" if args else "list"
    if origin is dict:
        return f"mapping to {_type(args[1], anchors)}" if args else "mapping"
    return str(tp)


_BOUNDS = ((at.Gt, "gt", ">"), (at.Ge, "ge", ">="), (at.Lt, "lt", "<"), (at.Le, "le", "<="))


def _constraints(info) -> str:
    out = []
    for meta in info.metadata:
        for kind, attr, sign in _BOUNDS:
            if isinstance(meta, kind):
                out.append(f"{sign} {getattr(meta, attr)}")
        if isinstance(meta, at.MinLen) and meta.min_length:
            out.append(f"at least {meta.min_length} character(s)")
        pattern = getattr(meta, "pattern", None)
        if isinstance(pattern, str):
            out.append(f"matches `{pattern}`")
    return ", ".join(out)


def _default(info, anchors: dict[type, str]) -> str:
    if info.default_factory is not None:
        value = info.default_factory()
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if isinstance(value, BaseModel):  # a section at its own defaults
        kind = _kind(type(value))
        return f"`{{kind: {kind}}}`" if kind else "`{}`"
    return f"`{json.dumps(value, default=str)}`"


def _escape(text: str) -> str:
    """Markdown for a table cell: code spans kept, everything else literal."""
    parts = re.split(r"(`[^`]*`)", " ".join(text.split()))
    out = []
    for i, part in enumerate(parts):
        if i % 2:  # a code span: only the cell separator needs care
            out.append(part.replace("|", "\\|"))
        else:
            part = re.sub(r"([\\*_\[\]|])", r"\\\1", part)
            out.append(part.replace("<", "&lt;").replace(">", "&gt;"))
    return "".join(out)


def _about(name: str, info, section: _Section) -> str:
    """What a field without a docstring of its own is: a section (its model's first
    line), or the tag of a variant."""
    if name == "kind" and section.when:
        return f"Selects this variant ({section.when})."
    inner = _models_in(info.annotation)
    if len(inner) > 1 and all(_kind(m) for m in inner):
        return "A tagged section: its `kind` picks the variant, each below."
    if inner and inner[0].__doc__:
        return inspect.cleandoc(inner[0].__doc__).split("\n\n")[0]
    return ""


def _sections(root: type[BaseModel], tag: str = "") -> list[_Section]:
    """Every model under `root`, depth first in field order, each documented once."""
    sections: list[_Section] = []
    seen: dict[type, str] = {}

    def visit(model: type[BaseModel], path: str, when: str) -> None:
        if model in seen:
            return
        words = f"{tag} {path or 'top'} {when}".lower()
        anchor = re.sub(r"[^a-z0-9]+", "-", words).strip("-")
        seen[model] = anchor
        sections.append(_Section(path, model, anchor, when))
        for name, info in model.model_fields.items():
            inner = _models_in(info.annotation)
            sub = f"{path}.{name}" if path else name
            if _is_list(info.annotation):
                sub += "[]"
            tagged = len(inner) > 1
            for m in inner:
                visit(m, sub, f"kind: {_kind(m)}" if tagged and _kind(m) else "")

    visit(root, "", "")
    for section in sections:
        docs = attribute_docs(section.model)
        for name, info in section.model.model_fields.items():
            kind = _type(info.annotation, seen)
            bounds = _constraints(info)
            about = info.description or docs.get(name, "") or _about(name, info, section)
            section.rows.append(
                (
                    f"`{name}`",
                    _escape(kind) if "](#" not in kind else kind,
                    _default(info, seen),
                    _escape(about + (f" ({bounds})" if bounds else "")),
                )
            )
    return sections


def _render(sections: list[_Section], level: str) -> list[str]:
    lines: list[str] = []
    for s in sections:
        title = (f"`{s.path}`" if s.path else "Top level") + (f" ({s.when})" if s.when else "")
        lines += ["", f"{level} {title} {{#{s.anchor}}}", ""]
        doc = inspect.getdoc(s.model) or ""
        if doc and s.model.__doc__ and s.model.__doc__ != BaseModel.__doc__:
            lines += [" ".join(p.split()) for p in doc.split("\n\n")[:1]] + [""]
        lines += ["| field | type | default | what it sets |", "|---|---|---|---|"]
        lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in s.rows]
    return lines


def render() -> str:
    """The whole reference page."""
    from spotline.config.schema import JobSpec
    from spotline.config.sweep import SweepSpec

    job = _sections(JobSpec)
    sweep = _sections(SweepSpec, "sweep")
    lines = [_HEADER.rstrip()]
    lines += ["", "## Sections", ""]
    lines += [
        f"- [{f'`{s.path}`' if s.path else 'top level'}](#{s.anchor})"
        + (f" ({s.when})" if s.when else "")
        for s in job
    ]
    lines += ["", "## Job spec"]
    lines += _render(job, "###")
    lines += [
        "",
        "## Sweep file",
        "",
        "The file `spotline sweep` reads: a base job, the search space over its dotted "
        "fields, and Ray Tune's scheduler.",
    ]
    lines += _render(sweep, "###")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
