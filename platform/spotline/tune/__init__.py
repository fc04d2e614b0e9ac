"""Sweeps with Ray Tune whose trials are whole Spotline jobs (see `tuner`).

A trial is a job run through the SDK: this room never reaches into a trial's workers
or its controller's state."""

from spotline.tune.space import check_space
from spotline.tune.tuner import Tuner, default_concurrency, from_sweep_spec

__all__ = ["Tuner", "check_space", "default_concurrency", "from_sweep_spec"]
