"""Where each rank is, read from outside it: py-spy stacks and NCCL flight records.

A hung rank cannot answer a Ray call (a frozen process answers nothing), so its
stack is read by another process on its node: a small task pinned there (num_cpus=0)
runs `py-spy dump --nonblocking --json` on the pids of the node's ranks, in parallel.
`--nonblocking` reads the process's memory without pausing it: it works on a stopped
process and on one stuck in the kernel (a wedged driver), where attaching would wait
for ever, and it never pauses a rank that still trains; a hung rank's stack does not
move while it is read. The task also records each process's state (stopped, running,
uninterruptible) from /proc, read just before its stack.

On NCCL, where torch's flight recorder is on (TORCH_NCCL_TRACE_BUFFER_SIZE > 0), each
rank's record of its latest collectives is asked for on the rank's control thread,
which answers while its training thread is blocked in a collective: the peers of a
hung rank show which collective they wait in. The record is torch's JSON, kept as
bytes (never unpickled).

Everything is bounded by SPOTLINE_STACKS_TIMEOUT_S: what has not come back by then is
named as missing, the tasks are cancelled, and recovery goes on. This room reads
processes; it never signals, stops, resumes or ends one, and writes nothing: the
controller stores what it returns through the commit coordinator.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from spotline import constants

# The training loop's own frame (`TrainWorker.run`, function and file): the thread it
# is on trains.
_TRAINING_FRAME = ("run", "spotline/runtime/actor.py")
_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "uninterruptible (in the kernel: a device or disk)",
    "T": "stopped",
    "t": "stopped by a tracer",
    "Z": "zombie",
    "X": "dead",
}
_PTRACE_FIX = (
    "py-spy needs to read the process: run the node's containers with CAP_SYS_PTRACE "
    "(docker --cap-add SYS_PTRACE, or securityContext.capabilities.add [SYS_PTRACE] on "
    "Kubernetes), or set kernel.yama.ptrace_scope=0"
)
# Frames kept per thread in a stored stack (innermost first).
_FRAMES_KEPT = 100
# Readings of a process that py-spy found torn (it moved while read) before giving up.
_READS = 3


# --- on the rank's node ------------------------------------------------------------------


def py_spy() -> str | None:
    """The py-spy that ships with ray[default]: beside this Python, else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return here if os.access(here, os.X_OK) else shutil.which("py-spy")


def process_state(pid: int) -> str:
    """The process's state in words, from /proc ('gone' when it no longer exists)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return "gone"
    code = stat.rsplit(")", 1)[-1].split()[0] if ")" in stat else "?"
    return _STATES.get(code, code)


def threads_of(dump: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """py-spy's JSON dump as threads: {"name", "frames": ["func (file:line)", ...]},
    innermost frame first."""
    out = []
    for t in dump:
        frames = [
            f"{f.get('name')} ({f.get('short_filename') or f.get('filename')}:{f.get('line')})"
            for f in t.get("frames") or []
        ]
        out.append({"name": t.get("thread_name") or str(t.get("thread_id")), "frames": frames})
    return out


def training_frame(threads: list[dict[str, Any]]) -> str | None:
    """The innermost frame of the training thread: the one whose stack holds the
    training loop; else the main thread's; None when there is no stack."""
    name, path = _TRAINING_FRAME
    for t in threads:
        # py-spy names a method with its class (`TrainWorker.run`).
        if any(f.split(" (")[0].split(".")[-1] == name and path in f for f in t["frames"]):
            return t["frames"][0]
    for t in threads:
        if t["name"] == "MainThread" and t["frames"]:
            return t["frames"][0]
    return None


def dump_pid(pid: int, timeout_s: float) -> dict[str, Any]:
    """One process's state and stack (py-spy, without pausing it); an `error` instead of
    the stack when it could not be read. A process that moves while it is read can
    give a torn reading, which py-spy refuses: it is read again, up to _READS times."""
    state = process_state(pid)
    out: dict[str, Any] = {"pid": pid, "state": state, "threads": [], "frame": None}
    out["error"] = None
    exe = py_spy()
    if exe is None:
        out["error"] = "py-spy is not installed on this node (it ships with ray[default])"
        return out
    if state == "gone":
        out["error"] = "the process is gone"
        return out
    cmd = [exe, "dump", "--pid", str(pid), "--nonblocking", "--json"]
    deadline = time.monotonic() + timeout_s
    for _ in range(_READS):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            out["error"] = f"py-spy gave no answer within {timeout_s:.0f}s"
            return out
        if done.returncode == 0:
            try:
                threads = threads_of(json.loads(done.stdout))
            except ValueError:
                out["error"] = "py-spy's output was not JSON"
                return out
            out["frame"] = training_frame(threads)
            for t in threads:
                t["frames"] = t["frames"][:_FRAMES_KEPT]
            out["threads"], out["error"] = threads, None
            return out
        why = (done.stderr or done.stdout).strip().splitlines()
        first = next((w for w in why if w.strip() and not w.startswith("Process ")), "")
        denied = "permission" in done.stderr.lower() or "operation not permitted" in done.stderr
        out["error"] = f"py-spy failed: {first.strip()}" + (f". {_PTRACE_FIX}" if denied else "")
        if denied:
            return out
    return out


def dump_node(pids: dict[int, int], timeout_s: float) -> dict[int, dict[str, Any]]:
    """rank -> `dump_pid` of its pid, for the ranks of one node, read in parallel."""
    if not pids:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(pids))) as pool:
        futures = {rank: pool.submit(dump_pid, pid, timeout_s) for rank, pid in pids.items()}
        return {rank: f.result() for rank, f in futures.items()}


# --- in the rank's process (NCCL flight recorder) -------------------------------------------


def flight_recorder_on(env: dict[str, str] | None = None) -> bool:
    """Torch records each NCCL collective when TORCH_NCCL_TRACE_BUFFER_SIZE (or its newer
    name TORCH_FR_BUFFER_SIZE) is above 0."""
    env = os.environ if env is None else env
    for name in ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"):
        try:
            if int(env.get(name, "0") or 0) > 0:
                return True
        except ValueError:
            continue
    return False


def _torch_dump() -> bytes:
    """Torch's flight-recorder dump as JSON."""
    from spotline.compat.torch import flight_record_json

    return flight_record_json()


def flight_record(dump=_torch_dump, env: dict[str, str] | None = None) -> dict[str, Any]:
    """This process's flight record: {"json": bytes} when the recorder is on, else
    {"off": why}; {"error": why} when the dump failed. Runs in the rank's process."""
    if not flight_recorder_on(env):
        return {"off": "TORCH_NCCL_TRACE_BUFFER_SIZE is not set above 0"}
    try:
        return {"json": dump()}
    except Exception as e:  # noqa: BLE001 - evidence is best effort, never a failure
        return {"error": f"{type(e).__name__}: {e}"}


def _rank_flight_record(worker: Any) -> dict[str, Any]:
    """Runs on a rank's actor (`compat.ray.call_on_actor`): its flight record."""
    return flight_record()


# --- from the controller -------------------------------------------------------------------


def _dump_on_node(pids: dict[int, int], timeout_s: float) -> dict[int, dict[str, Any]]:
    return dump_node(pids, timeout_s)


def summarise(record: dict[str, Any], named: list[int]) -> dict[str, dict[str, Any]]:
    """rank -> {"frame", "state", "node", "error"} of the `named` ranks (all ranks when
    none is named): what status and report show."""
    ranks = record.get("ranks") or {}
    keys = [str(r) for r in named] if named else sorted(ranks, key=int)
    out = {}
    for key in keys:
        r = ranks.get(key) or {}
        out[key] = {
            "frame": r.get("frame"),
            "state": r.get("state"),
            "node": r.get("node"),
            "error": r.get("error") or (None if r else "no stack came back"),
        }
    return out


class RayStacks:
    """Takes a live group's stacks (and NCCL flight records) through Ray."""

    def take(
        self, group: Any, ranks: list[int] | None = None, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """{"taken_at", "ranks": {rank: {"node", "pid", "state", "frame", "threads",
        "error"}}, "flight": {rank: {"json" | "off" | "error"}}} for `ranks` of `group`
        (None: every rank), within `timeout_s` (SPOTLINE_STACKS_TIMEOUT_S) in all."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        timeout_s = constants.SPOTLINE_STACKS_TIMEOUT_S if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        infos = {i["rank"]: i for i in group.worker_info()}
        wanted = sorted(infos) if ranks is None else [r for r in ranks if r in infos]
        by_node: dict[str, dict[int, int]] = {}
        for r in wanted:
            by_node.setdefault(infos[r]["node_id"], {})[r] = int(infos[r]["pid"])
        task = ray.remote(_dump_on_node)
        refs = {
            task.options(
                num_cpus=0,
                max_retries=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
            ).remote(pids, max(1.0, timeout_s - 2.0)): node
            for node, pids in by_node.items()
        }
        flights = self._ask_flight_records(group, wanted)
        out: dict[str, Any] = {"taken_at": time.time(), "ranks": {}, "flight": {}}
        answers = self._gather(list(refs) + list(flights), deadline, timeout_s)
        for ref, node in refs.items():
            got = answers.get(ref)
            for r, pid in by_node[node].items():
                if isinstance(got, dict) and r in got:
                    out["ranks"][str(r)] = {"rank": r, "node": node, **got[r]}
                else:
                    why = got if isinstance(got, str) else "no answer from its node"
                    out["ranks"][str(r)] = {
                        "rank": r,
                        "node": node,
                        "pid": pid,
                        "state": None,
                        "threads": [],
                        "error": why,
                    }
        for ref, r in flights.items():
            got = answers.get(ref)
            out["flight"][str(r)] = got if isinstance(got, dict) else {"error": got or "none"}
        return out

    @staticmethod
    def _ask_flight_records(group: Any, ranks: list[int]) -> dict[Any, int]:
        """On NCCL: each rank's flight record, asked on its control thread."""
        actors = getattr(group, "actors", None) or []
        if getattr(group, "device", "") != "gpu" or not actors:
            return {}
        from spotline.compat.ray import call_on_actor

        out = {}
        for r in ranks:
            if r < len(actors) and actors[r] is not None:
                ref = call_on_actor(actors[r], _rank_flight_record, concurrency_group="control")
                out[ref] = r
        return out

    @staticmethod
    def _gather(refs: list[Any], deadline: float, timeout_s: float) -> dict[Any, Any]:
        """Each ref's value, or why there is none, by `deadline`; the late ones are
        cancelled so that nothing outlives the bound."""
        import ray

        out: dict[Any, Any] = {}
        pending = list(refs)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=left)
            for ref in ready:
                try:
                    out[ref] = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - named as missing, never raised
                    out[ref] = f"{type(e).__name__}: {e}"
            if not ready:
                break
        for ref in pending:
            out[ref] = f"no answer within {timeout_s:.0f}s (SPOTLINE_STACKS_TIMEOUT_S)"
            try:
                ray.cancel(ref, force=True)
            except Exception:  # noqa: BLE001 - an actor call cannot be force-cancelled
                with contextlib.suppress(Exception):
                    ray.cancel(ref)
        return out
