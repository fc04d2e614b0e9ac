"""`spotline.tune.Tuner`: a thin layer over `ray.tune.Tuner` whose trials are jobs.

    from ray import tune
    import spotline
    from spotline.tune import Tuner

    job = spotline.Job.from_yaml("configs/quickstart.yaml")
    grid = Tuner(
        job,
        param_space={"train.lr": tune.loguniform(1e-4, 3e-3),
                     "train.warmup_steps": tune.choice([20, 50])},
        tune_config=tune.TuneConfig(metric="train_loss", mode="min", num_samples=4,
                                    scheduler=ASHAScheduler()),
    ).fit()

Each trial is a full job (elastic, preemption-aware, checkpointed under
`<checkpoint_uri>/<trial id>/`); its driver runs on the head node and asks for no
CPU, so spot capacity is left to the workers. What every trial reports: step,
train_loss, eval_loss (when the job evaluates), tokens_per_s, goodput, replicas,
committed_step and checkpoint_uri.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from spotline.config import SpecError
from spotline.config.schema import JobSpec
from spotline.config.sweep import SweepSpec
from spotline.tune.space import check_space, is_tune_domain, pbt_mutations, tune_space

SWEEP_FILE = "spotline_sweep.json"
"""Beside Tune's experiment state: what `restore` needs to rebuild the trials' driver
(the sweep's name and checkpoint root; never the job's secrets)."""


def head_resources() -> Any:
    """The trial driver's placement: the head node, no CPU or device."""
    from ray import tune

    from spotline.compat.ray import head_node_resource

    return tune.PlacementGroupFactory([{"CPU": 0, head_node_resource(): 0.001}])


def default_concurrency(spec: JobSpec, have: dict[str, float] | None = None) -> int:
    """How many trials the cluster's resources (`have`, default: Ray's totals) hold at
    each trial's minimum size (elastic.min_replicas x parallel.pipeline_stages
    workers); at least 1."""
    import ray

    from spotline.runtime.placement import worker_bundle
    from spotline.runtime.rendezvous import decide_device

    if have is None:
        have = ray.cluster_resources()
    device = decide_device(spec.resources.device, [have])
    need: dict[str, float] = {}
    for stage in range(spec.parallel.pipeline_stages):
        for k, v in worker_bundle(spec, device, stage).items():
            need[k] = need.get(k, 0.0) + v * spec.elastic.min_replicas
    fits = [math.floor(have.get(k, 0.0) / v + 1e-9) for k, v in need.items() if v > 0]
    return max(1, min(fits, default=1))


def default_root(spec: JobSpec, sweep: str) -> str:
    """The base job's checkpoint.uri with {job} set to the sweep's name, made absolute."""
    from spotline.checkpoint import CheckpointStore

    return CheckpointStore(spec.checkpoint.uri.replace("{job}", sweep)).uri


def _is_pbt(scheduler: Any) -> bool:
    from ray.tune.schedulers import PopulationBasedTraining

    return isinstance(scheduler, PopulationBasedTraining)


class Tuner:
    """Sweep any field of a job with Ray Tune; each trial is a Spotline job."""

    def __init__(
        self,
        job: Any,
        param_space: dict[str, Any],
        tune_config: Any = None,
        run_config: Any = None,
        *,
        name: str = "sweep",
        checkpoint_uri: str | None = None,
        storage_path: str = "./spotline-runs/sweeps",
        max_failures: int = 2,
        seed: int | None = None,
        _restore_from: str | None = None,
    ):
        from ray import tune

        self.spec: JobSpec = job.spec if hasattr(job, "spec") else job
        self.param_space = dict(param_space)
        self.tune_config = tune_config or tune.TuneConfig(metric="train_loss", mode="min")
        scheduler = self.tune_config.scheduler
        kind = "pbt" if _is_pbt(scheduler) else "other"
        if _restore_from is None:  # a restored sweep was checked when it started
            check_space(self.spec, self.param_space, kind)
        if kind == "pbt":
            from spotline.compat.ray import pbt_hyperparam_mutations

            check_space(self.spec, pbt_hyperparam_mutations(scheduler), "pbt",
                        "scheduler.hyperparam_mutations")  # fmt: skip
        self.name = run_config.name if run_config is not None and run_config.name else name
        self.root = (checkpoint_uri or default_root(self.spec, self.name)).rstrip("/")
        self.run_config = run_config or tune.RunConfig(
            name=self.name,
            storage_path=os.path.abspath(storage_path),
            failure_config=tune.FailureConfig(max_failures=max_failures),
            verbose=1,
        )
        if self.run_config.name is None:
            self.run_config.name = self.name
        where = str(self.run_config.storage_path or "")
        if "://" in where and not where.startswith("file://"):
            raise SpecError(
                f"run_config.storage_path {where!r}: give a local directory on the head node "
                "(Tune's state holds pickles, and Spotline loads none from object storage); "
                "the trials' checkpoints go to checkpoint_uri, which may be s3://"
            )
        self._restore_from = _restore_from
        self.seed = seed

    def _trainable(self) -> Any:
        from ray import tune

        from spotline.tune.trial import SpotlineTrial

        # The base job travels in Ray's object store, never in Tune's files (its storage
        # options may hold credentials; the trials' config holds only the searched fields).
        base = self.spec.model_dump_json()
        trainable = tune.with_parameters(SpotlineTrial, base=base, root=self.root, sweep=self.name)
        return tune.with_resources(trainable, head_resources())

    def fit(self) -> Any:
        """Run the sweep (or go on with a restored one); Tune's ResultGrid."""
        from ray import tune

        from spotline.runtime.cluster import connect_ray

        connect_ray(None)
        if self._restore_from is not None:
            tuner = tune.Tuner.restore(
                self._restore_from, trainable=self._trainable(), resume_errored=True
            )
            return tuner.fit()
        cfg = self.tune_config
        if cfg.max_concurrent_trials is None:
            cfg.max_concurrent_trials = default_concurrency(self.spec)
        if self.seed is not None and cfg.search_alg is None:
            from ray.tune.search.basic_variant import BasicVariantGenerator

            # (Tune applies max_concurrent_trials to a Searcher only: this one takes it.)
            cfg.search_alg = BasicVariantGenerator(
                random_state=self.seed, max_concurrent=cfg.max_concurrent_trials
            )
        cfg.reuse_actors = False  # a trial's driver holds its job; never hand it on
        exp = Path(self.run_config.storage_path) / self.run_config.name
        exp.mkdir(parents=True, exist_ok=True)
        (exp / SWEEP_FILE).write_text(json.dumps({"name": self.name, "root": self.root}))
        space = {
            k: v if is_tune_domain(v) else tune_space({k: v})[k]
            for k, v in self.param_space.items()
        }
        tuner = tune.Tuner(
            self._trainable(), param_space=space, tune_config=cfg, run_config=self.run_config
        )
        return tuner.fit()

    @classmethod
    def restore(
        cls, path: str | Path, job: Any, param_space: dict[str, Any] | None = None
    ) -> Tuner:
        """Continue an interrupted sweep from its Tune experiment directory: finished
        trials stay finished, the others resume from their last commits."""
        meta_path = Path(path) / SWEEP_FILE
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError) as e:
            raise SpecError(
                f"{path} is not a Spotline sweep to resume ({SWEEP_FILE}: {e}); give the "
                "directory `spotline sweep` printed, <storage_path>/<name>"
            ) from None
        from ray import tune

        return cls(
            job,
            param_space or {},
            tune.TuneConfig(),
            name=meta["name"],
            checkpoint_uri=meta["root"],
            _restore_from=str(path),
        )


def from_sweep_spec(sweep: SweepSpec, job: Any) -> Tuner:
    """A Tuner for a sweep file (`spotline sweep`)."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining

    s = sweep.scheduler
    spec = job.spec if hasattr(job, "spec") else job
    if s.kind == "asha":
        scheduler = ASHAScheduler(
            time_attr="step",
            grace_period=s.grace_period,
            reduction_factor=s.reduction_factor,
            max_t=s.max_t or spec.train.steps,
        )
    elif s.kind == "pbt":
        check_space(spec, sweep.param_space, "pbt")
        scheduler = PopulationBasedTraining(
            time_attr="step",
            perturbation_interval=s.perturbation_interval,
            hyperparam_mutations=pbt_mutations(sweep.param_space),
            quantile_fraction=s.quantile_fraction,
            resample_probability=s.resample_probability,
            synch=s.synch,
        )
    else:
        scheduler = FIFOScheduler()
    cfg = tune.TuneConfig(
        metric=s.metric,
        mode=s.mode,
        scheduler=scheduler,
        num_samples=sweep.num_samples,
        max_concurrent_trials=sweep.max_concurrent_trials,
    )
    return Tuner(
        job,
        sweep.param_space,
        cfg,
        name=sweep.name,
        checkpoint_uri=sweep.checkpoint_uri,
        storage_path=sweep.storage_path,
        max_failures=sweep.max_failures,
        seed=sweep.seed,
    )
