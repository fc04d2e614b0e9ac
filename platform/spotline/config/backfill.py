"""The `backfill` section of a job spec: work that runs in the pipeline's bubbles.

Task kinds are a closed, named set ('eval', 'speculative'); a misspelt kind fails
when the spec loads and lists the valid ones. Arbitrary Python tasks come in
through the SDK (`JobRun.backfill.submit`), not through YAML. A prompts file is read
into the spec by the preflight (`spotline.preflight.resolve_prompts`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class EvalTaskSpec(_Section):
    """Held-out loss and perplexity of the latest committed checkpoint."""

    kind: Literal["eval"] = "eval"
    every_steps: int = Field(50, gt=0)
    """Evaluate a newly committed checkpoint when at least this many training steps have
    passed since the last evaluated one (the final checkpoint is always evaluated)."""
    batches: int | None = Field(None, gt=0)
    """Held-out batches per evaluation; None uses train.eval_batches, the same batches
    the job's final held-out loss uses."""
    retries: int = Field(2, ge=0)
    """Times a failed run is tried again before it is reported failed."""


class DraftSpec(_Section):
    """The small draft model of speculative decoding (a byte-level GPT like the target)."""

    n_layers: int = Field(1, gt=0)
    d_model: int = Field(64, gt=0)
    n_heads: int = Field(2, gt=0)
    train_steps: int = Field(500, ge=0)
    """How long the executor distils the target into the draft (in bubbles, once per
    executor) before it is first used: train_steps x 4 sequences of the job's corpus,
    each labelled by the target's forward. The executor groups them into optimizer
    steps that fit its stage's windows, so the number of optimizer steps varies, the
    sequences seen do not. 0 uses the draft as initialised or loaded."""
    path: str | None = None
    """A state_dict of a draft with this shape to start from, on every node's local
    disk: a .safetensors file, or a torch file (read with weights_only=True, so it can
    hold tensors only). None starts from random weights."""
    lr: float = Field(3e-3, gt=0.0)

    @model_validator(mode="after")
    def _heads_divide_width(self) -> DraftSpec:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"draft.d_model ({self.d_model}) must be divisible by draft.n_heads "
                f"({self.n_heads})"
            )
        return self


class SpeculativeTaskSpec(_Section):
    """Greedy draft+target speculative decoding of a list of prompts."""

    kind: Literal["speculative"] = "speculative"
    prompts: str | list[str]
    """A text file with one prompt per line (read when the job is submitted, relative to
    the working directory), or the prompts inline."""
    draft: DraftSpec = Field(default_factory=DraftSpec)
    gamma: int = Field(4, ge=1)
    """Tokens the draft proposes per verification by the target."""
    max_new_tokens: int = Field(64, gt=0)
    """Tokens generated per prompt. A prompt is clipped to its last
    (model.seq_len - max_new_tokens) bytes, so every position stays inside the context."""
    every_steps: int = Field(100, gt=0)
    """Serve the prompts again with the target of a newly committed checkpoint when at
    least this many steps have passed since the last run."""
    compare_target_only: bool = True
    """Also decode the prompts with the target alone, to report the speed-up."""
    retries: int = Field(2, ge=0)


TaskSpec = Annotated[EvalTaskSpec | SpeculativeTaskSpec, Field(discriminator="kind")]


class BackfillSpec(_Section):
    """Fill each pipeline stage's idle windows with evaluation and inference work."""

    enabled: bool = False
    """Start one backfill executor per worker, sharing the worker's device."""
    max_slowdown: float = Field(0.02, gt=0.0, lt=1.0)
    """The training step may slow by at most this fraction against the step time the
    controller measures with backfill paused."""
    tasks: list[TaskSpec] = Field(default_factory=list)
    """Tasks run on committed checkpoints as they appear."""
    baseline_steps: int = Field(10, gt=0)
    """Steps with backfill paused, at the start and at every re-baseline, to measure the
    step time that max_slowdown is relative to."""
    rebaseline_every_steps: int = Field(200, gt=0)
    """Measure the baseline again after this many steps (the step time drifts)."""
    gpu_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    """On GPUs: the share of each worker's GPU that Ray assigns to its executor (the
    worker keeps the rest). Both run on the same physical device."""
    finish_timeout_s: float = Field(300.0, ge=0.0)
    """After the last training step, tasks still queued or running may use the freed
    devices for up to this long before the job ends."""
