"""Is the data path ever the bottleneck? Loader, prefetch and `prepare`, on this machine.

1. A byte-level BPE tokenizer is trained on the stdlib (`train_bpe`), and the stdlib is
   prepared with it (`spotline.data.prepare.prepare`, one worker per core) into a local
   token dataset, read back as a `TokenDataset` (memory-mapped shards).
2. loader_vs_step: tokens/s the loader (Sampler + Prefetcher over the TokenDataset,
   the caller taking batches as fast as it can) delivers, over the tokens/s a training
   step consumes, at two shapes:
   - quickstart: configs/quickstart.yaml's GPT (seq 128, global batch 16 = 8
     micro-batches of 2, vocabulary of the trained tokenizer), trained with plain
     torch (`spotline.models.model_def` + `build_sequential` + AdamW; no Ray, no
     DeepSpeed): one step = 8 micro-batches with gradient accumulation + AdamW;
   - llama125m: a Llama of 12 layers, d 768, 12 heads, seq 1024, SwiGLU 2048, tied
     embeddings over a 50304 vocabulary (124M parameters); a few steps at micro-batch
     1 measured on this CPU (--llama estimate: from the step FLOPs and a measured
     matmul rate instead).
   The headline loader_vs_step is the smaller (binding) of the two.
3. stall_fraction_{prefetch,no_prefetch}: the same loop of quickstart steps, with the
   data built on the background thread or synchronously: seconds waited for data
   over wall time. Also with the step simulated by sleeping the measured step time.
4. prepare_vs_tokenizers: `prepare` tokens/s per core (workers = cores; reading,
   tokenizing, writing shards and index) over the `tokenizers` library's own
   `encode_batch` of the same texts already in memory, using all cores, per core.
   The single-threaded encode_batch rate is reported too.

    python benchmarks/data.py [--repeats 5] [--vocab 8192] [--json PATH]

Only the standard library is imported at the top: `prepare` spawns its workers, which
import this script again as their __main__.

Each measurement is repeated (the machine is noisy): min / median / max are printed,
the JSON carries medians at the top level and every sample under "detail".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
LLAMA_125M = {
    "kind": "llama",
    "n_layers": 12,
    "d_model": 768,
    "n_heads": 12,
    "ffn_hidden": 2048,
    "seq_len": 1024,
    "vocab_size": 50304,
    "tie_embeddings": True,
}


def stats(xs: list[float]) -> dict[str, float]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "samples": xs}


def fmt(s: dict[str, float], unit: str = "", scale: float = 1.0, digits: int = 3) -> str:
    f = f"{{:.{digits}g}}"
    return " / ".join(f.format(s[k] * scale) for k in ("min", "median", "max")) + unit


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# --- setup ------------------------------------------------------------------------------


def train_tokenizer(work: Path, vocab: int, max_bytes: int):
    from spotline.data.tokenizer import HuggingFaceTokenizer, train_bpe

    t = time.perf_counter()
    # The work dir is the benchmark's own: a rerun with --workdir measures afresh.
    train_bpe("stdlib", str(work / "tok"), vocab_size=vocab, max_bytes=max_bytes, overwrite=True)
    took = time.perf_counter() - t
    return HuggingFaceTokenizer(work / "tok"), took


def bench_prepare(tok, work: Path, repeats: int, shard_tokens: int) -> dict[str, Any]:
    """prepare('stdlib') with one worker per core, against encode_batch of the same text."""
    from spotline.data.prepare import TEXT_SUFFIXES, prepare
    from spotline.data.textfiles import stdlib_files

    n = cores()
    texts = [f.read_bytes().decode() for f in stdlib_files(TEXT_SUFFIXES)]  # what prepare reads
    backend = tok.backend

    def encode_rate(threads: int) -> float:
        t = time.perf_counter()
        got = backend.encode_batch(texts, add_special_tokens=False)
        took = time.perf_counter() - t
        return (sum(len(e.ids) for e in got) + len(texts)) / took / threads

    # Alternate prepare and encode_batch, so a change in the machine's load hits both.
    runs, lib_all, lib_one, index = [], [], [], None
    for r in range(repeats):
        out = work / f"prep{r}"
        t = time.perf_counter()
        index = prepare(
            "stdlib", tok, str(out), workers=n, shard_tokens=shard_tokens, progress=False,
            overwrite=True,
        )  # fmt: skip
        runs.append(index["total_tokens"] / (time.perf_counter() - t) / n)
        if r:
            shutil.rmtree(out)
        lib_all.append(encode_rate(n))
        saved = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # read by the library at every call
        try:
            lib_one.append(encode_rate(1))
        finally:
            if saved is None:
                os.environ.pop("TOKENIZERS_PARALLELISM")
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = saved
    assert index is not None
    ratio = [p / q for p, q in zip(runs, lib_all, strict=True)]
    ratio_one = [p / q for p, q in zip(runs, lib_one, strict=True)]
    return {
        "dataset": str(work / "prep0"),
        "index": index,
        "input_bytes": sum(len(t.encode()) for t in texts),
        "workers": n,
        "prepare_tokens_per_s_per_core": stats(runs),
        "encode_batch_tokens_per_s_per_core": stats(lib_all),
        "encode_batch_single_thread_tokens_per_s": stats(lib_one),
        "prepare_vs_tokenizers": stats(ratio),
        "prepare_vs_tokenizers_single_thread": stats(ratio_one),
    }


def _merge_quickstart(raw: dict):
    import yaml

    from spotline.config import load_spec

    base = yaml.safe_load(QUICKSTART.read_text())
    for k, v in raw.items():
        base[k] = {**base.get(k, {}), **v} if isinstance(v, dict) and k != "model" else v
    if "model" not in raw:
        base["model"] = {**base["model"], "vocab_size": raw["tokenizer"]["vocab_size"]}
    return load_spec(base)


# --- training steps on CPU ----------------------------------------------------------------


class Trainer:
    """One optimizer step over a list of micro-batches: plain torch, AdamW."""

    def __init__(self, spec):
        from spotline.models import build_sequential, model_def

        self.md = model_def(spec)
        self.model = build_sequential(self.md)
        import torch

        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.params = sum(p.numel() for p in self.model.parameters())

    def step(self, batches) -> float:
        total = 0.0
        for x, y in batches:
            loss = self.md.loss(self.model(x), y) / len(batches)
            loss.backward()
            total += float(loss.detach())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total


def time_steps(
    trainer: Trainer, batches_for: Callable[[int], list], n: int, warmup: int
) -> list[float]:
    for k in range(warmup):
        trainer.step(batches_for(k))
    out = []
    for k in range(n):
        b = batches_for(warmup + k)
        t = time.perf_counter()
        trainer.step(b)
        out.append(time.perf_counter() - t)
    return out


def matmul_flops() -> float:
    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(4):
            a @ b
        best = max(best, 4 * 2 * 2048**3 / (time.perf_counter() - t))
    return best


# --- the loader ----------------------------------------------------------------------------


def loader_rate(sampler, micro: int, steps: int, repeats: int) -> tuple[dict, dict]:
    """tokens/s of Sampler + Prefetcher with a caller that only takes batches, and the
    build time of one step's batches (synchronous)."""
    from spotline.data import Prefetcher

    tokens = sampler.micro_batch_size * micro * sampler.seq_len
    rates, builds = [], []
    for r in range(repeats):
        base = 10_000 * (r + 1)
        with Prefetcher(lambda k: sampler.micro_batches(k, 0, 1, micro)) as pf:
            pf.get(base)
            t = time.perf_counter()
            for k in range(1, steps + 1):
                pf.get(base + k)
            rates.append(steps * tokens / (time.perf_counter() - t))
        t = time.perf_counter()
        for k in range(steps):
            sampler.micro_batches(base + 5_000 + k, 0, 1, micro)
        builds.append((time.perf_counter() - t) / steps)
    return stats(rates), stats(builds)


def stall_loop(
    make: Callable[[int], Any], step: Callable[[Any], Any], n: int, prefetch: bool
) -> float:
    """Seconds waited for data over the loop's wall time."""
    from spotline.data import Prefetcher

    waited = 0.0
    with Prefetcher(make, enabled=prefetch) as pf:
        t0 = time.perf_counter()
        for k in range(n):
            batches, stall = pf.get(k)
            waited += stall
            step(batches)
        wall = time.perf_counter() - t0
    return waited / wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary to train")
    ap.add_argument("--train-bytes", type=int, default=4_000_000, help="stdlib bytes to train on")
    ap.add_argument(
        "--shard-tokens", type=int, default=1 << 20, help="small, so windows cross shards"
    )
    ap.add_argument("--loader-steps", type=int, default=200)
    ap.add_argument("--stall-steps", type=int, default=40)
    ap.add_argument("--llama", choices=["measure", "estimate"], default="measure")
    ap.add_argument("--llama-steps", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--workdir", default=None, help="default: a temp directory, removed after")
    args = ap.parse_args(argv)
    # torch is imported here, not at the top: `prepare`'s worker processes (spawned)
    # import this script again as their __main__, and need none of it.
    import torch

    work = Path(args.workdir or tempfile.mkdtemp(prefix="spotline-bench-data-"))
    work.mkdir(parents=True, exist_ok=True)
    R = args.repeats
    print(f"# spotline data benchmark: {cores()} cores, torch threads {torch.get_num_threads()}, "
          f"python {platform.python_version()}, work dir {work}", flush=True)  # fmt: skip
    try:
        tok, train_s = train_tokenizer(work, args.vocab, args.train_bytes)
        print(f"trained BPE (vocab {tok.vocab_size}) on {args.train_bytes / 1e6:.0f} MB in {train_s:.1f} s", flush=True)  # fmt: skip
        prep = bench_prepare(tok, work, max(2, min(R, 3)), args.shard_tokens)
        index = prep.pop("index")
        print(f"prepared stdlib: {prep['input_bytes'] / 1e6:.1f} MB -> {index['total_tokens']:,} tokens, "
              f"{index['documents']:,} documents, {len(index['shards'])} shards", flush=True)  # fmt: skip

        from spotline.data import Sampler, TokenDataset

        # --- quickstart shape -------------------------------------------------------
        qs = _merge_quickstart(
            {
                "data": {"kind": "tokens", "uri": prep["dataset"], "cache_dir": str(work / "cache")},
                "tokenizer": {"kind": "huggingface", "path": str(work / "tok"),
                              "sha256": tok.sha256, "vocab_size": tok.vocab_size},
                "elastic": {"min_replicas": 1, "max_replicas": 1},
                "parallel": {"pipeline_stages": 1, "micro_batches": 8},
            }
        )  # fmt: skip
        ds = TokenDataset(qs, tok)
        t = time.perf_counter()
        for s in ds.sources:
            for i in range(len(s.shards)):
                s.stream.shard(i)  # open (and verify) every shard once: steady state
        open_s = time.perf_counter() - t
        mbs, micro, seq = qs.micro_batch_size(), qs.grad_accum(1), qs.model.seq_len
        assert mbs * micro == qs.train.global_batch_size == 16 and seq == 128
        q_sampler = Sampler(ds.train, seq, mbs, qs.data.seed)
        q_rate, q_build = loader_rate(q_sampler, micro, args.loader_steps, R)
        q_trainer = Trainer(qs)
        q_make = lambda k: q_sampler.micro_batches(k, 0, 1, micro)  # noqa: E731
        q_steps = []
        for r in range(R):
            q_steps.append(statistics.median(time_steps(q_trainer, q_make, 8, 2 if r == 0 else 0)))
        q_tokens = mbs * micro * seq
        q_ratio = [rate / (q_tokens / statistics.median(q_steps)) for rate in q_rate["samples"]]
        print(f"quickstart GPT ({q_trainer.params / 1e6:.2f}M params, vocab {qs.vocab_size()}): step "
              f"{fmt(stats(q_steps), ' ms', 1e3)}; loader {fmt(q_rate, ' Mtok/s', 1e-6)}", flush=True)  # fmt: skip

        # --- stall, with and without prefetch ---------------------------------------
        stall_real = {True: [], False: []}
        stall_sleep = {True: [], False: []}
        step_s = statistics.median(q_steps)
        for _ in range(R):
            for pf in (True, False):
                stall_real[pf].append(stall_loop(q_make, q_trainer.step, args.stall_steps, pf))
                stall_sleep[pf].append(
                    stall_loop(q_make, lambda b: time.sleep(step_s), args.stall_steps, pf)
                )

        # --- llama 125M shape -------------------------------------------------------
        ls = _merge_quickstart(
            {
                "model": LLAMA_125M,
                "data": {"kind": "tokens", "uri": prep["dataset"], "cache_dir": str(work / "cache")},
                "tokenizer": {"kind": "huggingface", "path": str(work / "tok"),
                              "sha256": tok.sha256, "vocab_size": tok.vocab_size},
                "elastic": {"min_replicas": 1, "max_replicas": 1},
                "parallel": {"pipeline_stages": 1, "micro_batches": 16},
            }
        )  # fmt: skip
        from spotline.models import layer_param_counts, model_def

        l_def = model_def(ls)
        l_params = sum(layer_param_counts(l_def))
        l_sampler = Sampler(TokenDataset(ls, tok).train, 1024, 1, ls.data.seed)
        l_rate, l_build = loader_rate(l_sampler, 16, max(20, args.loader_steps // 10), R)
        flops_rate = matmul_flops()
        est = l_def.flops_per_token * 1024 / flops_rate  # seconds per micro-batch of 1 x 1024
        if args.llama == "measure":
            l_trainer = Trainer(ls)
            one = lambda k: l_sampler.micro_batches(k, 0, 1, 1)  # noqa: E731
            l_micro = time_steps(l_trainer, one, args.llama_steps, 1)
            del l_trainer
            how = f"measured: {args.llama_steps} steps of micro-batch 1 x 1024"
        else:
            l_micro = [est]
            how = "estimated: flops_per_token x 1024 / measured matmul FLOP/s"
        l_consume = [1024 / s for s in l_micro]
        l_ratio = [rate / statistics.median(l_consume) for rate in l_rate["samples"]]
        print(f"llama125m ({l_params / 1e6:.1f}M params): step of 1 x 1024 "
              f"{fmt(stats(l_micro), ' s')} ({how}); FLOP estimate {est:.2f} s at "
              f"{flops_rate / 1e9:.0f} GFLOP/s; loader {fmt(l_rate, ' Mtok/s', 1e-6)}", flush=True)  # fmt: skip
        l_stall_no = [b / (b + 16 * statistics.median(l_micro)) for b in l_build["samples"]]

        results = {
            "loader_vs_step": min(statistics.median(q_ratio), statistics.median(l_ratio)),
            "stall_fraction_prefetch": statistics.median(stall_real[True]),
            "stall_fraction_no_prefetch": statistics.median(stall_real[False]),
            "prepare_vs_tokenizers": prep["prepare_vs_tokenizers"]["median"],
            "detail": {
                "machine": {"cores": cores(), "torch_threads": torch.get_num_threads(),
                            "python": platform.python_version(), "torch": torch.__version__},
                "tokenizer": {"vocab_size": tok.vocab_size, "train_bytes": args.train_bytes,
                              "train_s": train_s},
                "dataset": {k: index[k] for k in ("total_tokens", "documents", "dtype")}
                | {"shards": len(index["shards"]), "shard_tokens": args.shard_tokens,
                   "open_and_verify_all_s": open_s},
                "prepare": prep,
                "quickstart": {
                    "params": q_trainer.params, "vocab_size": qs.vocab_size(),
                    "tokens_per_step": q_tokens, "step_s": stats(q_steps),
                    "loader_tokens_per_s": q_rate, "build_s_per_step": q_build,
                    "loader_vs_step": stats(q_ratio),
                    "stall_fraction_prefetch": stats(stall_real[True]),
                    "stall_fraction_no_prefetch": stats(stall_real[False]),
                    "stall_fraction_prefetch_sleep_step": stats(stall_sleep[True]),
                    "stall_fraction_no_prefetch_sleep_step": stats(stall_sleep[False]),
                },
                "llama125m": {
                    "shape": LLAMA_125M, "params": l_params, "step_time": how,
                    "micro_batch_s": stats(l_micro), "flop_estimate_micro_batch_s": est,
                    "matmul_flops_per_s": flops_rate, "loader_tokens_per_s": l_rate,
                    "build_s_per_16_rows": l_build, "loader_vs_step": stats(l_ratio),
                    "stall_fraction_no_prefetch_computed": stats(l_stall_no),
                },
            },
        }  # fmt: skip
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)

    d = results["detail"]
    print()
    print("metric                                        min / median / max")
    print(
        f"loader_vs_step quickstart                     {fmt(d['quickstart']['loader_vs_step'], 'x')}"
    )
    print(
        f"loader_vs_step llama125m                      {fmt(d['llama125m']['loader_vs_step'], 'x')}"
    )
    print(
        f"stall fraction, prefetch (real step)          {fmt(d['quickstart']['stall_fraction_prefetch'])}"
    )
    print(
        f"stall fraction, no prefetch (real step)       {fmt(d['quickstart']['stall_fraction_no_prefetch'])}"
    )
    print(
        f"stall fraction, prefetch (sleep step)         {fmt(d['quickstart']['stall_fraction_prefetch_sleep_step'])}"
    )
    print(
        f"stall fraction, no prefetch (sleep step)      {fmt(d['quickstart']['stall_fraction_no_prefetch_sleep_step'])}"
    )
    print(
        f"stall fraction, no prefetch llama (computed)  {fmt(d['llama125m']['stall_fraction_no_prefetch_computed'])}"
    )
    print(
        f"prepare tok/s/core                            {fmt(d['prepare']['prepare_tokens_per_s_per_core'], '', 1e-6)} M"
    )
    print(
        f"encode_batch tok/s/core (all cores)           {fmt(d['prepare']['encode_batch_tokens_per_s_per_core'], '', 1e-6)} M"
    )
    print(
        f"encode_batch tok/s (one thread)               {fmt(d['prepare']['encode_batch_single_thread_tokens_per_s'], '', 1e-6)} M"
    )
    print(
        f"prepare_vs_tokenizers                         {fmt(d['prepare']['prepare_vs_tokenizers'], 'x')}"
    )
    print(
        f"prepare_vs_tokenizers (vs one thread)         {fmt(d['prepare']['prepare_vs_tokenizers_single_thread'], 'x')}"
    )
    print()
    top = {k: v for k, v in results.items() if k != "detail"}
    print(json.dumps(top, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
