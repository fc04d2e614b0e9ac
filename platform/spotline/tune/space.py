"""Search spaces over job fields, checked against the base job before any trial starts.

A key is a dotted field of the job spec (`train.lr`). Each key must name a field the
base job has, each value a domain's draw would give must make a valid job, and under
PBT each key must be one a resumed job may change (`RETUNABLE_FIELDS`): PBT continues
a trial from another trial's checkpoint, which only those fields may differ from.
"""

from __future__ import annotations

import difflib
from typing import Any

from spotline.config import SpecError, apply_overrides, validate_dict
from spotline.config.identity import RETUNABLE_FIELDS
from spotline.config.schema import JobSpec
from spotline.config.sweep import check_domain

# Fields a trial's job gets from the sweep, not from the space.
_SWEEP_OWNED = {"name": "the sweep names each trial's job", "checkpoint.uri": "checkpoint_uri"}
# Free-form sections: any key below them is the user's.
_OPEN_SECTIONS = ("deepspeed.", "runtime_env.", "metrics.", "tracking")


def spec_fields(spec: JobSpec) -> list[str]:
    """Every leaf field of `spec` as a dotted key (the model section of its kind)."""
    out: list[str] = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out.append(prefix)

    walk("", spec.model_dump(mode="json"))
    return sorted(out)


def check_space(
    spec: JobSpec, space: dict[str, Any], scheduler: str = "fifo", field: str = "param_space"
) -> None:
    """SpecError naming the key and the fix for the first key or value that cannot be
    searched; nothing starts before this passes."""
    if not space:
        raise SpecError(f"{field} is empty; give at least one field to search, e.g. train.lr")
    known = spec_fields(spec)
    for key, value in space.items():
        where = f"{field}.{key}"
        if not is_tune_domain(value):
            try:
                check_domain(key, value)
            except ValueError as e:
                raise SpecError(str(e).replace("param_space", field, 1)) from None
        if key in _SWEEP_OWNED:
            raise SpecError(f"{where}: {_SWEEP_OWNED[key]}; it cannot be searched")
        if key not in known and not key.startswith(_OPEN_SECTIONS):
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else " (see `spotline validate`)"
            raise SpecError(f"{where}: the job has no field {key!r}{hint}")
        if scheduler == "pbt" and key not in RETUNABLE_FIELDS:
            raise SpecError(
                f"{where}: PBT continues a trial from another trial's checkpoint, so it may "
                f"only search {', '.join(sorted(RETUNABLE_FIELDS))}; sweep {key} with "
                "scheduler.kind asha or fifo"
            )
        for sample in _corners(value):
            try:
                validate_dict(apply_overrides(spec.model_dump(mode="json"), {key: sample}), where)
            except SpecError as e:
                raise SpecError(
                    f"{where}: the value {sample!r} makes an invalid job: {e}"
                ) from None


def is_tune_domain(value: Any) -> bool:
    """A Ray Tune search object (a domain, a grid, a PBT sampler) rather than a value
    or a Spotline domain."""
    from ray.tune.search.sample import Domain

    return (
        isinstance(value, Domain)
        or callable(value)
        or (isinstance(value, dict) and "grid_search" in value)
    )


def _corners(value: Any) -> list[Any]:
    """The values that bound what a domain can draw."""
    if is_tune_domain(value):
        return _tune_corners(value)
    if isinstance(value, list):  # a PBT mutation list
        return list(value)
    if not isinstance(value, dict):
        return [value]
    kind, args = next(iter(value.items()))
    if kind in ("choice", "grid"):
        return list(args)
    lo, hi = args
    return [lo, hi - 1] if kind == "randint" else [lo, hi]


def _tune_corners(value: Any) -> list[Any]:
    from ray.tune.search.sample import Categorical, Float, Integer

    if isinstance(value, dict):
        return list(value["grid_search"])
    if isinstance(value, Categorical):
        return list(value.categories)
    if isinstance(value, Float):
        return [value.lower, value.upper]
    if isinstance(value, Integer):
        return [value.lower, value.upper - 1]
    if callable(value) and not hasattr(value, "sample"):
        return [value()]  # a PBT sampler function
    return [value.sample()]


def tune_space(space: dict[str, Any]) -> dict[str, Any]:
    """The same space as Ray Tune domains."""
    from ray import tune

    def domain(value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        kind, args = next(iter(value.items()))
        if kind == "choice":
            return tune.choice(args)
        if kind == "grid":
            return tune.grid_search(args)
        if kind == "uniform":
            return tune.uniform(*args)
        if kind == "loguniform":
            return tune.loguniform(*args)
        return tune.randint(*args)

    return {k: domain(v) for k, v in space.items()}


def pbt_mutations(space: dict[str, Any]) -> dict[str, Any]:
    """PBT's hyperparam_mutations: a list for choices, a sampler for ranges."""

    out: dict[str, Any] = {}
    for k, v in space.items():
        if isinstance(v, dict):
            kind, args = next(iter(v.items()))
            out[k] = list(args) if kind in ("choice", "grid") else tune_space({k: v})[k]
        else:
            out[k] = [v]
    return out
