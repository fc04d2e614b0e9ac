"""Every timeout and interval Spotline uses, in one place.

Each one can be overridden by an environment variable of the same name, so
tests can shrink them and operators can stretch them without a code change.
"""

from __future__ import annotations

import os


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError as e:
        raise ValueError(f"environment variable {name} must be a number (got {raw!r})") from e


# How long a worker group may take to be placed and to rendezvous before the
# start counts as a failure.
SPOTLINE_WORKER_START_TIMEOUT_S = _env_float("SPOTLINE_WORKER_START_TIMEOUT_S", 300.0)
# How long a grow that pays waits, training on, for replicas started ahead to be ready
# (`runtime/standby.py`); past it, the grow starts its own processes instead.
SPOTLINE_STANDBY_WAIT_S = _env_float("SPOTLINE_STANDBY_WAIT_S", 120.0)
# How long a JIT-compiled op's build lock (torch's extension cache, where DeepSpeed
# builds its ops on a node's first use) and everything in its build directory must be
# untouched before a starting rank takes the lock for one a killed build left, and
# removes it: a live build writes its objects as it goes, and a left lock makes every
# later start on the node wait on it forever.
SPOTLINE_STALE_BUILD_LOCK_S = _env_float("SPOTLINE_STALE_BUILD_LOCK_S", 600.0)
# How long taking the replicas started ahead waits for their ranks to answer (all at
# once): one that does not answer in time is dropped, and the next group starts its own
# processes in its place. A live idle rank answers in milliseconds, a dead one at once.
SPOTLINE_STANDBY_CHECK_TIMEOUT_S = _env_float("SPOTLINE_STANDBY_CHECK_TIMEOUT_S", 5.0)
# The least time without a step, in a running group, before the controller declares a
# hang (it is otherwise failure.hang_factor x the median step plus the longest save).
SPOTLINE_HANG_FLOOR_S = _env_float("SPOTLINE_HANG_FLOOR_S", 20.0)
# How long ranks may wait for their step's batches (a data stall: storage or the data
# source not answering) before the controller ends the group as a data failure; it is
# never a hang. At most 0.9 x failure.collective_timeout_s, so that the controller
# names the stall before the peers' collective timeout fires.
SPOTLINE_DATA_STALL_LIMIT_S = _env_float("SPOTLINE_DATA_STALL_LIMIT_S", 300.0)
# How long taking the ranks' stacks (py-spy, from a task on each rank's node) and NCCL
# flight records may take at a hang or on `spotline stacks`: past it, what came back
# is kept and recovery goes on.
SPOTLINE_STACKS_TIMEOUT_S = _env_float("SPOTLINE_STACKS_TIMEOUT_S", 20.0)
# A hung group of at most this many ranks has every rank's stack taken (the ranks of a
# node are read in parallel by one task there); a larger one, the named ranks' only.
SPOTLINE_STACKS_ALL_RANKS = int(_env_float("SPOTLINE_STACKS_ALL_RANKS", 64))
# A group's first steps warm up (allocation, caches, a first pass through the data): a
# peer copy's cost is read only against the steps after them, and the copy that measures
# it is taken right after them.
SPOTLINE_PEER_WARM_STEPS = int(_env_float("SPOTLINE_PEER_WARM_STEPS", 10))
# How often the controller collects the ranks' progress (losses, finished uploads,
# failures). Training never waits for it; a step commits at most this long after its
# last upload finished.
SPOTLINE_POLL_INTERVAL_S = _env_float("SPOTLINE_POLL_INTERVAL_S", 0.25)
# How often the per-rank gauges (heartbeat age, compute per step, slowdown) are set:
# Prometheus scrapes every 15 s or so, and at thousands of ranks setting three gauges per
# rank at every poll cost more than the rest of the poll.
SPOTLINE_RANK_METRICS_S = _env_float("SPOTLINE_RANK_METRICS_S", 5.0)
# A CPU job's step beyond what its layers' passes and its optimizer step take on the
# host (`planning.host_step`): per micro-batch through a stage (DeepSpeed's send of its
# activation and of its gradient over gloo: 2.9 + 4.4 ms), and per step (the gradient
# all-reduce 24 ms, ZeRO-1's optimizer step beyond Adam's own 40 ms, the loss and step
# agreements 13 ms). Read off the instruction trace of the quickstart on a 2-core CPU node
# (benchmarks/README.md, "Step time").
SPOTLINE_PIPE_PASS_OVERHEAD_S = _env_float("SPOTLINE_PIPE_PASS_OVERHEAD_S", 0.007)
SPOTLINE_STEP_OVERHEAD_S = _env_float("SPOTLINE_STEP_OVERHEAD_S", 0.075)
# How long the final flush of background uploads may take at the end of a job.
SPOTLINE_UPLOAD_FLUSH_TIMEOUT_S = _env_float("SPOTLINE_UPLOAD_FLUSH_TIMEOUT_S", 1800.0)
# How long a storage URI check may take before it counts as unreachable.
SPOTLINE_STORAGE_CHECK_TIMEOUT_S = _env_float("SPOTLINE_STORAGE_CHECK_TIMEOUT_S", 20.0)
# Attempts of one storage call (upload, receipt, ranged read) before its error is
# reported; the waits between them grow exponentially, with jitter.
SPOTLINE_STORAGE_RETRIES = int(_env_float("SPOTLINE_STORAGE_RETRIES", 5))
# How long the driver waits for a TCP answer from a Ray cluster's address before it
# calls the cluster unreachable (Ray itself retries a dead address for minutes).
SPOTLINE_RAY_CONNECT_TIMEOUT_S = _env_float("SPOTLINE_RAY_CONNECT_TIMEOUT_S", 10.0)
# How long the driver waits between two status polls of the controller.
SPOTLINE_DRIVER_POLL_S = _env_float("SPOTLINE_DRIVER_POLL_S", 1.0)
# After SIGTERM or Ctrl-C, how long `spotline run` waits for its job to stop at the next
# step boundary with a commit there before it ends the job at once. Below the 30 s
# Kubernetes gives a pod by default (terminationGracePeriodSeconds) before SIGKILL, so
# the driver ends by itself and says what was committed; a job whose step plus save
# takes longer needs both raised together. `ray job stop` kills the driver
# RAY_JOB_STOP_WAIT_TIME_S (3 s by default) after its SIGTERM: set that on the head
# above this (infra/kuberay/raycluster.yaml does).
SPOTLINE_DRIVER_STOP_GRACE_S = _env_float("SPOTLINE_DRIVER_STOP_GRACE_S", 25.0)

# Timeout of one metadata HTTP request (and of the TCP probe of a GCS address). Metadata
# services answer in milliseconds; a longer wait only delays the other sources.
SPOTLINE_NOTICE_HTTP_TIMEOUT_S = _env_float("SPOTLINE_NOTICE_HTTP_TIMEOUT_S", 0.5)
# Lifetime asked for an AWS IMDSv2 session token (1 s .. 6 h). The token is reused until
# it nearly expires, so a poll normally costs one GET.
SPOTLINE_AWS_IMDS_TOKEN_TTL_S = _env_float("SPOTLINE_AWS_IMDS_TOKEN_TTL_S", 21600.0)
# Timeout of one GetDrainingNodes RPC to the GCS.
SPOTLINE_RAY_DRAIN_RPC_TIMEOUT_S = _env_float("SPOTLINE_RAY_DRAIN_RPC_TIMEOUT_S", 2.0)
# How long a node watcher waits for the controller to acknowledge a notice before it
# sends it again.
SPOTLINE_NOTICE_ACK_TIMEOUT_S = _env_float("SPOTLINE_NOTICE_ACK_TIMEOUT_S", 2.0)
# How long stop() waits for the polling thread to finish its current poll.
SPOTLINE_NOTICE_WATCHER_STOP_TIMEOUT_S = _env_float("SPOTLINE_NOTICE_WATCHER_STOP_TIMEOUT_S", 5.0)
# After a worker process dies (and its peers had a second to fail too), how long the
# controller keeps checking whether the worker's node is gone: a lost node is a spot
# preemption and does not use up failure.max_failures. A node whose raylet is gone
# answers no connection, so it is seen at the first check; the wait covers a node whose
# processes die a moment before its raylet.
SPOTLINE_NODE_LOSS_WAIT_S = _env_float("SPOTLINE_NODE_LOSS_WAIT_S", 1.0)
# How long a rank's abort of its communicators (an NCCL abort, a gloo cut) may take
# before the rank reports it hung (`spotline.train.comms`): the abort stays stuck on a
# thread of its own, the process is never kept, and the controller cordons its node.
# A healthy NCCL abort takes a second or a few (one per communicator, grouped).
SPOTLINE_COMM_ABORT_TIMEOUT_S = _env_float("SPOTLINE_COMM_ABORT_TIMEOUT_S", 30.0)
# The same for the destroy of a surviving rank's old process group when it re-forms
# (recovery.in_place): past it, the re-form fails, and the node is cordoned.
SPOTLINE_COMM_DESTROY_TIMEOUT_S = _env_float("SPOTLINE_COMM_DESTROY_TIMEOUT_S", 30.0)
# How long a restart with recovery.in_place waits for a surviving rank's training to
# end before it ends the rank's replica too, when recovery.reform_grace_s is not set, by
# backend. A gloo cut is a socket shutdown: peers fail within moments. An NCCL abort
# often takes seconds, and a hung one is reported at SPOTLINE_COMM_ABORT_TIMEOUT_S: the
# NCCL grace is above it, so that a restart learns that an abort hung (and cordons the
# node) rather than taking the rank for one still in its step. The wait ends as soon as
# every surviving rank is free.
SPOTLINE_REFORM_GRACE_GLOO_S = _env_float("SPOTLINE_REFORM_GRACE_GLOO_S", 2.0)
SPOTLINE_REFORM_GRACE_NCCL_S = _env_float("SPOTLINE_REFORM_GRACE_NCCL_S", 40.0)
# After a group is torn down, how long the controller waits for its devices to show as
# free again before sizing the next group from what it sees (Ray frees them a moment
# after the actors die).
SPOTLINE_CAPACITY_SETTLE_S = _env_float("SPOTLINE_CAPACITY_SETTLE_S", 10.0)
# The job's resource request to the autoscaler lapses this long after its last refresh
# (a controller that dies without withdrawing it stops holding nodes up), and is
# refreshed this often while the job runs or waits.
SPOTLINE_DEMAND_EXPIRE_S = _env_float("SPOTLINE_DEMAND_EXPIRE_S", 180.0)
SPOTLINE_DEMAND_REFRESH_S = _env_float("SPOTLINE_DEMAND_REFRESH_S", 20.0)
# Timeout of one call to Ray's autoscaling coordinator.
SPOTLINE_DEMAND_RPC_TIMEOUT_S = _env_float("SPOTLINE_DEMAND_RPC_TIMEOUT_S", 5.0)
# Margin a just-in-time checkpoint keeps before a notice's deadline.
SPOTLINE_JIT_MARGIN_S = _env_float("SPOTLINE_JIT_MARGIN_S", 10.0)
# Save throughput assumed for a just-in-time checkpoint before the job has measured its
# own (host copy + serialization + upload), in MB/s per rank.
SPOTLINE_ASSUMED_SAVE_MB_PER_S = _env_float("SPOTLINE_ASSUMED_SAVE_MB_PER_S", 50.0)

# A pipeline wait shorter than this (predicted) does not wake the stage's backfill
# executor: waking it costs more than the work it could do.
SPOTLINE_BACKFILL_MIN_WINDOW_S = _env_float("SPOTLINE_BACKFILL_MIN_WINDOW_S", 0.002)
# Pin rank r's worker and its backfill executor to CPU core r (benchmarks on CPU,
# where a core stands in for a device). Off by default.
SPOTLINE_PIN_CORES = _env_float("SPOTLINE_PIN_CORES", 0.0) > 0

# Updates (a batch of figures, an event) one experiment tracker may have waiting; past
# that a slow tracker's updates are dropped (and counted), never waited for.
SPOTLINE_TRACKER_QUEUE_SIZE = int(_env_float("SPOTLINE_TRACKER_QUEUE_SIZE", 1000))
# How long the end of a job waits for the trackers to write what they still hold and
# close their runs (a tracker server that does not answer must not hold the job's end).
SPOTLINE_TRACKER_CLOSE_TIMEOUT_S = _env_float("SPOTLINE_TRACKER_CLOSE_TIMEOUT_S", 30.0)

# `spotline chaos`: how often the driver reads the job's status (the timeline's
# resolution), and how long a job may take to train its first step before the
# rehearsal gives up on it.
SPOTLINE_CHAOS_POLL_S = _env_float("SPOTLINE_CHAOS_POLL_S", 0.2)
SPOTLINE_CHAOS_START_TIMEOUT_S = _env_float("SPOTLINE_CHAOS_START_TIMEOUT_S", 900.0)
# How long the rehearsal's trace waits, after the job's first step, for the job to run
# every rank the cluster holds for it (a start that fell back to fewer replicas grows
# back first); past it the trace starts anyway, and says so.
SPOTLINE_CHAOS_FULL_SIZE_WAIT_S = _env_float("SPOTLINE_CHAOS_FULL_SIZE_WAIT_S", 60.0)
# A running job's lease on its checkpoint root (`spotline.checkpoint.lease`): renewed
# this often, on a thread beside the controller's loop, and taken for a dead job's this
# long after its last renewal, so that a second job started on the same checkpoint.uri
# is refused while the first runs, and a rerun after a crash is not kept waiting long.
SPOTLINE_LEASE_RENEW_S = _env_float("SPOTLINE_LEASE_RENEW_S", 10.0)
SPOTLINE_LEASE_TTL_S = _env_float("SPOTLINE_LEASE_TTL_S", 45.0)
# What a state keeper's process adds to its copies while it serves calls (arguments
# decoded, answers built): its budget counts it beside the copies (about 1 MB measured
# on the two-losses test's 5.7 MB copies).
SPOTLINE_KEEPER_HEAP_BYTES = int(_env_float("SPOTLINE_KEEPER_HEAP_BYTES", 4 * 1024**2))
