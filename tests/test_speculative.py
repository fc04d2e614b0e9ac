"""Greedy speculative decoding: same tokens as greedy target decoding, sliced into units."""

from __future__ import annotations

import copy

import pytest
import torch

from spotline.backfill.speculative import (
    SpeculativeResult,
    fit_prompt,
    greedy_generate,
    layerwise_forward,
    run_to_end,
    speculative_generate,
)
from spotline.config import GptModelSpec
from spotline.models import build_sequential
from spotline.models.gpt import PROVIDER

pytestmark = pytest.mark.unit

SEQ_LEN = 64
TARGET_SPEC = GptModelSpec(n_layers=2, d_model=32, n_heads=2, seq_len=SEQ_LEN)
DRAFT_SPEC = GptModelSpec(n_layers=1, d_model=16, n_heads=2, seq_len=SEQ_LEN)


def encode(text: str) -> list[int]:
    return list(text.encode())


def gpt(spec: GptModelSpec, seed: int):
    return build_sequential(PROVIDER.build(spec, vocab_size=256, seq_len=spec.seq_len, seed=seed))


TARGET_UNITS = TARGET_SPEC.n_layers + 2  # embedding, blocks, head

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
    # Untrained logits are nearly flat, so argmax flips easily: the noise is small
    # enough that most proposals survive and large enough that some do not.
    noisy = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 3e-4)
    return noisy


def drive(gen):
    """Run a sliced generator, returning (labels yielded, result)."""
    labels = []
    while True:
        try:
            labels.append(next(gen))
        except StopIteration as stop:
            return labels, stop.value


def full_acceptance_counts(gamma: int, max_new: int) -> tuple[int, int]:
    """(verifications, accepted) when the target accepts every proposal."""
    verifications = accepted = 0
    remaining = max_new
    while remaining > 0:
        k = min(gamma, remaining)
        verifications += 1
        accepted += k
        remaining -= k
        remaining -= min(1, remaining)  # the bonus token, if there is room
    return verifications, accepted


def test_layerwise_forward_matches_module(target):
    x = torch.tensor([encode("hello")])
    labels, out = drive(layerwise_forward(target, x, label="t"))
    assert labels == ["t"] * TARGET_UNITS
    with torch.no_grad():
        assert torch.equal(out, target(x))
    assert torch.is_grad_enabled()  # no_grad must not leak out of a paused generator


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_yields_per_layer(target, prompt):
    labels, tokens = drive(greedy_generate(target, prompt, 6))
    assert len(tokens) == 6 and all(0 <= t < 256 for t in tokens)
    assert labels == ["target"] * (6 * TARGET_UNITS)
    assert run_to_end(greedy_generate(target, prompt, 6)) == tokens


@pytest.mark.parametrize("which", ["draft", "noisy", "same"])
@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_speculative_equals_greedy(target, draft, noisy_draft, which, gamma, prompt):
    d = {"draft": draft, "noisy": noisy_draft, "same": target}[which]
    max_new = 12
    expected = run_to_end(greedy_generate(target, prompt, max_new))
    labels, res = drive(speculative_generate(target, d, prompt, gamma, max_new))
    assert isinstance(res, SpeculativeResult)
    assert res.tokens == expected
    assert labels.count("draft") == res.proposed
    assert labels.count("target") == res.verifications * TARGET_UNITS
    assert set(labels) <= {"draft", "target"}
    assert 0 <= res.accepted <= res.proposed
    # Each verification emits its accepted tokens plus at most one target token.
    assert res.verifications <= max_new
    assert res.accepted + res.verifications >= max_new


def test_gamma_larger_than_max_new(target, draft):
    for prompt in PROMPTS:
        expected = run_to_end(greedy_generate(target, prompt, 5))
        for d in (draft, target):
            res = run_to_end(speculative_generate(target, d, prompt, 20, 5))
            assert res.tokens == expected
            assert res.proposed <= 5 * res.verifications


@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("max_new", [1, 5, 12, 16])
def test_self_draft_accepts_everything(target, gamma, max_new):
    res = run_to_end(speculative_generate(target, target, encode("x = "), gamma, max_new))
    verifications, accepted = full_acceptance_counts(gamma, max_new)
    assert res.acceptance_rate == 1.0
    assert (res.verifications, res.accepted, res.proposed) == (verifications, accepted, accepted)
    assert res.accepted_per_verification == accepted / verifications
    if max_new % (gamma + 1) == 0:
        assert res.verifications == max_new // (gamma + 1)
        assert res.accepted_per_verification == gamma


def test_noisy_draft_is_mostly_accepted(target, noisy_draft):
    noisy = run_to_end(speculative_generate(target, noisy_draft, encode("def "), 4, 24))
    assert noisy.tokens == run_to_end(greedy_generate(target, encode("def "), 24))
    # Both paths run: long accepted runs and at least one correction.
    assert 0.5 < noisy.acceptance_rate < 1.0


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
