"""Backfill: evaluation and speculative inference in the pipeline's bubbles.

Only the spec is imported here: `spotline.spec` imports it, and the runtime
modules (pool, executor, tasks) import the spec in turn.
"""

from spotline.backfill.spec import (
    BackfillSpec,
    DraftSpec,
    EvalTaskSpec,
    SpeculativeTaskSpec,
)

__all__ = ["BackfillSpec", "DraftSpec", "EvalTaskSpec", "SpeculativeTaskSpec"]
