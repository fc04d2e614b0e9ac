"""Greedy speculative decoding, sliced into small units of work.

A backfill executor runs this only inside idle windows of a training pipeline,
so every function that does model work returns a generator: it yields a label
after each unit ("target" after one layer of the target model, "draft" after
one whole draft forward) and hands back its result as the generator's return
value. The caller may pause for any time between units; `run_to_end` drives a
generator straight through. Arguments are checked when the function is called,
before any unit runs.

Why the output equals greedy decoding by the target alone: every token that
is emitted is the target's argmax at its position given exactly the tokens
before it. A draft proposal is kept only if it equals that argmax, and the
first mismatch is replaced by the target's own argmax (the correction), after
which all later proposals are dropped because they were conditioned on a
rejected token. Because the target is causal, its prediction at position i in
the verification pass depends only on tokens <= i, i.e. on tokens it has
already confirmed. The draft therefore changes only how many target forwards
are needed, never which tokens come out. (In floating point this assumes the
target's argmax at a position does not flip with the length of the input; for
these tiny models it does not in practice, and the tests check the equality.)

Why no KV cache: the models are tiny, a full-prefix recompute is cheap, and it
keeps the target's verification pass the same computation as plain greedy
decoding, which is what makes the equality above easy to trust and to test.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

T = TypeVar("T")


def run_to_end(gen: Generator[str, None, T]) -> T:
    """Drive a sliced generator to completion and return its result."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


def layerwise_forward(
    model: nn.Sequential, x: torch.Tensor, label: str = "target"
) -> Generator[str, None, torch.Tensor]:
    """Run `model` one layer per unit; returns the final output."""
    for layer in model:
        # Grad mode is thread-global: a `no_grad` block held open across a yield
        # would leak into whatever the caller (the training step) runs meanwhile.
        with torch.no_grad():
            x = layer(x)
        yield label
    return x


def fit_prompt(prompt: list[int], max_new_tokens: int, seq_len: int) -> list[int]:
    """Keep the last (seq_len - max_new_tokens) prompt tokens, so prompt + output fits."""
    if max_new_tokens >= seq_len:
        raise ValueError(
            f"max_new_tokens ({max_new_tokens}) must be < seq_len ({seq_len}) to leave room "
            f"for at least one prompt token; generate fewer tokens"
        )
    return list(prompt)[-(seq_len - max_new_tokens) :]


def _seq_len(model: nn.Sequential) -> int:
    return model.seq_len  # set by spotline.models.build_sequential


def _check(model: nn.Sequential, prompt: list[int], max_new_tokens: int, name: str) -> None:
    if not prompt:
        raise ValueError("prompt must hold at least one token (there is no BOS token)")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    seq_len = _seq_len(model)
    if len(prompt) + max_new_tokens > seq_len:
        # The model was trained on (and, with learned positions, can only place) seq_len.
        raise ValueError(
            f"len(prompt) ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"{name} model's seq_len ({seq_len}); clip the prompt with "
            f"fit_prompt(prompt, max_new_tokens, {seq_len}) or generate fewer tokens"
        )


def _ids(model: nn.Sequential, tokens: list[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    return torch.tensor([tokens], dtype=torch.long, device=device)


def greedy_generate(
    target: nn.Sequential, prompt: list[int], max_new_tokens: int
) -> Generator[str, None, list[int]]:
    """Plain greedy decoding by the target; returns the new tokens."""
    # Checked here, not inside the generator, so a bad job fails when it is
    # submitted rather than at its first idle window.
    _check(target, prompt, max_new_tokens, "target")
    return _greedy(target, list(prompt), max_new_tokens)


def _greedy(
    target: nn.Sequential, prompt: list[int], max_new_tokens: int
) -> Generator[str, None, list[int]]:
    target.eval()
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        logits = yield from layerwise_forward(target, _ids(target, tokens))
        tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt) :]


@dataclass
class SpeculativeResult:
    tokens: list[int]
    verifications: int  # target forward passes
    proposed: int  # draft tokens offered for verification
    accepted: int  # draft tokens the target agreed with

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def accepted_per_verification(self) -> float:
        return self.accepted / self.verifications if self.verifications else 0.0


def speculative_generate(
    target: nn.Sequential,
    draft: nn.Sequential,
    prompt: list[int],
    gamma: int,
    max_new_tokens: int,
) -> Generator[str, None, SpeculativeResult]:
    """Greedy speculative decoding; the tokens equal `greedy_generate(target, ...)`."""
    if gamma < 1:
        raise ValueError(f"gamma (draft tokens per verification) must be >= 1, got {gamma}")
    _check(target, prompt, max_new_tokens, "target")
    _check(draft, prompt, max_new_tokens, "draft")
    return _speculative(target, draft, list(prompt), gamma, max_new_tokens)


def _speculative(
    target: nn.Sequential,
    draft: nn.Sequential,
    prompt: list[int],
    gamma: int,
    max_new_tokens: int,
) -> Generator[str, None, SpeculativeResult]:
    target.eval()
    draft.eval()
    out: list[int] = []
    verifications = proposed = accepted = 0
    while len(out) < max_new_tokens:
        prefix = prompt + out
        # Never propose past max_new_tokens: the extra work could not be emitted.
        k = min(gamma, max_new_tokens - len(out))
        proposals: list[int] = []
        for _ in range(k):
            with torch.no_grad():
                logits = draft(_ids(draft, prefix + proposals))
            proposals.append(int(logits[0, -1].argmax()))
            yield "draft"
        logits = yield from layerwise_forward(target, _ids(target, prefix + proposals))
        # preds[i] is the target's token after prefix + proposals[:i], i = 0..k.
        preds = logits[0, len(prefix) - 1 :].argmax(-1).tolist()
        n = 0
        while n < k and proposals[n] == preds[n]:
            n += 1
        out += proposals[:n]
        if len(out) < max_new_tokens:
            out.append(preds[n])  # the correction, or the bonus token if n == k
        verifications += 1
        proposed += k
        accepted += n
    return SpeculativeResult(out, verifications, proposed, accepted)
