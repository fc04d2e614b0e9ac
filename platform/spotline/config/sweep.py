"""The sweep spec: a base job, a search space over its fields, a scheduler and trials.

`spotline sweep configs/sweep.yaml` reads one of these; `spotline.tune.Tuner` takes the
same parts from Python. Only the shape is checked here (a leaf module: no Ray); that
each searched key is a field of the base job, and that its values make a valid job,
is checked against the job in `spotline.tune.space`, before any trial starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from spotline.config.loader import SpecError, _format_error, _read_yaml

DOMAIN_KINDS = ("choice", "grid", "uniform", "loguniform", "randint")
"""How a searched field is drawn: `{choice: [a, b]}` (random), `{grid: [a, b]}` (every
value, times num_samples), `{uniform: [lo, hi]}`, `{loguniform: [lo, hi]}`,
`{randint: [lo, hi]}` (hi excluded), or a plain value (fixed for every trial)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FifoSchedulerSpec(_Section):
    """Every trial runs to its end (trials still start as capacity allows)."""

    kind: Literal["fifo"] = "fifo"
    metric: str = "train_loss"
    """A reported figure: train_loss, eval_loss, tokens_per_s, goodput or step."""
    mode: Literal["min", "max"] = "min"
    """'min' or 'max': whether a lower or a higher metric is better."""


class AshaSchedulerSpec(_Section):
    """Asynchronous successive halving: stops the worse trials early, at rungs."""

    kind: Literal["asha"]
    metric: str = "train_loss"
    """A reported figure: train_loss, eval_loss, tokens_per_s, goodput or step."""
    mode: Literal["min", "max"] = "min"
    """'min' or 'max': whether a lower or a higher metric is better."""
    grace_period: int = Field(50, gt=0)
    """Training steps a trial runs before it may be stopped (the first rung)."""
    reduction_factor: float = Field(2.0, gt=1.0)
    """1/reduction_factor of the trials at a rung go on to the next one."""
    max_t: int | None = Field(None, gt=0)
    """Steps after which no trial goes on; None: train.steps."""


class PbtSchedulerSpec(_Section):
    """Population based training: every perturbation_interval reports, the worse
    trials go on from a better trial's committed checkpoint with mutated
    hyperparameters (only spotline.config.identity.RETUNABLE_FIELDS may be searched)."""

    kind: Literal["pbt"]
    metric: str = "train_loss"
    """A reported figure: train_loss, eval_loss, tokens_per_s, goodput or step."""
    mode: Literal["min", "max"] = "min"
    """'min' or 'max': whether a lower or a higher metric is better."""
    perturbation_interval: int = Field(100, gt=0)
    """Training steps between a trial's exploits (at most one per train.log_every)."""
    quantile_fraction: float = Field(0.25, gt=0.0, le=0.5)
    """The bottom fraction of trials that exploit the top fraction."""
    resample_probability: float = Field(0.25, ge=0.0, le=1.0)
    """Chance that a mutated value is drawn anew from the space instead of scaled."""
    synch: bool = False
    """Wait for every trial to reach an interval before any exploits."""


SchedulerSpec = Annotated[
    FifoSchedulerSpec | AshaSchedulerSpec | PbtSchedulerSpec, Field(discriminator="kind")
]


class SweepSpec(_Section):
    """A sweep: the base job, the space over its fields, and how trials are run."""

    name: str = Field("sweep", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,40}$")
    """Names the sweep's Tune experiment, and prefixes every trial's job name."""
    job: str | dict[str, Any]
    """The base job: a YAML path (relative to the sweep file) or an inline job spec."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Dotted overrides applied to the base job for every trial."""
    param_space: dict[str, Any]
    """Dotted job field -> a domain (see DOMAIN_KINDS) or a fixed value."""
    scheduler: SchedulerSpec = Field(default_factory=FifoSchedulerSpec)
    num_samples: int = Field(1, gt=0)
    """Trials drawn from the space (times the grid's size, when there is one)."""
    max_concurrent_trials: int | None = Field(None, gt=0)
    """None: as many as the cluster's devices hold at each trial's minimum
    (elastic.min_replicas x parallel.pipeline_stages workers)."""
    storage_path: str = "./spotline-runs/sweeps"
    """Where Tune keeps the sweep's state: a local directory on the head node, never
    object storage (Tune's own state holds pickles, which `--resume` loads; checkpoints
    go to checkpoint_uri, which may be s3://)."""
    checkpoint_uri: str | None = None
    """Root under which each trial commits its checkpoints (<root>/<trial id>/...); None:
    the base job's checkpoint.uri with {job} set to the sweep's name."""
    max_failures: int = Field(2, ge=-1)
    """Restarts of a trial's driver (each resumes from its last commit); -1: unlimited.
    Restarts of its workers are the job's own (failure.max_failures)."""
    seed: int | None = None
    """Seed of the search's random draws; None: a new draw each sweep."""

    @field_validator("storage_path")
    @classmethod
    def _local(cls, v: str) -> str:
        if "://" in v and not v.startswith("file://"):
            raise ValueError(
                f"storage_path {v!r}: give a local directory on the head node (Tune's state "
                "holds pickles, and Spotline loads none from object storage); put the "
                "trials' checkpoints in object storage with checkpoint_uri"
            )
        return v.removeprefix("file://")

    @model_validator(mode="before")
    @classmethod
    def _domains(cls, raw: Any) -> Any:
        space = raw.get("param_space") if isinstance(raw, dict) else None
        if not isinstance(space, dict):
            return raw
        for key, value in space.items():
            check_domain(key, value)
        return raw


def check_domain(key: str, value: Any) -> None:
    """A domain's shape: one of DOMAIN_KINDS with its arguments, or a plain value."""
    field = f"param_space.{key}"
    if not isinstance(value, dict):
        return  # a fixed value
    if len(value) != 1 or next(iter(value)) not in DOMAIN_KINDS:
        raise ValueError(
            f"{field}: {value!r} is not a domain; use one of "
            + ", ".join(f"{{{k}: [...]}}" for k in DOMAIN_KINDS)
        )
    kind, args = next(iter(value.items()))
    if not isinstance(args, list) or not args:
        raise ValueError(f"{field}.{kind}: give a non-empty list, e.g. {{{kind}: [1, 2]}}")
    if kind in ("uniform", "loguniform", "randint"):
        if len(args) != 2 or not all(isinstance(a, int | float) for a in args):
            raise ValueError(f"{field}.{kind}: give [low, high] as two numbers (got {args!r})")
        lo, hi = args
        if not lo < hi:
            raise ValueError(f"{field}.{kind}: low {lo} must be below high {hi}")
        if kind == "loguniform" and lo <= 0:
            raise ValueError(f"{field}.loguniform: low {lo} must be > 0")


def load_sweep(path: str | Path) -> tuple[SweepSpec, Path]:
    """A sweep file, validated; and the directory its relative paths are read from."""
    path = Path(path)
    raw = _read_yaml(path)
    try:
        return SweepSpec.model_validate(raw), path.parent
    except ValidationError as e:
        lines = [_format_error(err) for err in e.errors()]
        raise SpecError(f"invalid sweep spec ({path}): " + "; ".join(lines)) from None
