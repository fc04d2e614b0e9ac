"""YAML and dict loading for the job spec, with dotted `--set a.b=c` overrides.

Every failure raises `SpecError` whose message is written in the config's own
syntax (`parallel.pipeline_stages: ...`) and says how to fix it.
"""

from __future__ import annotations

import copy
import difflib
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from spotline.spec.models import JobSpec


class SpecError(ValueError):
    """A job spec that cannot run. The message names the field and the fix."""


class _SpecYamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads exponent floats without a dot (1e-3, 5E+2) as floats.

    PyYAML follows YAML 1.1, where `1e-3` is the *string* '1e-3'. Typed fields coerce it,
    but untyped ones (the `deepspeed:` section) would hand DeepSpeed a string.
    """


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
    """Build a validated `JobSpec` from a YAML path or a dict, then apply overrides."""
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
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError(f"config file {path} does not exist; check the path") from None
    except OSError as e:
        raise SpecError(f"config file {path} cannot be read: {e}") from None
    try:
        data = _yaml_load(text)
    except yaml.YAMLError as e:
        raise SpecError(f"config file {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
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
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                where = ".".join(parts[: i + 1])
                raise SpecError(f"override {dotted}: {where} is a value, not a section")
            node = nxt
        node[parts[-1]] = value
    return out


def validate_dict(raw: dict[str, Any], where: str = "<dict>") -> JobSpec:
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as e:
        lines = [_format_error(err) for err in e.errors()]
        raise SpecError(f"invalid job spec ({where}):\n  - " + "\n  - ".join(lines)) from None


def _format_error(err: dict[str, Any]) -> str:
    loc = [str(p) for p in err.get("loc", ())]
    path = ".".join(loc) or "<top>"
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        parent = _model_at(JobSpec, loc[:-1])
        section = ".".join(loc[:-1]) or "the top level"
        msg = f"unknown field {loc[-1]!r} in {section}"
        if parent is not None:
            names = list(parent.model_fields)
            close = difflib.get_close_matches(loc[-1], names, n=1, cutoff=0.5)
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
    suffix = "" if isinstance(got, dict) else f" (got {got!r})"
    return f"{path}: {msg}{suffix}"


def _model_at(model: type[BaseModel], loc: list[str]) -> type[BaseModel] | None:
    for part in loc:
        field = model.model_fields.get(part)
        if field is None:
            return None
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            return None
    return model
