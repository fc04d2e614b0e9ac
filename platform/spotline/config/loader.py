"""YAML and dict loading for the job spec, with dotted `--set a.b=c` overrides.

Every failure raises `SpecError` whose message is written in the config's own
syntax (`parallel.pipeline_stages: ...`) and says how to fix it.
"""

from __future__ import annotations

import copy
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from spotline.config.redact import is_secret_key, is_secret_path, redact, register_secrets
from spotline.config.schema import JobSpec


class SpecError(ValueError):
    """A job spec that cannot run. The message names the field and the fix."""


class _DuplicateKey(yaml.YAMLError):
    pass


class _SpecYamlLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys, and reads exponent floats without a dot
    (1e-3, 5E+2) as floats.

    PyYAML keeps the last of two equal keys, so `steps: 10` then `steps: 100000` would
    train 100,000 steps, and a second `train:` section would silently replace the first.
    PyYAML follows YAML 1.1, where `1e-3` is the *string* '1e-3'. Typed fields coerce it,
    but untyped ones (the `deepspeed:` section) would hand DeepSpeed a string.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: PyYAML reports it below
                continue
            if first is not None:
                raise _DuplicateKey(f"duplicate key {key!r} at line {line} (first at line {first})")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


_SpecYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_SpecYamlLoader)  # noqa: S506 - a SafeLoader subclass


def load_spec(
    source: str | Path | dict[str, Any] | None = None,
    overrides: dict[str, Any] | list[str] | None = None,
) -> JobSpec:
    """Build a validated `JobSpec` from a YAML path or a dict, then apply overrides; its
    secrets are registered for redaction (see `register_spec_secrets`)."""
    if source is None:
        raw: dict[str, Any] = {}
        where = "<defaults>"
    elif isinstance(source, dict):
        raw = copy.deepcopy(source)
        where = "<dict>"
    else:
        raw = _read_yaml(Path(source))
        where = str(source)
    raw = apply_overrides(raw, overrides or {})
    return validate_dict(raw, where)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise SpecError(f"config file {path} does not exist; check the path") from None
    except IsADirectoryError:
        raise SpecError(f"config file {path} is a directory; give a YAML file") from None
    except UnicodeDecodeError as e:
        raise SpecError(
            f"config file {path} is not UTF-8 text (byte {e.start} cannot be decoded); "
            "save it as UTF-8"
        ) from None
    except OSError as e:
        raise SpecError(f"config file {path} cannot be read: {e.strerror or e}") from None
    try:
        data = _yaml_load(text)
    except _DuplicateKey as e:
        raise SpecError(f"config file {path}: {e}; keep one of them") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" line {mark.line + 1}" if mark is not None else ""
        what = " ".join(str(x) for x in (e.context, e.problem) if x)
        raise SpecError(f"config file {path}{where} is not valid YAML: {what}") from None
    except yaml.YAMLError as e:
        raise SpecError(f"config file {path} is not valid YAML: {e}") from None
    if data is None:
        raise SpecError(
            f"config file {path} is empty; give at least the job's name and sections "
            "(see configs/quickstart.yaml)"
        )
    if not isinstance(data, dict):
        raise SpecError(
            f"config file {path} must hold a mapping at the top (got {type(data).__name__})"
        )
    return data


def parse_override_list(items: list[str]) -> dict[str, Any]:
    """Turn ['a.b=1', 'c=x'] into {'a.b': 1, 'c': 'x'}, values parsed as YAML scalars."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise SpecError(f"override {item!r} must look like key.path=value, e.g. train.steps=50")
        key, _, value = item.partition("=")
        key = key.strip()
        if not key:
            raise SpecError(f"override {item!r} has an empty key; use e.g. train.steps=50")
        try:
            out[key] = _yaml_load(value) if value.strip() else ""
        except yaml.YAMLError:
            out[key] = value
    return out


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any] | list[str]) -> dict[str, Any]:
    """Set dotted keys in a nested dict (a copy); unknown keys are caught by validation."""
    if isinstance(overrides, list):
        overrides = parse_override_list(overrides)
    out = copy.deepcopy(raw)
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        node = out
        for i, part in enumerate(parts[:-1]):
            nxt = node.get(part)
            if not isinstance(nxt, dict) and (nxt is not None or _is_value(parts[: i + 1])):
                where = ".".join(parts[: i + 1])
                raise SpecError(
                    f"override {dotted}: {where} is a value, not a section; set it "
                    f"directly, e.g. --set {where}=VALUE"
                )
            if nxt is None:
                nxt = node[part] = {}
            node = nxt
        node[parts[-1]] = value
    return out


def _is_value(path: list[str]) -> bool:
    """True when the spec field at `path` holds a plain value (a number, a string, a
    choice), not a section; False when it is a section or not known."""
    ann: Any = JobSpec
    for part in path:
        ann = _step(ann, part)
        if ann is None:
            return False
    ann = _unwrap(ann)
    return ann in (int, float, str, bool) or typing.get_origin(ann) is typing.Literal


def validate_dict(raw: dict[str, Any], where: str = "<dict>") -> JobSpec:
    """A validated `JobSpec` from a dict, its secrets registered for redaction (see
    `register_spec_secrets`); a spec that cannot run raises SpecError."""
    try:
        spec = JobSpec.model_validate(raw)
    except ValidationError as e:
        lines = [_format_error(err) for err in e.errors()]
        raise SpecError(f"invalid job spec ({where}): " + "; ".join(lines)) from None
    return register_spec_secrets(spec)


def register_spec_secrets(spec: JobSpec) -> JobSpec:
    """Remember `spec`'s secret values in this process, so that free text echoing one
    (a client library's error that repeats its arguments) is masked; returns `spec`.

    The whole spec: a custom model's config, a tracker URI or runtime_env may carry
    credentials as much as storage_options do. Validation itself has no side effect;
    this is the explicit step of loading a spec to run it, which `load_spec` and
    `validate_dict` take, and so do `spotline.Job` and an actor opening its spec.
    """
    register_secrets(spec.model_dump())
    return spec


def _format_error(err: dict[str, Any]) -> str:
    raw_loc = list(err.get("loc", ()))
    loc = _without_tags(raw_loc)
    path = _dotted(loc)
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        parent = _model_at(JobSpec, raw_loc[:-1])
        section = _dotted(loc[:-1]) or "the top level"
        source = getattr(parent, "credentials_env", None)
        if source is not None and is_secret_key(loc[-1]):
            # A section that takes no credentials says where they come from instead.
            return (
                f"{path}: credentials are never read from the spec; remove {loc[-1]!r} "
                f"and use {source}"
            )
        msg = f"unknown field {loc[-1]!r} in {section}"
        if parent is not None:
            names = list(parent.model_fields)
            close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.5)
            msg += (
                f"; did you mean {close[0]!r}?" if close else f"; valid fields: {', '.join(names)}"
            )
        return msg
    msg = err.get("msg", "invalid")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
        # Cross-field messages already name their fields (model.d_model ...): no prefix.
        return msg if not loc or re.match(rf"{re.escape(path)}\b", msg) else f"{path}: {msg}"
    got = err.get("input")
    shown = "***" if is_secret_path(loc) else redact(got)
    suffix = "" if isinstance(got, dict) else f" (got {shown!r})"
    return f"{path}: {msg}{suffix}"


def _dotted(loc: list[Any]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _without_tags(loc: list[Any]) -> list[Any]:
    """The location as the config spells it: pydantic puts a tagged union's tag (the
    `kind`) into the location (model.gpt.d_model); the YAML has no such level."""
    out: list[Any] = []
    ann: Any = JobSpec
    for part in loc:
        ann = _unwrap(ann)
        if typing.get_origin(ann) in (typing.Union, types.UnionType):
            member = _union_member(typing.get_args(ann), part)
            if member is not None:
                ann = member
                continue  # the tag: not shown
        out.append(part)
        ann = _step(ann, part)
    return out


def _step(ann: Any, part: Any) -> Any:
    """The annotation one level below `ann` at `part` (None when unknown)."""
    ann = _unwrap(ann)
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        field = ann.model_fields.get(str(part))
        return None if field is None else field.annotation
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin in (list, tuple, set) and isinstance(part, int) and args:
        return args[0]
    if origin is dict and len(args) == 2:
        return args[1]
    return None


def _model_at(model: type[BaseModel], loc: list[Any]) -> type[BaseModel] | None:
    """The section model at `loc` (pydantic's location, tags included), through nested
    sections, list items and tagged unions."""
    ann: Any = model
    for part in loc:
        ann = _unwrap(ann)
        if typing.get_origin(ann) in (typing.Union, types.UnionType):
            ann = _union_member(typing.get_args(ann), part)  # the tag picks the member
            if ann is None:
                return None
            continue
        ann = _step(ann, part)
        if ann is None:
            return None
    ann = _unwrap(ann)
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(ann) if isinstance(a, type)]
        ann = models[0] if len(models) == 1 else None
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _unwrap(ann: Any) -> Any:
    """Strip Annotated[...] and Optional (X | None) down to the type inside."""
    while True:
        if typing.get_origin(ann) is typing.Annotated:
            ann = typing.get_args(ann)[0]
            continue
        if typing.get_origin(ann) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(ann) if a is not type(None)]
            if len(args) == 1:
                ann = args[0]
                continue
        return ann


def _union_member(members: tuple[Any, ...], tag: Any) -> Any:
    """The member of a tagged union whose `kind` literal is `tag`."""
    for m in members:
        m = _unwrap(m)
        if isinstance(m, type) and issubclass(m, BaseModel):
            kind = m.model_fields.get("kind")
            if kind is not None and tag in typing.get_args(kind.annotation):
                return m
    return None
