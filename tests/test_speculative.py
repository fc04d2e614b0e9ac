"""Greedy speculative decoding with a KV cache: same tokens as greedy target decoding,
sliced into units; the cached forward, halves, the prefix-recompute fallback, and the
draft's distillation sized to the windows."""

from __future__ import annotations

import copy
import types

import numpy as np
import pytest
import torch

import custom_model
from spotline.backfill import tasks
from spotline.backfill.speculative import (
    SpeculativeResult,
    fit_prompt,
    greedy_generate,
    layerwise_forward,
    run_to_end,
    speculative_generate,
)
from spotline.config import GptModelSpec
from spotline.config.backfill import DraftSpec, SpeculativeTaskSpec
from spotline.config.model import LlamaModelSpec
from spotline.data import ByteTokenizer
from spotline.models import build_sequential
from spotline.models import llama as llama_mod
from spotline.models.decode import Decoder, attend, supports_kv_cache
from spotline.models.gpt import PROVIDER

pytestmark = pytest.mark.unit

SEQ_LEN = 64
TARGET_SPEC = GptModelSpec(n_layers=2, d_model=32, n_heads=2, seq_len=SEQ_LEN)
DRAFT_SPEC = GptModelSpec(n_layers=1, d_model=16, n_heads=2, seq_len=SEQ_LEN)
# GQA: 4 query heads share 2 k/v heads.
LLAMA_SPEC = LlamaModelSpec(
    n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, seq_len=SEQ_LEN
)


def encode(text: str) -> list[int]:
    return list(text.encode())


def gpt(spec: GptModelSpec, seed: int):
    return build_sequential(PROVIDER.build(spec, vocab_size=256, seq_len=spec.seq_len, seed=seed))


def llama(seed: int, **changes):
    spec = LLAMA_SPEC.model_copy(update=changes)
    md = llama_mod.PROVIDER.build(spec, vocab_size=256, seq_len=SEQ_LEN, seed=seed)
    return build_sequential(md)


def custom(seed: int):
    md = custom_model.PROVIDER.build(
        custom_model.MixerConfig(), vocab_size=256, seq_len=SEQ_LEN, seed=seed
    )
    return build_sequential(md)


def noisy_copy(model, scale: float = 3e-4):
    # Untrained logits are nearly flat, so argmax flips easily: the noise is small
    # enough that most proposals survive and large enough that some do not.
    noisy = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return noisy


N_LAYERS = TARGET_SPEC.n_layers + 2  # embedding, blocks, head

PROMPTS = [encode("def "), encode("import torch\n"), [7], list(range(40, 60))]
GAMMAS = [1, 2, 4, 7]


@pytest.fixture(scope="module")
def target():
    return gpt(TARGET_SPEC, seed=0)


@pytest.fixture(scope="module")
def draft():
    return gpt(DRAFT_SPEC, seed=5)


@pytest.fixture(scope="module")
def noisy_draft(target):
    return noisy_copy(target)


@pytest.fixture(scope="module")
def targets(target, noisy_draft):
    """Per model kind: (target, the noisy copy of it that drafts)."""
    lt = llama(seed=0)
    return {"gpt": (target, noisy_draft), "llama": (lt, noisy_copy(lt))}


def drive(gen):
    """Run a sliced generator, returning (labels yielded, result); grad mode must be on
    at every yield (a paused task must not leave it disabled for the training step)."""
    labels = []
    while True:
        try:
            labels.append(next(gen))
        except StopIteration as stop:
            return labels, stop.value
        assert torch.is_grad_enabled(), f"grad mode left disabled across {labels[-1]!r}"


def full_acceptance_counts(gamma: int, max_new: int) -> tuple[int, int]:
    """(verifications, accepted) when the target accepts every proposal: the prefill
    gives the first token, then each round k = min(gamma, left - 1) proposals + 1."""
    verifications = accepted = 0
    remaining = max_new - 1 if max_new else 0
    while remaining > 0:
        k = min(gamma, remaining - 1)
        verifications += 1
        accepted += k
        remaining -= k + 1
    return verifications, accepted


def speculative_labels(n_layers: int, draft_layers: int) -> set[str]:
    """Every label a speculative run may yield: bounded, whatever the lengths."""
    per_layer = {
        f"{who}/{kind}/{i}"
        for who, n in (("target", n_layers), ("draft", draft_layers))
        for kind in ("prefill", "verify", "decode")
        for i in range(n)
    }
    return per_layer | {"draft/decode"}


# --- the cached forward ------------------------------------------------------------------


CACHED_MODELS = {
    "gpt": lambda: gpt(TARGET_SPEC, seed=0),
    "llama-gqa": lambda: llama(seed=0),
    "llama-mha": lambda: llama(seed=1, n_kv_heads=4),
    "llama-tied": lambda: llama(seed=2, tie_embeddings=True),
}


@pytest.mark.parametrize("kind", sorted(CACHED_MODELS))
def test_cached_forward_equals_full_forward(kind):
    model = CACHED_MODELS[kind]().eval()
    assert supports_kv_cache(model)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids)[0]
    dec = Decoder(model)
    toks = ids[0].tolist()
    got = [run_to_end(dec.feed(toks[:9], "p"))]  # prefill
    got.append(run_to_end(dec.feed(toks[9:10], "d")))  # one token
    got.append(run_to_end(dec.feed(toks[10:15], "v")))  # several, after a cached prefix
    # Rejected tokens: fed, then rolled back; they must leave no trace in the cache.
    run_to_end(dec.feed([1, 2, 3, 4], "v"))
    dec.rollback(15)
    assert dec.length == 15 and dec.cache.length == 15
    got.append(run_to_end(dec.feed(toks[15:40], "v")))
    cached = torch.cat(got)
    assert cached.shape == full.shape
    torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)


def test_rollback_then_refeed_differs_from_no_rollback():
    # The equality above would hold trivially if feeds ignored the cache: here the
    # same tokens after a different (un-rolled-back) prefix give different logits.
    model = gpt(TARGET_SPEC, seed=0).eval()
    a, b = Decoder(model), Decoder(model)
    run_to_end(a.feed([5, 6, 7], "p"))
    run_to_end(b.feed([5, 6, 7, 9, 9], "p"))
    b.rollback(3)
    same = run_to_end(b.feed([8], "d"))
    torch.testing.assert_close(run_to_end(a.feed([8], "d")), same, rtol=1e-5, atol=1e-5)
    c = Decoder(model)
    run_to_end(c.feed([5, 6, 7, 9, 9], "p"))
    assert not torch.allclose(run_to_end(c.feed([8], "d")), same, atol=1e-4)


def test_attend_aligns_the_mask_to_the_last_positions():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (3, 7, 7))
    out = attend(q, k, v)
    for i in range(3):  # query i is position 4 + i: it sees keys 0..4+i
        s = 5 + i
        w = torch.softmax(q[:, :, i : i + 1] @ k[:, :, :s].transpose(-1, -2) / 8**0.5, -1)
        torch.testing.assert_close(out[:, :, i], (w @ v[:, :, :s])[:, :, 0])


def test_cache_refuses_positions_past_seq_len():
    model = gpt(TARGET_SPEC, seed=0).eval()
    dec = Decoder(model)
    run_to_end(dec.feed(list(range(SEQ_LEN - 1)), "p"))
    with pytest.raises(ValueError, match="seq_len"):
        run_to_end(dec.feed([1, 2], "d"))


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_halves_compose_to_the_block_exactly(kind):
    model = gpt(TARGET_SPEC, seed=0) if kind == "gpt" else llama(seed=0)
    block = model[1]
    x = torch.randn(2, 11, 32, generator=torch.Generator().manual_seed(4))
    attn, mlp = block.halves()
    with torch.no_grad():
        assert torch.equal(mlp(attn(x)), block(x))
        assert not torch.equal(attn(x), block(x))  # two different halves, not a pass-through


def test_layerwise_forward_yields_per_half_layer(target):
    x = torch.tensor([encode("hello")])
    labels, out = drive(layerwise_forward(target, x, label="t"))
    assert labels == ["t/0", "t/1/attn", "t/1/mlp", "t/2/attn", "t/2/mlp", "t/3"]
    with torch.no_grad():
        assert torch.equal(out, target(x))
    assert torch.is_grad_enabled()  # no_grad must not leak out of a paused generator


def test_layerwise_forward_runs_a_layer_without_halves_whole():
    model = custom(seed=0)
    x = torch.tensor([encode("hello")])
    labels, out = drive(layerwise_forward(model, x, label="eval"))
    assert labels == ["eval/0", "eval/1", "eval/2", "eval/3"]
    with torch.no_grad():
        assert torch.equal(out, model(x))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_prefills_once_then_decodes_one_token_per_forward(target, prompt):
    labels, tokens = drive(greedy_generate(target, prompt, 6))
    assert len(tokens) == 6 and all(0 <= t < 256 for t in tokens)
    prefill = [f"target/prefill/{i}" for i in range(N_LAYERS)]
    assert labels == prefill + [f"target/decode/{i}" for i in range(N_LAYERS)] * 5
    assert run_to_end(greedy_generate(target, prompt, 6)) == tokens
    # The same tokens as the argmax of full forwards over the growing prefix.
    seq = list(prompt)
    for tok in tokens:
        with torch.no_grad():
            assert int(target(torch.tensor([seq]))[0, -1].argmax()) == tok
        seq.append(tok)


@pytest.mark.parametrize("which", ["draft", "noisy", "same"])
@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_speculative_equals_greedy(targets, draft, kind, which, gamma, prompt):
    tgt, noisy = targets[kind]
    d = {"draft": draft, "noisy": noisy, "same": tgt}[which]
    max_new = 12
    expected = run_to_end(greedy_generate(tgt, prompt, max_new))
    labels, res = drive(speculative_generate(tgt, d, prompt, gamma, max_new))
    assert isinstance(res, SpeculativeResult)
    assert res.tokens == expected
    assert res.kv_cache
    n_draft = len(d)
    assert set(labels) <= speculative_labels(N_LAYERS, n_draft)
    # One draft forward per proposal: the first of a run catches up on unseen tokens.
    assert labels.count("draft/decode") + labels.count("draft/prefill/0") == res.proposed
    assert labels.count("draft/prefill/0") == (1 if res.proposed else 0)
    # One target forward for the prompt, then one per verification, each layer a unit.
    assert labels.count("target/prefill/0") == 1
    assert labels.count("target/verify/0") + labels.count("target/decode/0") == res.verifications
    assert sum(lab.startswith("target/") for lab in labels) == (1 + res.verifications) * N_LAYERS
    assert 0 <= res.accepted <= res.proposed
    # Each verification emits its accepted tokens plus one target token.
    assert res.accepted + res.verifications == max_new - 1


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_rejections_roll_both_caches_back(targets, kind):
    tgt, noisy = targets[kind]
    prompt = encode("def ")
    res = run_to_end(speculative_generate(tgt, noisy, prompt, 4, 40))
    assert res.tokens == run_to_end(greedy_generate(tgt, prompt, 40))
    # Both paths run: long accepted runs and corrections (each one a rollback).
    assert 0.5 < res.acceptance_rate < 1.0


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_gamma_larger_than_tokens_left(targets, draft, kind):
    tgt, noisy = targets[kind]
    for prompt in PROMPTS:
        expected = run_to_end(greedy_generate(tgt, prompt, 5))
        for d in (draft, noisy, tgt):
            res = run_to_end(speculative_generate(tgt, d, prompt, 20, 5))
            assert res.tokens == expected
            # Never more proposals than could be emitted: at most 3 with 4 tokens left
            # after the prefill's, 2 with 3 left (after a correction), and so on.
            assert res.proposed <= 3 + 2 + 1
        res = run_to_end(speculative_generate(tgt, tgt, prompt, 20, 5))
        assert (res.verifications, res.proposed, res.accepted) == (1, 3, 3)


@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("max_new", [1, 2, 5, 12, 16])
def test_self_draft_accepts_everything(target, gamma, max_new):
    res = run_to_end(speculative_generate(target, target, encode("x = "), gamma, max_new))
    verifications, accepted = full_acceptance_counts(gamma, max_new)
    assert res.acceptance_rate == (1.0 if accepted else 0.0)
    assert (res.verifications, res.accepted, res.proposed) == (verifications, accepted, accepted)
    if (max_new - 1) % (gamma + 1) == 0 and max_new > 1:
        assert res.verifications == (max_new - 1) // (gamma + 1)
        assert res.accepted_per_verification == gamma


# --- a model without the protocols: prefix recompute -------------------------------------


def test_custom_model_recomputes_the_prefix_and_says_so(draft):
    model = custom(seed=0).eval()
    assert not supports_kv_cache(model)
    dec = Decoder(model)
    assert not dec.kv_cache
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(2))
    got = [run_to_end(dec.feed(ids[0, :8].tolist(), "p"))]
    run_to_end(dec.feed([3, 3, 3], "v"))
    dec.rollback(8)
    got.append(run_to_end(dec.feed(ids[0, 8:20].tolist(), "v")))
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(got), model(ids)[0], rtol=1e-5, atol=1e-5)
    for gamma in (1, 3, 20):
        for prompt in PROMPTS:
            expected = run_to_end(greedy_generate(model, prompt, 10))
            labels, res = drive(speculative_generate(model, draft, prompt, gamma, 10))
            assert res.tokens == expected and res.kv_cache is False
            assert set(labels) <= speculative_labels(len(model), len(draft))
        noisy = run_to_end(speculative_generate(model, noisy_copy(model), PROMPTS[0], gamma, 10))
        assert noisy.tokens == run_to_end(greedy_generate(model, PROMPTS[0], 10))


class _Store:
    def __init__(self):
        self.artifacts: dict[str, bytes] = {}

    def write_artifact(self, name: str, body: bytes) -> str:
        self.artifacts[name] = body
        return f"memory://{name}"


def _task_ctx(target_model, draft_model, task: SpeculativeTaskSpec):
    ctx = types.SimpleNamespace(
        spec=types.SimpleNamespace(model=types.SimpleNamespace(seq_len=SEQ_LEN)),
        step=7,
        cache={tasks.draft_key(task.draft): draft_model},  # a draft already trained
        store=_Store(),
        busy_s=lambda: 0.0,
        target=lambda: target_model,
        tokenizer=ByteTokenizer,
        dataset=lambda: None,
    )
    ctx.busy_s = lambda: float(len(labels))
    labels: list[str] = []
    return ctx, labels


@pytest.mark.parametrize("kind", ["gpt", "custom"])
def test_run_speculative_reports_the_kv_cache(target, draft, kind):
    model = target if kind == "gpt" else custom(seed=0)
    task = SpeculativeTaskSpec(prompts=["def f(x):", "import os"], max_new_tokens=8, gamma=3)
    ctx, labels = _task_ctx(model, draft, task)
    gen = tasks.run_speculative(task, ctx)
    while True:
        try:
            labels.append(next(gen))
        except StopIteration as stop:
            out = stop.value
            break
    assert out["kv_cache"] is (kind == "gpt")
    assert out["all_equal_target_greedy"] is True
    assert out["new_tokens"] == 16 and out["speedup"] > 0


# --- the draft's distillation, sized to the windows --------------------------------------


def test_step_sequences_follows_the_budget():
    per_seq = 0.002
    assert tasks.step_sequences(None, per_seq, 100) == tasks.DRAFT_STEP_SEQUENCES
    assert tasks.step_sequences(0.01, None, 100) == 1  # known budget, no measurement yet
    assert tasks.step_sequences(0.01, per_seq, 100) == 5
    assert tasks.step_sequences(0.0101, per_seq, 100) == 5
    assert tasks.step_sequences(0.001, per_seq, 100) == 1  # never below one sequence
    assert tasks.step_sequences(1.0, per_seq, 100) == tasks.DRAFT_MAX_SEQUENCES
    assert tasks.step_sequences(0.01, per_seq, 3) == 3  # never past the total


def _train_ctx(budget):
    """A context whose busy clock charges 1 ms per sequence for every unit."""
    tokens = np.random.default_rng(0).integers(0, 256, size=20_000).astype(np.int64)
    clock = {"busy": 0.0, "rows": 0}
    ctx = types.SimpleNamespace(
        spec=types.SimpleNamespace(
            model=types.SimpleNamespace(seq_len=SEQ_LEN), data=types.SimpleNamespace(seed=0)
        ),
        device=torch.device("cpu"),
        dataset=lambda: types.SimpleNamespace(train=tokens),
        busy_s=lambda: clock["busy"],
        unit_budget_s=lambda: budget,
    )
    return ctx, clock


@pytest.mark.parametrize(
    ("budget", "expected_sizes"),
    [
        (None, [tasks.DRAFT_STEP_SEQUENCES] * 6),
        (0.0035, [1, 3, 3, 3, 3, 3, 3, 3, 2]),  # 1 to measure, then 3.5 ms / 1 ms each
        (0.0005, [1] * 24),
        (1.0, [1, tasks.DRAFT_MAX_SEQUENCES, 24 - 1 - tasks.DRAFT_MAX_SEQUENCES]),
    ],
)
def test_draft_steps_are_sized_to_the_budget(target, budget, expected_sizes):
    ctx, clock = _train_ctx(budget)
    d = gpt(DRAFT_SPEC, seed=5)
    sizes: list[int] = []
    target[0].register_forward_pre_hook(lambda m, a: clock.__setitem__("rows", a[0].shape[0]))
    d[0].register_forward_pre_hook(lambda m, a: sizes.append(a[0].shape[0]))
    spec = DraftSpec(n_layers=1, d_model=16, n_heads=2, train_steps=6, lr=1e-3)
    gen = tasks.train_draft(d, spec, ctx, target)
    labels = []
    try:
        while True:
            labels.append(next(gen))
            clock["busy"] += 0.001 * clock["rows"]
            assert torch.is_grad_enabled()
    except StopIteration:
        pass
    target[0]._forward_pre_hooks.clear()
    assert sizes == expected_sizes
    assert sum(sizes) == 6 * tasks.DRAFT_STEP_SEQUENCES  # the total does not depend on it
    per_step = ["draft-train/target/0"]
    per_step += [f"draft-train/target/{i}/{h}" for i in (1, 2) for h in ("attn", "mlp")]
    per_step += ["draft-train/target/3", "draft-train"]
    assert labels == per_step * len(expected_sizes)


class _NextByte(torch.nn.Module):
    """A target that always predicts the byte after the current one."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return 10.0 * torch.nn.functional.one_hot((ids + 1) % 256, 256).float()


def test_distillation_teaches_the_draft_the_target_not_the_corpus():
    # The corpus is random bytes: only the target says "next byte = this byte + 1".
    ctx, _ = _train_ctx(None)
    d = gpt(DRAFT_SPEC, seed=5)
    x = torch.randint(0, 256, (4, SEQ_LEN), generator=torch.Generator().manual_seed(9))

    def agreement() -> float:
        with torch.no_grad():
            return float((d(x).argmax(-1) == (x + 1) % 256).float().mean())

    assert agreement() < 0.05
    spec = DraftSpec(n_layers=1, d_model=16, n_heads=2, train_steps=60, lr=1e-2)
    run_to_end(tasks.train_draft(d, spec, ctx, torch.nn.Sequential(_NextByte())))
    assert agreement() > 0.9
    assert not d.training


def test_counts_properties_when_empty():
    res = SpeculativeResult(tokens=[], verifications=0, proposed=0, accepted=0)
    assert res.acceptance_rate == 0.0 and res.accepted_per_verification == 0.0


def test_zero_new_tokens(target, draft):
    assert run_to_end(greedy_generate(target, [1, 2], 0)) == []
    res = run_to_end(speculative_generate(target, draft, [1, 2], 3, 0))
    assert (res.tokens, res.verifications, res.proposed) == ([], 0, 0)


def test_seq_len_guard(target, draft):
    prompt = list(range(60))
    with pytest.raises(ValueError, match="fit_prompt"):
        run_to_end(greedy_generate(target, prompt, 5))
    with pytest.raises(ValueError, match="fit_prompt"):
        run_to_end(speculative_generate(target, draft, prompt, 2, 5))
    # Exactly filling the context is allowed.
    assert len(run_to_end(greedy_generate(target, prompt, 4))) == 4
    clipped = fit_prompt(prompt, 5, SEQ_LEN)
    assert clipped == prompt[-(SEQ_LEN - 5) :]
    res = run_to_end(speculative_generate(target, draft, clipped, 2, 5))
    assert res.tokens == run_to_end(greedy_generate(target, clipped, 5))


def test_draft_seq_len_guard(target):
    short_draft = gpt(GptModelSpec(n_layers=1, d_model=16, n_heads=2, seq_len=8), 5)
    with pytest.raises(ValueError, match="draft"):
        run_to_end(speculative_generate(target, short_draft, [1, 2, 3], 2, 6))


def test_fit_prompt():
    assert fit_prompt([1, 2, 3], 5, 64) == [1, 2, 3]
    assert fit_prompt(list(range(100)), 14, 64) == list(range(50, 100))
    with pytest.raises(ValueError, match="max_new_tokens"):
        fit_prompt([1], 64, 64)


def test_guards_raise_at_call_time(target, draft):
    # No next() needed: a bad job is refused when it is submitted.
    with pytest.raises(ValueError, match="fit_prompt"):
        greedy_generate(target, list(range(60)), 5)
    with pytest.raises(ValueError, match="gamma"):
        speculative_generate(target, draft, [1], 0, 4)


def test_bad_arguments(target, draft):
    with pytest.raises(ValueError, match="gamma"):
        run_to_end(speculative_generate(target, draft, [1], 0, 4))
    with pytest.raises(ValueError, match="prompt"):
        run_to_end(greedy_generate(target, [], 4))
    with pytest.raises(ValueError, match="max_new_tokens"):
        run_to_end(greedy_generate(target, [1], -1))
