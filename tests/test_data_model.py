"""Corpus reading, resumable sampling and the byte-level GPT, on tiny inputs. No Ray."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from spotline.config import DataSpec, GptModelSpec
from spotline.data import ByteTokenizer, CorpusError, Sampler, load_corpus
from spotline.models import build_sequential, layer_param_counts, lm_loss
from spotline.models.gpt import PROVIDER

pytestmark = pytest.mark.unit

ModelSpec = GptModelSpec
TINY = ModelSpec(n_layers=2, d_model=32, n_heads=2, seq_len=16)
VOCAB_SIZE = 256
BYTES = ByteTokenizer()
encode, decode = BYTES.encode, BYTES.decode


def gpt_def(spec: ModelSpec, seed: int):
    return PROVIDER.build(spec, vocab_size=VOCAB_SIZE, seq_len=spec.seq_len, seed=seed)


def gpt(spec: ModelSpec, seed: int):
    return build_sequential(gpt_def(spec, seed))


def _tokens(n: int = 5000, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


# --- sampler ------------------------------------------------------------------------


def test_global_rows_are_windows_of_the_corpus() -> None:
    tokens = _tokens()
    rows = Sampler(tokens, seq_len=8, micro_batch_size=2, seed=1).global_rows(0, 6)
    assert rows.shape == (6, 9)
    assert rows.dtype == np.uint8
    haystack = tokens.tobytes()
    for row in rows:
        assert row.tobytes() in haystack


def test_batches_are_a_function_of_seed_and_step() -> None:
    tokens = _tokens()
    a = Sampler(tokens, seq_len=16, micro_batch_size=2, seed=7)
    b = Sampler(tokens.copy(), seq_len=16, micro_batch_size=2, seed=7)
    for step in (0, 1, 123):
        np.testing.assert_array_equal(a.global_rows(step, 8), a.global_rows(step, 8))
        np.testing.assert_array_equal(a.global_rows(step, 8), b.global_rows(step, 8))
    assert not np.array_equal(a.global_rows(0, 8), a.global_rows(1, 8))
    other_seed = Sampler(tokens, seq_len=16, micro_batch_size=2, seed=8)
    assert not np.array_equal(a.global_rows(3, 8), other_seed.global_rows(3, 8))
    assert a.state(5) == {"next_step": 5, "seed": 7}


def test_resumed_sampler_draws_what_an_uninterrupted_one_would() -> None:
    tokens = _tokens()
    run = Sampler(tokens, seq_len=16, micro_batch_size=2, seed=3)
    drawn = [run.micro_batches(s, 0, 1, 2) for s in range(6)]
    resumed = Sampler(tokens, seq_len=16, micro_batch_size=2, seed=run.state(4)["seed"])
    for step in (4, 5):
        for (x, y), (rx, ry) in zip(drawn[step], resumed.micro_batches(step, 0, 1, 2), strict=True):
            assert torch.equal(x, rx)
            assert torch.equal(y, ry)


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_global_batch_does_not_depend_on_replica_count(replicas: int) -> None:
    # The constant batch policy: 16 rows of micro-batches of 2 at any replica count.
    sampler = Sampler(_tokens(), seq_len=12, micro_batch_size=2, seed=5)
    micro = 8 // replicas
    step = 9
    rows = torch.from_numpy(sampler.global_rows(step, 16).astype(np.int64))
    inputs, labels = [], []
    for replica in range(replicas):
        mbs = sampler.micro_batches(step, replica, replicas, micro)
        assert len(mbs) == micro
        for x, y in mbs:
            assert x.shape == y.shape == (2, 12)
            assert x.dtype == y.dtype == torch.int64
            inputs.append(x)
            labels.append(y)
    assert torch.equal(torch.cat(inputs), rows[:, :-1])
    assert torch.equal(torch.cat(labels), rows[:, 1:])


def test_labels_are_inputs_shifted_by_one() -> None:
    tokens = np.arange(300, dtype=np.int64).astype(np.uint8)  # distinct neighbours
    sampler = Sampler(tokens, seq_len=10, micro_batch_size=4, seed=0)
    (x, y), *_ = sampler.micro_batches(0, 0, 1, 1)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal((x + 1) % 256, y)  # the corpus counts up, so the next token is +1


def test_sampler_rejects_a_corpus_shorter_than_a_sequence() -> None:
    with pytest.raises(ValueError, match="need at least 18 tokens, got 17"):
        Sampler(_tokens(17), seq_len=16, micro_batch_size=2, seed=0)


# --- corpus -------------------------------------------------------------------------


def _write(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def test_corpus_files_in_sorted_order_with_suffix_filter(tmp_path: Path) -> None:
    # written out of order; the .bin file is skipped by the suffix filter
    root = _write(
        tmp_path / "c",
        {"c.txt": b"CCCC", "a.py": b"AAAA", "z.bin": b"ZZZZ", "b.md": b"BBBB"},
    )
    spec = DataSpec(corpus=str(root), heldout_fraction=0.25)
    corpus = load_corpus(spec)
    whole = (corpus.train.tobytes() + corpus.heldout.tobytes()).decode()
    assert whole == "AAAA\nBBBB\nCCCC"
    assert corpus.source == str(root)
    assert corpus.total_bytes == 14

    only_py = load_corpus(DataSpec(corpus=f"file://{root}", file_suffixes=[".py", ".bin"]))
    assert (only_py.train.tobytes() + only_py.heldout.tobytes()).decode() == "AAAA\nZZZZ"


def test_corpus_respects_max_bytes(tmp_path: Path) -> None:
    root = _write(tmp_path / "c", {f"f{i}.txt": bytes([65 + i]) * 100 for i in range(5)})
    corpus = load_corpus(DataSpec(corpus=str(root), max_bytes=250, heldout_fraction=0.2))
    assert corpus.total_bytes == 250
    whole = corpus.train.tobytes() + corpus.heldout.tobytes()
    assert whole == b"A" * 100 + b"\n" + b"B" * 100 + b"\n" + b"C" * 48


def test_heldout_split_is_the_tail(tmp_path: Path) -> None:
    data = bytes(range(32, 127)) * 11  # text: the corpus reader refuses anything else
    root = _write(tmp_path / "c", {"one.txt": data})
    corpus = load_corpus(DataSpec(corpus=str(root / "one.txt"), heldout_fraction=0.25))
    assert corpus.train.tobytes() == data[: len(data) * 3 // 4]
    assert corpus.heldout.tobytes() == data[len(data) * 3 // 4 :]


def test_corpus_too_small_for_min_tokens(tmp_path: Path) -> None:
    root = _write(tmp_path / "c", {"a.txt": b"x" * 100})
    spec = DataSpec(corpus=str(root), heldout_fraction=0.1)
    assert load_corpus(spec, min_tokens=10).heldout.size == 10
    with pytest.raises(CorpusError, match=r"data\.corpus: .* has 100 bytes, too few"):
        load_corpus(spec, min_tokens=11)


def test_missing_corpus(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="data.corpus: .* does not exist"):
        load_corpus(DataSpec(corpus=str(tmp_path / "nope")))


def test_stdlib_corpus() -> None:
    corpus = load_corpus(DataSpec(corpus="stdlib", max_bytes=100_000), min_tokens=130)
    assert corpus.source == "stdlib"
    assert corpus.total_bytes == 100_000
    assert corpus.train.size == 95_000
    assert corpus.train.dtype == np.uint8
    again = load_corpus(DataSpec(corpus="stdlib", max_bytes=100_000))
    np.testing.assert_array_equal(corpus.train, again.train)


# --- tokenizer ----------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "hello", "héllo wörld", "日本語 🚀\n\ttabs"])
def test_encode_decode_round_trip(text: str) -> None:
    tokens = encode(text)
    assert tokens == list(text.encode("utf-8"))
    assert all(0 <= t < VOCAB_SIZE for t in tokens)
    assert decode(tokens) == text


def test_encode_is_bytes() -> None:
    assert encode("A") == [65]
    assert len(encode("é")) == 2
    assert decode(torch.tensor([104, 105]).tolist()) == "hi"


# --- model --------------------------------------------------------------------------


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_same_seed_same_weights_other_seed_other_weights() -> None:
    a, b, c = (_state(gpt(TINY, seed)) for seed in (11, 11, 12))
    assert a.keys() == b.keys() == c.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    random_init = [k for k in a if k.endswith("weight") and a[k].std() > 0.001]
    assert len(random_init) >= 6  # embeddings, linears, head
    for k in random_init:
        assert not torch.equal(a[k], c[k]), k


@pytest.mark.parametrize(
    "spec",
    [
        TINY,
        ModelSpec(),
        ModelSpec(n_layers=3, d_model=48, n_heads=6, seq_len=40),
    ],
    ids=["tiny", "default", "odd"],
)
def test_param_counts_on_the_meta_device_match_the_model(spec: ModelSpec) -> None:
    model = gpt(spec, 0)
    assert sum(layer_param_counts(gpt_def(spec, 0))) == sum(p.numel() for p in model.parameters())


def test_forward_shape_and_initial_loss() -> None:
    model = gpt(TINY, 0).eval()
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB_SIZE, (3, TINY.seq_len), generator=gen)
    y = torch.randint(0, VOCAB_SIZE, (3, TINY.seq_len), generator=gen)
    with torch.no_grad():
        logits = model(x)
    assert logits.shape == (3, TINY.seq_len, VOCAB_SIZE)
    assert logits.dtype == torch.float32
    loss = lm_loss(logits, y)
    assert loss.shape == ()
    assert loss.item() == pytest.approx(math.log(VOCAB_SIZE), abs=0.1)


def test_forward_is_causal() -> None:
    model = gpt(TINY, 0).eval()
    x = torch.randint(0, VOCAB_SIZE, (1, 10))
    x2 = x.clone()
    x2[0, 7:] = (x2[0, 7:] + 1) % VOCAB_SIZE  # change only the future of position 6
    with torch.no_grad():
        a, b = model(x), model(x2)
    assert torch.allclose(a[:, :7], b[:, :7], atol=1e-6)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_lm_loss_of_a_perfect_prediction_is_small() -> None:
    labels = torch.tensor([[1, 2, 3]])
    logits = torch.full((1, 3, VOCAB_SIZE), -20.0)
    logits[0, torch.arange(3), labels[0]] = 20.0
    assert lm_loss(logits, labels).item() < 1e-6
