"""Backfill: evaluation and speculative inference in the pipeline's bubbles.

The `backfill:` spec section lives in `spotline.config.backfill`; the runtime parts
(pool, executor, tasks) are imported by their users, never from here.

Backfill must never slow or block training: executors run in their own processes,
only inside the windows the stages signal, and never join the job's collectives.
"""
