"""Planning: what a job will need and do, predicted from its spec before anything runs.

The one home of the memory model, step prediction, just-in-time checkpoint fit and
stage partition, for `spotline plan` and the preflight as much as for the runtime (the
partition a worker group runs at, the micro-batch times the bubble detector expects)
and the controller (re-partitions, JIT timing). Its modules, each importing only those
above it:

- `partition`: the cut arithmetic (uniform, explicit, balanced); pure, no torch;
- `memory_model`: memory per device of a stage (`StageMemoryModel`), the job's precision;
- `step`: per-stage FLOPs and micro-batch times, the predicted step, bubble and MFU;
- `checkpoint_time`: checkpoint bytes, the predicted save, the notices and whether a save fits;
- `choice`: the cut a job runs at (`choose_partition`) and is planned at;
- `plan`: `make_plan`, the `Plan` that `spotline plan` renders, its warnings.

It is arithmetic on the spec and on models counted on the meta device. It must never
start anything on the cluster, allocate a model's weights, or touch storage, and
never import train/, runtime/, controller/, checkpoint/ or backfill/: they import it.
"""
