"""Backfill task kinds, by name, and the context they run in.

A task is a generator function `run(task, ctx)`: it does one small unit of work
(half a layer of a forward pass, one draft token, one draft training step) between
two `yield`s, and yields a label naming the kind of unit it just did. The
executor resumes it only inside a pipeline window with room for one more unit of
that kind, so a task never needs to know about windows. Its result is the
generator's return value (a dict).

Everything before a task's first `yield` is its setup: host-side loading
(download, deserialise, build the model, read the corpus). The executor runs it
at once, outside the windows, at the idle priority it always has on CPU; it is
not device work and is reported apart (`setup_s`).

Tasks read the model from a committed checkpoint (the full fp32 weights, assembled
from every rank's shards), never from a live worker: the snapshot is exact, tagged
with its step, and costs training nothing.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Generator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from spotline.backfill import speculative as spec_dec
from spotline.checkpoint import CheckpointStore, Manifest, reshard
from spotline.config.backfill import DraftSpec, EvalTaskSpec, SpeculativeTaskSpec
from spotline.config.model import GptModelSpec
from spotline.config.schema import JobSpec
from spotline.data import Sampler, job_tokenizer, open_dataset
from spotline.models import ModelDef, build_sequential, model_def
from spotline.models.decode import supports_kv_cache
from spotline.models.gpt import PROVIDER as GPT
from spotline.registry import BACKFILL_TASKS

Units = Generator[str, None, dict[str, Any]]
SETUP = "setup"  # the label of a task's first yield, after its host-side loading


@dataclasses.dataclass
class TaskContext:
    """What a task may use: the job, its storage, the checkpoint to read, a device."""

    spec: JobSpec
    store: CheckpointStore
    manifest: Manifest
    device: torch.device
    cache: dict[str, Any]
    """Survives across tasks on one executor (a trained draft, a loaded target)."""
    busy_s: Callable[[], float]
    """Seconds this task has spent working so far (not waiting for windows)."""
    unit_budget_s: Callable[[], float | None] = dataclasses.field(default=lambda: None)
    """Seconds one unit may take to fit this stage's typical window; None when that is
    unknown, or when training is over (no windows left to fit)."""

    @property
    def step(self) -> int:
        return self.manifest.step

    def dataset(self):
        """The job's dataset (train and held-out token streams), opened once per executor."""
        if "dataset" not in self.cache:
            self.cache["dataset"] = open_dataset(self.spec, self.tokenizer())
        return self.cache["dataset"]

    def tokenizer(self):
        """The job's tokenizer, loaded once per executor (prompts in, completions out)."""
        if "tokenizer" not in self.cache:
            self.cache["tokenizer"] = job_tokenizer(self.spec)
        return self.cache["tokenizer"]

    def target(self) -> torch.nn.Sequential:
        """The whole model at the checkpoint's step (cached per step)."""
        key = f"target@{self.step}"
        if key not in self.cache:
            for k in [k for k in self.cache if k.startswith("target@")]:
                del self.cache[k]  # one snapshot at a time
            self.cache[key] = load_target(self.spec, self.store, self.manifest)
            self.cache[key].to(self.device)
        return self.cache[key]


def load_target(spec: JobSpec, store: CheckpointStore, manifest: Manifest) -> torch.nn.Sequential:
    """The whole model at a committed step: its full fp32 weights, assembled from every
    rank's fragments with ranged, sha256-verified reads."""
    weights = reshard.full_params(
        manifest.extra["index"], reshard.store_reader(store, manifest.step)
    )
    model = build_sequential(model_def(spec))
    model.load_state_dict(weights, strict=True)
    return model.eval()


# --- eval -------------------------------------------------------------------------


def run_eval(task: EvalTaskSpec, ctx: TaskContext) -> Units:
    """Held-out loss of the checkpoint's weights on the job's fixed held-out batches.

    The same batches, cut into the same micro-batches, as the job's final held-out
    loss (`Trainer.heldout_loss`), so the two agree on the same weights.
    """
    spec = ctx.spec
    model = ctx.target()
    loss_fn = model_def(spec).loss
    heldout = Sampler(
        ctx.dataset().heldout, spec.model.seq_len, spec.micro_batch_size(), spec.data.seed + 1
    )
    yield SETUP
    replicas = int(ctx.manifest.topology["replicas"])
    micro = spec.grad_accum(replicas)
    n = task.batches or spec.train.eval_batches
    step_means = []
    # No `no_grad` around the loop: it would stay open across the yields (grad mode is
    # thread-global); each unit runs under its own, and its logits carry no graph.
    for k in range(n):
        losses = []
        for r in range(replicas):
            for x, y in heldout.micro_batches(k, r, replicas, micro):
                logits = yield from spec_dec.layerwise_forward(model, x.to(ctx.device), "eval")
                losses.append(loss_fn(logits, y.to(ctx.device)))
        step_means.append(float(torch.stack(losses).mean()))
    loss = sum(step_means) / len(step_means)
    return {
        "kind": "eval",
        "step": ctx.step,
        "loss": loss,
        "perplexity": math.exp(min(loss, 50.0)),
        "batches": n,
        "weights": "committed checkpoint",
    }


# --- speculative ------------------------------------------------------------------


def build_draft(draft: DraftSpec, seq_len: int, vocab_size: int, seed: int) -> ModelDef:
    """The draft: a small GPT over the target's vocabulary (it shares its tokenizer)."""
    shape = GptModelSpec(
        n_layers=draft.n_layers, d_model=draft.d_model, n_heads=draft.n_heads, seq_len=seq_len
    )
    return GPT.build(shape, vocab_size=vocab_size, seq_len=seq_len, seed=seed)


def draft_key(draft_spec: DraftSpec) -> str:
    return f"draft:{draft_spec.model_dump_json()}"


def load_state_dict(path: str) -> dict[str, torch.Tensor]:
    """A state_dict from a .safetensors file, or a torch file read weights-only (no code)."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path, device="cpu")
    return torch.load(path, map_location="cpu", weights_only=True)


def build_draft_model(draft_spec: DraftSpec, ctx: TaskContext) -> torch.nn.Sequential:
    """A fresh draft (random, or loaded from draft.path) on the executor's device."""
    spec = ctx.spec
    model = build_sequential(
        build_draft(draft_spec, spec.model.seq_len, spec.vocab_size(), spec.train.seed + 99991)
    )
    if draft_spec.path:
        model.load_state_dict(load_state_dict(draft_spec.path))
    return model.to(ctx.device)


DRAFT_STEP_SEQUENCES = 4
"""Sequences in one of `draft.train_steps` (config/backfill.py documents the 4): the
draft trains on train_steps x this many sequences in all, however they are grouped."""
DRAFT_MAX_SEQUENCES = 16
"""The most sequences one optimizer step takes, however wide the windows."""


def distill_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Per token: KL(teacher || student), the target's whole next-token distribution,
    plus cross-entropy to the target's argmax, the token greedy verification accepts.
    The argmax term sharpens the draft on exactly what acceptance needs."""
    s = F.log_softmax(student.float().flatten(0, -2), dim=-1)
    t = F.log_softmax(teacher.float().flatten(0, -2), dim=-1)
    kl = F.kl_div(s, t, log_target=True, reduction="batchmean")
    return kl + F.nll_loss(s, t.argmax(-1))


def step_sequences(budget_s: float | None, per_sequence_s: float | None, left: int) -> int:
    """Sequences the next draft step takes: as many as fit `budget_s` at the measured
    cost of the step's largest unit per sequence, at least 1, at most
    DRAFT_MAX_SEQUENCES and `left`. Without a budget (or a measurement yet):
    DRAFT_STEP_SEQUENCES when the budget is unknown, 1 to measure when it is known."""
    if budget_s is None:
        n = DRAFT_STEP_SEQUENCES
    elif not per_sequence_s:
        n = 1
    else:
        n = int(budget_s / per_sequence_s)
    return max(1, min(n, DRAFT_MAX_SEQUENCES, left))


def _timed(units: Generator[str, None, Any], ctx: TaskContext, cost: dict[str, float]):
    """Pass `units` through, recording each unit's busy seconds by label (the executor
    adds a unit's time to ctx.busy_s() before resuming the task)."""
    while True:
        t0 = ctx.busy_s()
        try:
            label = next(units)
        except StopIteration as done:
            return done.value
        yield label
        cost[label] = ctx.busy_s() - t0


def train_draft(
    draft, draft_spec: DraftSpec, ctx: TaskContext, target: torch.nn.Sequential
) -> Generator[str, None, None]:
    """Distil the target into the draft on the job's corpus: its units.

    The draft sees `draft.train_steps` x DRAFT_STEP_SEQUENCES corpus sequences in all.
    Each optimizer step takes as many of them as its largest unit can process within
    `ctx.unit_budget_s()` (see `step_sequences`): the target's forward over them, a
    unit per half-layer or layer ("draft-train/target/<layer>[/attn|/mlp]"), then the draft's
    forward, backward and update in one unit ("draft-train"), trained towards the
    target's next-token distribution (`distill_loss`).

    The sampler and the optimizer are built here, when called, not in the first unit:
    a task calls this in its setup, outside the windows (the first optimizer of a
    process imports torch's compiler stack, about a second of CPU).
    """
    spec = ctx.spec
    # One row per draw index: the sequences seen do not depend on how they are grouped.
    sampler = Sampler(ctx.dataset().train, spec.model.seq_len, 1, spec.data.seed + 7)
    opt = torch.optim.AdamW(draft.parameters(), lr=draft_spec.lr)
    target.eval()
    return _distil(draft, draft_spec, ctx, target, sampler, opt)


def _distil(draft, draft_spec, ctx, target, sampler, opt) -> Generator[str, None, None]:
    total = draft_spec.train_steps * DRAFT_STEP_SEQUENCES
    done = 0
    per_sequence: float | None = None
    while done < total:
        n = step_sequences(ctx.unit_budget_s(), per_sequence, total - done)
        rows = np.concatenate([sampler.global_rows(done + i, 1) for i in range(n)])
        x = torch.from_numpy(rows[:, :-1].astype(np.int64)).to(ctx.device)
        cost: dict[str, float] = {}
        teacher = yield from _timed(
            spec_dec.layerwise_forward(target, x, "draft-train/target"), ctx, cost
        )
        yield from _timed(_draft_step(draft, opt, x, teacher), ctx, cost)
        done += n
        largest = max(cost.values()) / n
        per_sequence = largest if per_sequence is None else 0.5 * (per_sequence + largest)
    draft.eval()


def _draft_step(draft, opt, x: torch.Tensor, teacher: torch.Tensor) -> Generator[str, None, None]:
    draft.train()
    loss = distill_loss(draft(x), teacher)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    draft.eval()
    yield "draft-train"


def run_speculative(task: SpeculativeTaskSpec, ctx: TaskContext) -> Units:
    """Serve the prompts with greedy speculative decoding; store completions as JSONL."""
    if isinstance(task.prompts, str):
        raise ValueError(
            "speculative task prompts must be resolved to a list before the job starts "
            "(preflight reads the prompts file)"
        )
    seq_len = ctx.spec.model.seq_len
    target = ctx.target()
    key = draft_key(task.draft)
    draft = ctx.cache.get(key)
    trained = draft is not None
    training = None
    if not trained:
        draft = build_draft_model(task.draft, ctx)
        training = train_draft(draft, task.draft, ctx, target)
    tok = ctx.tokenizer()
    ctx.dataset()
    yield SETUP
    if training is not None:
        yield from training
        ctx.cache[key] = draft  # only a fully trained draft is reused
    rows = []
    totals = {"new_tokens": 0, "verifications": 0, "proposed": 0, "accepted": 0}
    spec_s = target_s = 0.0
    target_tokens = 0
    kv_cache = supports_kv_cache(target)
    for prompt in task.prompts:
        ids = spec_dec.fit_prompt(tok.encode(prompt), task.max_new_tokens, seq_len)
        t0 = ctx.busy_s()
        res = yield from spec_dec.speculative_generate(
            target, draft, ids, task.gamma, task.max_new_tokens
        )
        spec_s += ctx.busy_s() - t0
        totals["new_tokens"] += len(res.tokens)
        totals["verifications"] += res.verifications
        totals["proposed"] += res.proposed
        totals["accepted"] += res.accepted
        row = {
            "step": ctx.step,
            "prompt": prompt,
            "completion": tok.decode(res.tokens),
            "tokens": res.tokens,
            "accepted_per_verification": res.accepted_per_verification,
        }
        if task.compare_target_only:
            t0 = ctx.busy_s()
            greedy = yield from spec_dec.greedy_generate(target, ids, task.max_new_tokens)
            target_s += ctx.busy_s() - t0
            target_tokens += len(greedy)
            row["equals_target_greedy"] = greedy == res.tokens
        rows.append(row)
    body = "".join(json.dumps(r) + "\n" for r in rows).encode()
    uri = ctx.store.write_artifact(f"backfill/speculative_step{ctx.step:08d}.jsonl", body)
    out: dict[str, Any] = {
        "kind": "speculative",
        "step": ctx.step,
        "prompts": len(rows),
        **totals,
        "acceptance_rate": totals["accepted"] / totals["proposed"] if totals["proposed"] else 0.0,
        "accepted_per_verification": (
            totals["accepted"] / totals["verifications"] if totals["verifications"] else 0.0
        ),
        "tokens_per_s": totals["new_tokens"] / spec_s if spec_s else 0.0,
        "completions_uri": uri,
        "gamma": task.gamma,
        # True: both decodings used the target's KV cache; False: its layers lack the
        # cached-decoding protocol, so each forward recomputed the whole prefix.
        "kv_cache": kv_cache,
    }
    if task.compare_target_only:
        out["target_only_tokens_per_s"] = target_tokens / target_s if target_s else 0.0
        out["speedup"] = (
            out["tokens_per_s"] / out["target_only_tokens_per_s"]
            if out["target_only_tokens_per_s"]
            else 0.0
        )
        out["all_equal_target_greedy"] = all(r["equals_target_greedy"] for r in rows)
    return out


# --- the registry -----------------------------------------------------------------


def task_runner(kind: str) -> Callable[[Any, TaskContext], Units]:
    """The generator function of a task kind (`spotline.registry.BACKFILL_TASKS`)."""
    return BACKFILL_TASKS.load(kind, "backfill task kind")


@dataclasses.dataclass
class PythonTask:
    """A task from the SDK: `fn(ctx)` is a generator function like the built-in ones."""

    fn: Callable[[TaskContext], Units]
    name: str = "python"
    retries: int = 0
    kind: str = "python"


def units_of(task: Any, ctx: TaskContext) -> Units:
    if isinstance(task, PythonTask):
        return task.fn(ctx)
    return task_runner(task.kind)(task, ctx)
