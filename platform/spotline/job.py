"""The Python SDK: `spotline.Job`.

job = spotline.Job.from_yaml("configs/quickstart.yaml").with_overrides({"train.steps": 50})
result = job.run()      # blocking, in this driver
handle = job.submit("http://127.0.0.1:8265")   # through Ray's job submission
"""

from __future__ import annotations

import base64
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotline import constants, job_index
from spotline.config import JobSpec, apply_overrides, load_spec
from spotline.config.loader import register_spec_secrets, validate_dict
from spotline.config.redact import install_log_redaction, split_secrets, write_secrets_package
from spotline.job_outcome import JobFailed, JobResult, StopTimedOut, resume_hint
from spotline.planning.plan import Plan, time_cpu_step_here
from spotline.runtime.cluster import connect_ray


class JobRun:
    """A job running under its controller actor; poll it or wait for it."""

    def __init__(self, spec: JobSpec, controller: Any):
        self.spec = spec
        self.controller = controller
        self._next_event = 0
        self._stop: tuple[str, float | None] | None = None  # asked: (reason, grace)
        self._stop_by: float | None = None  # sent: the end of its grace
        self._stop_sent = False
        self.latest_commit: int | None = None
        """The newest step this run committed, as far as the driver has seen."""
        self._done = controller.run.remote()  # the job runs from here on

    def status(self) -> dict[str, Any]:
        import ray

        return ray.get(self.controller.status.remote(0))

    @property
    def backfill(self) -> BackfillClient:
        """Add backfill tasks while the job runs: `run.backfill.submit(task)`."""
        return BackfillClient(self.controller)

    def trace(self) -> dict[str, Any] | None:
        """Chrome-trace JSON of the latest pipeline steps (Perfetto); None for pp=1."""
        import ray

        return ray.get(self.controller.trace.remote())

    def repartition(self, sizes: list[int]) -> None:
        """Re-partition the pipeline to `sizes` layers per stage (embedding and head
        included) at the next checkpoint boundary, through that checkpoint; the job
        trains on at the new bounds. Returns at once."""
        import ray

        ray.get(self.controller.repartition.remote(list(sizes)))

    def stop(self, reason: str = "stopped from the SDK", verbose: bool = False) -> JobResult:
        """Stop at the next step boundary after committing a checkpoint there.

        Submitting the same job again resumes from that checkpoint.
        """
        self.stop_soon(reason)
        return self.wait(verbose)

    def stop_soon(self, reason: str, grace_s: float | None = None) -> None:
        """Ask for a stop at the next step boundary with a commit there, and return at
        once: it only records the request, so a signal handler may call it. `wait`
        sends it, and then waits at most `grace_s` (None: as long as the stop takes)
        before it ends the job at once and raises StopTimedOut. The first request
        stands."""
        if self._stop is None:
            self._stop = (reason, grace_s)

    def resume_hint(self) -> str:
        """Where running the job again starts, from the commits this driver saw."""
        return resume_hint(self.latest_commit, seen=True)

    def wait(
        self, verbose: bool = True, out=None, expect: tuple[str, ...] = ("finished",)
    ) -> JobResult:
        """Print the job's events until it ends; its result. A job that ends in another
        state than `expect` (or "stopped", once a stop was asked) raises JobFailed."""
        import ray

        out = out or sys.stdout
        while True:
            self._send_stop()
            ready, _ = ray.wait([self._done], timeout=constants.SPOTLINE_DRIVER_POLL_S)
            self._print_events(verbose, out)
            if ready:
                break
            if self._stop_by is not None and time.monotonic() > self._stop_by:
                ray.kill(self.controller)
                reason, grace = self._stop or ("", 0.0)
                raise StopTimedOut(
                    f"the job did not stop within {grace:.0f}s of {reason} "
                    f"(SPOTLINE_DRIVER_STOP_GRACE_S) and was ended at once; {self.resume_hint()}"
                )
        result = JobResult.from_dict(ray.get(self._done))
        self._print_events(verbose, out)
        ray.kill(self.controller)
        if self._stop is not None:
            expect = (*expect, "stopped")
        if result.state not in expect:
            raise JobFailed(result.error or f"job {result.name} ended in {result.state}", result)
        return result

    def _send_stop(self) -> None:
        if self._stop is None or self._stop_sent:
            return
        reason, grace = self._stop
        self.controller.stop.remote(reason)
        self._stop_sent = True
        if grace is not None:
            self._stop_by = time.monotonic() + grace
            print(
                f"spotline: {reason}: stopping at the next step boundary with a commit, "
                f"for at most {grace:.0f}s (SPOTLINE_DRIVER_STOP_GRACE_S); a second signal "
                "ends it at once",
                file=sys.stderr,
                flush=True,
            )

    def _print_events(self, verbose: bool, out) -> None:
        import ray

        st = ray.get(self.controller.status.remote(self._next_event))
        self._next_event = st["next_event"]
        if st.get("committed_steps"):
            self.latest_commit = max(self.latest_commit or 0, *st["committed_steps"])
        if verbose:
            for line in st["events"]:
                print(f"[spotline {self.spec.name}] {line}", file=out, flush=True)


class BackfillHandle:
    """A submitted backfill task; `result()` waits for it."""

    def __init__(self, controller: Any, task_id: int):
        self.controller = controller
        self.id = task_id

    def status(self) -> dict[str, Any]:
        import ray

        record = ray.get(self.controller.backfill_record.remote(self.id))
        if record is None:
            raise KeyError(f"no backfill task {self.id} on this job")
        return record

    def result(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """The task's result dict; raises RuntimeError if it failed, TimeoutError if late."""
        deadline = time.monotonic() + timeout_s
        while True:
            rec = self.status()
            if rec["state"] == "done":
                return rec["result"]
            if rec["state"] == "failed":
                raise RuntimeError(f"backfill task {rec['name']} failed: {rec['error']}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"backfill task {rec['name']} still {rec['state']} after {timeout_s:.0f}s"
                )
            time.sleep(0.5)


class BackfillClient:
    def __init__(self, controller: Any):
        self.controller = controller

    def submit(self, task: Any, name: str | None = None, retries: int = 0) -> BackfillHandle:
        """Queue a task: an EvalTaskSpec / SpeculativeTaskSpec (or its dict), or a
        generator function `fn(ctx)` that yields after each small unit of work and
        returns a dict (see spotline.backfill.tasks). A function is shipped by value,
        so it may live in the driver script or a notebook.
        """
        import ray
        from pydantic import TypeAdapter

        from spotline.backfill.tasks import PythonTask
        from spotline.config.backfill import TaskSpec
        from spotline.preflight import resolve_prompts

        if callable(task):
            module = sys.modules.get(getattr(task, "__module__", ""), None)
            if module is not None and not module.__name__.startswith("spotline"):
                ray.cloudpickle.register_pickle_by_value(module)
            task = PythonTask(task, name or getattr(task, "__name__", "python"), retries)
        else:
            if isinstance(task, dict):
                task = TypeAdapter(TaskSpec).validate_python(task)
            if task.kind == "speculative":
                resolve_prompts(task, "task")
        task_id = ray.get(self.controller.submit_backfill.remote(task, name))
        return BackfillHandle(self.controller, task_id)


@dataclass
class SubmittedJob:
    """A job handed to Ray's job submission server."""

    submission_id: str
    address: str

    def _client(self):
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.address)

    def status(self) -> str:
        return str(self._client().get_job_status(self.submission_id))

    def logs(self) -> str:
        return self._client().get_job_logs(self.submission_id)

    def wait(self, timeout_s: float = 3600.0) -> str:
        from ray.job_submission import JobStatus

        deadline = time.monotonic() + timeout_s
        client = self._client()
        while time.monotonic() < deadline:
            st = client.get_job_status(self.submission_id)
            if st in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
                return str(st)
            time.sleep(1.0)
        raise TimeoutError(f"job {self.submission_id} still running after {timeout_s:.0f}s")


class Job:
    """A validated job spec plus the ways to run it."""

    def __init__(self, spec: JobSpec):
        self.spec = register_spec_secrets(spec)  # however it was built

    @classmethod
    def from_yaml(
        cls, path: str | Path, overrides: dict[str, Any] | list[str] | None = None
    ) -> Job:
        return cls(load_spec(path, overrides))

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], overrides: dict[str, Any] | list[str] | None = None
    ) -> Job:
        return cls(load_spec(raw, overrides))

    def with_overrides(self, overrides: dict[str, Any] | list[str]) -> Job:
        raw = apply_overrides(self.spec.model_dump(mode="json"), overrides)
        return Job(validate_dict(raw, f"{self.spec.name} with overrides"))

    def plan(
        self,
        peak_tflops: float | None = None,
        device_memory_gb: float | None = None,
        local_cluster: bool = True,
        offline: bool = False,
        storage_gbps_per_node: float | None = None,
        network_gbps_per_node: float | None = None,
    ) -> Plan:
        """Predict memory per stage, the bubble, step time and MFU, the checkpoint and its
        just-in-time save against each notice, spot recovery (peer snapshots, restores),
        the replica counts and the cost of 1B tokens, before anything starts on the
        cluster (see `spotline.planning`).

        Runs the offline checks first, so a stage that cannot fit its device is refused
        (SpecError) naming the field to change. Planning is arithmetic: it needs no
        credentials or network. A tokenizer that cannot be read (or, `offline`, is not
        read) gives way to model.vocab_size or the preset's vocabulary, and the plan
        says what that leaves unchecked. The FLOP/s per device: `peak_tflops`, else this
        machine's device (a datasheet peak on a GPU, a short matmul probe on CPU at
        resources.cpus_per_worker threads); none for a GPU job planned here without a
        GPU. `device_memory_gb` stands in for resources.device_memory_gb; the two
        bandwidths (Gbit/s) are one node's to object storage and between two nodes.
        """
        from spotline.metrics.mfu import device_peak
        from spotline.planning.memory_model import precision
        from spotline.planning.plan import make_plan
        from spotline.preflight import check_offline, device_memory_bytes, node_shape

        spec = self.spec
        if device_memory_gb is not None:
            spec = self.with_overrides({"resources.device_memory_gb": device_memory_gb}).spec
        unchecked: list[str] = []
        check_offline(spec, local_cluster, unchecked, read_tokenizer=not offline)
        rate = None
        on_host = False
        if peak_tflops is not None:
            rate = (peak_tflops * 1e12, peak_tflops * 1e12, f"{peak_tflops:g} TFLOP/s (given)")
        else:
            import torch

            if spec.resources.device != "gpu" or torch.cuda.is_available():
                threads = max(1, int(spec.resources.cpus_per_worker))
                name, peak = device_peak(precision(spec), threads)
                if peak:
                    how = "a matmul probe" if name == "cpu" else "the datasheet peak"
                    rate = (peak, peak, f"{peak / 1e12:.3g} TFLOP/s ({name}, {how})")
                # A CPU job planned where it runs: its step is measured here.
                on_host = name == "cpu" and local_cluster
        device = device_memory_bytes(spec, local_cluster)
        bandwidth = (storage_gbps_per_node, network_gbps_per_node)
        node = node_shape(spec, local_cluster)
        return make_plan(spec, device, rate, node, bandwidth, unchecked, on_host)

    def start(self, address: str | None = None, signals: Any = None) -> JobRun:
        """Preflight (before any worker starts), then start the controller actor.

        `signals` (the CLI's `Interrupts`) is told just before the controller starts
        (`starting_job()`) and as soon as its run exists (`started(run)`), so that a
        SIGTERM at any moment in between becomes the run's stop with a commit."""
        from spotline.controller.actor import start_controller
        from spotline.preflight import preflight

        install_log_redaction()
        local = address is None and not os.environ.get("RAY_ADDRESS")
        store = preflight(self.spec, local_cluster=local)
        if local:
            time_cpu_step_here(self.spec)  # one prediction in plan and run (see it)
        connect_ray(address)
        if signals is not None:
            signals.starting_job()
        run = JobRun(self.spec, start_controller(self.spec, store))
        if signals is not None:
            signals.started(run)
        job_index.record(self.spec, store.uri, address)  # `spotline status NAME` once it ends
        return run

    def run(self, address: str | None = None, verbose: bool = True) -> JobResult:
        """Run to completion in this driver; returns losses, figures and the checkpoint URI."""
        return self.start(address).wait(verbose)

    def submit(self, address: str, working_dir: str | Path | None = None) -> SubmittedJob:
        """Submit through Ray's job submission API.

        The job's runtime_env is `runtime_env.working_dir` (else `working_dir`, else the
        current directory) plus `runtime_env.py_modules`; every actor of the job inherits
        it. The entrypoint is that directory's jobs/train.py when it has one (a checkout
        of Spotline), else `python -m spotline.cli run` (Spotline installed on the cluster).
        """
        from ray.job_submission import JobSubmissionClient

        from spotline.preflight import preflight

        store = preflight(self.spec, local_cluster=False)
        # A relative file:// URI would resolve inside Ray's per-job working-dir copy. The
        # runtime_env travels as the job's own; the submitted spec needs none of its own.
        spec = self.with_overrides({"checkpoint.uri": store.uri}).spec
        runtime_env: dict[str, Any] = spec.runtime_env.ray() or {}
        runtime_env.setdefault("working_dir", os.path.abspath(working_dir or "."))
        spec.runtime_env = type(spec.runtime_env)()
        public, secrets = split_secrets(spec.model_dump(mode="json"))
        blob = base64.urlsafe_b64encode(json.dumps(public).encode()).decode()
        script = Path(runtime_env["working_dir"]) / "jobs" / "train.py"
        launcher = "python jobs/train.py" if script.is_file() else "python -m spotline.cli run"
        entrypoint = f"{launcher} --spec-b64 {blob}"
        client = JobSubmissionClient(address)
        with tempfile.TemporaryDirectory(prefix="spotline-submit-") as tmp:
            if secrets:
                # Not on the command line (`ray job list`, the dashboard and `ps` show it),
                # and not in runtime_env env_vars (Ray's runtime-env agent logs them): a
                # one-use package that Ray uploads with the job: the entrypoint reads it
                # once, and it leaves the cluster (`take_secrets_package`).
                module = write_secrets_package(Path(tmp), secrets)
                runtime_env["py_modules"] = [
                    *runtime_env.get("py_modules", []),
                    str(Path(tmp) / module),
                ]
                entrypoint += f" --secrets-module {module}"
            sid = client.submit_job(
                entrypoint=entrypoint,
                runtime_env=runtime_env,
                metadata={"spotline_job": self.spec.name},
            )
        if not store.uri.startswith("file:"):  # a path on the cluster means nothing here
            job_index.record(self.spec, store.uri, address)
        return SubmittedJob(sid, address)
