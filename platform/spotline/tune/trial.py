"""One sweep trial: a whole Spotline job, driven from a Tune trainable on the head node.

The trainable is only the trial's driver. It starts the job's controller actor (which
places the workers, checkpoints, resizes and resumes as for any job), reads its
progress every `train.log_every` steps and reports it to Tune. Tune's checkpoint of a
trial is a reference, never the weights: a small JSON naming the committed step and the
checkpoint URI it lies under.

- ASHA stops a trial through `cleanup`: the job stops at its next step boundary with
  a commit, and its workers, placement group and backfill executors go with it.
- A PBT exploit restores a trial from another trial's reference: the trial's job then
  starts under a new URI of its own with `checkpoint.resume_from` naming the donor's
  step, and its mutated hyperparameters come from its config (`RETUNABLE_FIELDS`).
- A restored sweep (`Tuner.restore`) hands each trial its own last reference, and its
  job resumes from the newest commit under its URI.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from ray import tune

from spotline.config import apply_overrides, validate_dict
from spotline.config.redact import redact
from spotline.storage import UnsafePathError, join_under
from spotline.storage.retry import retrying

log = logging.getLogger("spotline.tune")

REFERENCE_FILE = "spotline_checkpoint.json"
POLL_S = 0.5
CONTROLLER_NAME_WAIT_S = 60.0  # a killed driver's controller takes a moment to go


class SpotlineTrial(tune.Trainable):
    """A Tune trainable that runs one Spotline job per trial."""

    def setup(self, config: dict[str, Any], base: str = "{}", root: str = "", sweep: str = ""):
        self._base = json.loads(base)
        self._root = root.rstrip("/")
        self._sweep = sweep
        self._uri = f"{self._root}/{self.trial_id}/run"
        self._resume_from: dict[str, Any] | None = None
        self._controller: Any = None
        self._done: Any = None
        self._events = 0
        self._reported_step = 0
        self._reported_commit: int | None = None
        self._commit: dict[str, Any] | None = None  # the newest commit seen: step, uri
        self._final: dict[str, Any] | None = None

    # --- Tune's checkpoint: a reference to a committed step -----------------------

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        ref = self._hold_latest() or self._commit
        body = {
            "trial": self.trial_id,
            "job": self._job_name(),
            "uri": ref["uri"] if ref else self._uri,
            "step": ref["step"] if ref else None,
        }
        with open(os.path.join(checkpoint_dir, REFERENCE_FILE), "w") as f:
            json.dump(body, f)

    def load_checkpoint(self, checkpoint_dir: str) -> None:
        with open(os.path.join(checkpoint_dir, REFERENCE_FILE)) as f:
            ref = json.load(f)
        if ref.get("trial") == self.trial_id:
            self._uri = ref["uri"]  # its own run: resume from the newest commit there
            self._resume_from = None
            return
        step = ref.get("step")
        # Another trial's step (PBT): a new run of this trial's own, started from it.
        try:
            self._uri = join_under(
                f"{self._root}/{self.trial_id}", f"from-{ref['trial']}-{step or 0:08d}"
            )
        except UnsafePathError as e:
            raise ValueError(
                f"{os.path.join(checkpoint_dir, REFERENCE_FILE)}: trial {ref['trial']!r} would "
                f"start a run outside the sweep ({e.why}); restore the sweep from an experiment "
                "directory `spotline sweep` wrote"
            ) from None
        self._resume_from = {"uri": ref["uri"], "step": step} if step else None

    # --- the job -----------------------------------------------------------------

    def _job_name(self) -> str:
        tid = self.trial_id  # unique within the sweep: never cut
        return f"{self._sweep[: 62 - len(tid)]}-{tid}"

    def _start(self) -> None:
        import ray

        from spotline.controller.actor import start_controller
        from spotline.preflight import open_store, preflight

        overrides: dict[str, Any] = {
            **self.config,
            "name": self._job_name(),
            "checkpoint.uri": self._uri,
        }
        spec = validate_dict(apply_overrides(self._base, overrides), f"trial {self.trial_id}")
        own = open_store(spec)
        if self._resume_from is not None and not own.committed_steps():
            overrides["checkpoint.resume_from"] = self._donor_step(own)
            spec = validate_dict(apply_overrides(self._base, overrides), f"trial {self.trial_id}")
        store = preflight(spec, local_cluster=False)
        self.log_every = spec.train.log_every
        # The job goes on from its newest commit (or the donor's step): the first report
        # comes log_every steps after that, once it has trained.
        start = store.committed_steps() or [
            overrides.get("checkpoint.resume_from", {}).get("step") or 0
        ]
        self._reported_step = max(start)
        self._controller = retrying(
            lambda: start_controller(spec, store),
            None,
            # The name is taken while the previous driver's controller is going away.
            lambda e: isinstance(e, RuntimeError),
            wait_s=1.0,
            within_s=CONTROLLER_NAME_WAIT_S,
        )
        self._done = self._controller.run.remote()
        print(f"trial {self.trial_id}: job {spec.name} at {redact(store.uri)}", flush=True)
        ray.get(self._controller.status.remote(0))  # up and answering

    def _donor_step(self, store: Any) -> dict[str, Any]:
        """The donor's step to start from: the one Tune's reference names, or, when its
        job's retention has deleted it since (the hold on it ended while this trial
        waited for devices), the donor's newest commit: a later state of the same run."""
        ref = dict(self._resume_from or {})
        steps = store.sibling(ref["uri"]).committed_steps()
        if ref["step"] not in steps and steps:
            print(
                f"trial {self.trial_id}: step {ref['step']} of {redact(ref['uri'])} is gone; "
                f"starting from that run's newest commit, step {steps[-1]}",
                flush=True,
            )
            ref["step"] = steps[-1]
        return ref

    def step(self) -> dict[str, Any]:
        import ray

        if self._final is not None:  # finished before: nothing more to train
            return {**self._final, "done": True}
        if self._controller is None:
            self._start()
        target = self._reported_step + self.log_every
        while True:
            ready, _ = ray.wait([self._done], timeout=POLL_S)
            status = ray.get(self._controller.status.remote(self._events))
            self._events = status["next_event"]
            for line in status["events"]:
                print(f"[{self._job_name()}] {line}", flush=True)
            if status.get("last_checkpoint"):
                self._commit = status["last_checkpoint"]
            # The last steps wait for the end of the job: its final report carries the
            # final commit and held-out loss. Every report carries a training loss (the
            # sweep's metric may be it): none goes out before the job has one.
            has_loss = status.get("train_loss") is not None
            if ready or (has_loss and target <= status["step"] < status["total_steps"]):
                break
        out = self._metrics(status)
        if ready:
            result = ray.get(self._done)
            self._release()
            if result["state"] != "finished":
                raise RuntimeError(result.get("error") or f"job ended {result['state']}")
            committed = result.get("committed_steps") or []
            if committed:
                self._commit = {"step": committed[-1], "uri": result["checkpoint_uri"]}
            out.update(step=result["steps"], committed_step=committed[-1] if committed else None)
            if result.get("final_train_loss") is not None:
                out["train_loss"] = result["final_train_loss"]
            if result.get("heldout_loss") is not None:
                out["eval_loss"] = result["heldout_loss"]
            out["finished"] = True  # trained to train.steps (a stopped trial is not)
            self._final = dict(out)
            out["done"] = True
        if out.get("committed_step") != self._reported_commit:
            self._reported_commit = out.get("committed_step")
            out["should_checkpoint"] = True  # a reference at each commit
        self._reported_step = out["step"]
        return out

    def _metrics(self, status: dict[str, Any]) -> dict[str, Any]:
        ledger = status.get("ledger") or {}
        out: dict[str, Any] = {
            "step": status["step"],
            "train_loss": status.get("train_loss"),
            "tokens_per_s": status.get("tokens_per_s"),
            "goodput": ledger.get("goodput"),
            "replicas": status.get("replicas"),
            "committed_step": self._commit["step"] if self._commit else None,
            "checkpoint_uri": self._commit["uri"] if self._commit else self._uri,
        }
        if status.get("eval"):
            out["eval_loss"] = status["eval"]["loss"]
        return {k: v for k, v in out.items() if v is not None}

    def _hold_latest(self) -> dict[str, Any] | None:
        """The newest commit, kept from the job's retention for a trial that exploits it."""
        import ray

        if self._controller is None or self._final is not None:
            return None
        try:
            return ray.get(self._controller.hold_latest.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - the job is ending: its last commit stays
            return None

    def _release(self) -> None:
        import ray

        if self._controller is not None:
            ray.kill(self._controller)
        self._controller = None

    def cleanup(self) -> None:
        """Stopped by the scheduler (or the sweep is ending): the job stops at its next
        step boundary with a commit, and everything it started goes."""
        import ray

        if self._controller is None:
            return
        try:
            self._controller.stop.remote(f"stopped by the sweep's scheduler ({self._sweep})")
            result = ray.get(self._done, timeout=300)
            print(
                f"trial {self.trial_id}: job {result['state']} at step {result['steps']}, "
                f"committed {result.get('committed_steps')}",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001 - the actors go below whatever happened
            log.warning("trial %s: the job did not stop cleanly (%s)", self.trial_id, e)
        finally:
            self._release()
