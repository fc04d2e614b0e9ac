"""Greedy speculative decoding with a KV cache, sliced into small units of work.

A backfill executor runs this only inside idle windows of a training pipeline, so
every function that does model work returns a generator: it yields a label after each
unit and hands back its result as the generator's return value. The caller may pause
for any time between units; `run_to_end` drives a generator straight through.
Arguments are checked when the function is called, before any unit runs.

How it runs. Target and draft each keep a KV cache of the sequence
(`spotline.models.decode.Decoder`). The target prefills the prompt once, and its last
logits give the first token. The target's cache then always holds every emitted
token but the last one, whose k/v no forward has computed yet. Each round:

1. the draft proposes k = min(gamma, tokens left - 1) tokens, one cached forward
   each (its first forward also catches up on the tokens it has not seen);
2. the target verifies them in ONE cached forward over k+1 positions: the last
   emitted token and the k proposals. Its logits at position i are its own next
   token after the sequence up to that position;
3. the longest prefix of proposals equal to those argmaxes is accepted, and the
   target's token after it is emitted too: the correction at the first mismatch,
   or the bonus token when all k were accepted (so k stops at tokens left - 1: a
   k-th proposal could never change the output nor save a target forward);
4. both caches roll back to the accepted length (rejected proposals' k/v go).

Why the output equals greedy decoding by the target alone: every emitted token is
the target's argmax at its position given exactly the tokens before it, because a
proposal is kept only if it equals that argmax and everything after the first
mismatch is dropped. The draft changes only how many target forwards are needed,
never which tokens come out. (In floating point this assumes the target's argmax does
not flip with how many positions one forward computes; a near-tie could, and the
tests check the equality on real models.)

A model whose layers lack the cached-decoding protocol (a custom provider's, see
`spotline.models.provider`) recomputes its whole prefix at every forward instead;
the result says which was used (`kv_cache`).

Units and their labels (bounded in number: no token counts or steps, so the executor
can forecast each kind's cost from the last ones):

    target/prefill/<layer>   the target over the prompt, one layer
    target/verify/<layer>    the target over the last token + k proposals, one layer
    target/decode/<layer>    the target over one token (plain greedy, or a last token)
    draft/prefill/<layer>    the draft over the tokens it has not seen yet, one layer
    draft/decode             one whole draft forward: one proposal
    <label>/<layer>[/attn|/mlp]  `layerwise_forward` (half a layer where it has halves)
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import TypeVar

from torch import nn

from spotline.models.decode import Decoder, layerwise_forward

T = TypeVar("T")


def run_to_end(gen: Generator[str, None, T]) -> T:
    """Drive a sliced generator to completion and return its result."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


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


def _argmax(logits) -> list[int]:
    return logits.argmax(-1).tolist()


def greedy_generate(
    target: nn.Sequential, prompt: list[int], max_new_tokens: int
) -> Generator[str, None, list[int]]:
    """Plain greedy decoding by the target, with its KV cache; returns the new tokens."""
    # Checked here, not inside the generator, so a bad job fails when it is
    # submitted rather than at its first idle window.
    _check(target, prompt, max_new_tokens, "target")
    return _greedy(target, list(prompt), max_new_tokens)


def _greedy(
    target: nn.Sequential, prompt: list[int], max_new_tokens: int
) -> Generator[str, None, list[int]]:
    target.eval()
    if not max_new_tokens:
        return []
    dec = Decoder(target)
    logits = yield from dec.feed(prompt, "target/prefill")
    out = [_argmax(logits[-1])]
    while len(out) < max_new_tokens:
        logits = yield from dec.feed(out[-1:], "target/decode")
        out.append(_argmax(logits[-1]))
    return out


@dataclass
class SpeculativeResult:
    tokens: list[int]
    verifications: int  # target forwards after the prompt's prefill
    proposed: int  # draft tokens offered for verification
    accepted: int  # draft tokens the target agreed with
    kv_cache: bool = False  # the target decoded with its KV cache (else: prefix recompute)

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


def _propose(draft: Decoder, tokens: list[int], k: int) -> Generator[str, None, list[int]]:
    """k greedy draft tokens after `tokens`, one cached forward each."""
    unseen = tokens[draft.length :]  # the draft's cache holds a prefix of `tokens`
    if draft.length == 0:  # the whole prompt: sliced by layer like the target's prefill
        logits = yield from draft.feed(unseen, "draft/prefill")
    else:
        logits = yield from draft.feed(unseen, "draft/decode", sliced=False)
    proposals = [_argmax(logits[-1])]
    while len(proposals) < k:
        logits = yield from draft.feed(proposals[-1:], "draft/decode", sliced=False)
        proposals.append(_argmax(logits[-1]))
    return proposals


def _speculative(
    target: nn.Sequential,
    draft: nn.Sequential,
    prompt: list[int],
    gamma: int,
    max_new_tokens: int,
) -> Generator[str, None, SpeculativeResult]:
    target.eval()
    draft.eval()
    tdec, ddec = Decoder(target), Decoder(draft)
    res = SpeculativeResult([], 0, 0, 0, kv_cache=tdec.kv_cache)
    if not max_new_tokens:
        return res
    logits = yield from tdec.feed(prompt, "target/prefill")
    tokens = prompt + [_argmax(logits[-1])]
    while (left := len(prompt) + max_new_tokens - len(tokens)) > 0:
        # The target's verification emits one token of its own after the accepted ones.
        k = min(gamma, left - 1)
        proposals = (yield from _propose(ddec, tokens, k)) if k else []
        # The target's cache lacks only the last emitted token: it goes first.
        fed = tokens[tdec.length :] + proposals
        logits = yield from tdec.feed(fed, "target/verify" if k else "target/decode")
        # preds[i] is the target's token after tokens + proposals[:i], i = 0..k.
        preds = _argmax(logits)
        n = 0
        while n < k and proposals[n] == preds[n]:
            n += 1
        tokens += proposals[:n] + [preds[n]]  # the correction, or the bonus if n == k
        tdec.rollback(len(tokens) - 1)
        ddec.rollback(len(tokens) - 1)
        res.verifications += 1
        res.proposed += k
        res.accepted += n
    res.tokens = tokens[len(prompt) :]
    return res


__all__ = [
    "SpeculativeResult",
    "fit_prompt",
    "greedy_generate",
    "layerwise_forward",
    "run_to_end",
    "speculative_generate",
]
