"""The adaptive global batch: the noise-scale estimator, the schedule's rule, the spec's
checks, and (on real DeepSpeed engines over gloo) the gradient norms it reads.

The end-to-end runs (the batch grows on the tiny quickstart shape; SIGKILL resume
gives identical per-step losses) are in test_adaptive_ray.py.
"""

from __future__ import annotations

import math
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from spotline.config import SpecError, load_spec
from spotline.train.adaptive import BatchSchedule, GradProbe, NoiseScale, grow_to
from spotline.train.ds_config import deepspeed_config

# --- the estimator on a problem whose tr(Σ) and |G|² are known ---------------------------


def _linear_problem(n: int, sigma: float, seed: int):
    """Least squares y = w*·x + ε, x ~ N(0, I_n), ε ~ N(0, σ²), loss ½(w·x - y)², at a
    fixed w = w* + d with |d| = 1. The per-example gradient is g = (x·d - ε) x, so
    G = E[g] = d and tr(Σ) = tr E[g gᵀ] - |G|² = (n + 1)|d|² + n σ² (Isserlis)."""
    gen = torch.Generator().manual_seed(seed)
    w_star = torch.randn(n, generator=gen, dtype=torch.float64)
    d = torch.randn(n, generator=gen, dtype=torch.float64)
    d /= d.norm()
    w = (w_star + d).requires_grad_(True)

    def batch(b: int):
        x = torch.randn(b, n, generator=gen, dtype=torch.float64)
        y = x @ w_star + sigma * torch.randn(b, generator=gen, dtype=torch.float64)
        return x, y

    def grad(x, y):
        w.grad = None
        (0.5 * (x @ w - y).pow(2)).mean().backward()
        return w.grad.detach().clone()

    true_g2 = 1.0
    true_trace = (n + 1) * 1.0 + n * sigma**2
    return batch, grad, true_g2, true_trace


@pytest.mark.unit
def test_noise_scale_matches_direct_computation():
    n, sigma, b_small, b_big, steps = 8, 1.0, 4, 32, 4000
    batch, grad, true_g2, true_trace = _linear_problem(n, sigma, seed=0)
    noise = NoiseScale(decay=0.999)
    per_example = []
    for _ in range(steps):
        x, y = batch(b_big)
        # The first micro-batch's gradient next to the whole step's, as a step has them.
        small = grad(x[:b_small], y[:b_small])
        big = grad(x, y)
        noise.update(float(small.pow(2).sum()), b_small, float(big.pow(2).sum()), b_big)
        per_example.append(torch.stack([grad(x[i : i + 1], y[i : i + 1]) for i in range(4)]))
    # Direct computation from the same draws' per-example gradients.
    g = torch.cat(per_example)
    mean = g.mean(0)
    direct_g2 = float(mean.pow(2).sum())
    direct_trace = float(((g - mean).pow(2).sum(1)).mean())
    direct = direct_trace / direct_g2
    truth = true_trace / true_g2
    assert direct == pytest.approx(truth, rel=0.1)  # the problem is what it claims
    est = noise.estimate()
    assert est is not None
    assert est == pytest.approx(direct, rel=0.15), (est, direct, truth)
    # The averaged parts, bias-corrected, are the two quantities themselves.
    corr = 1 - noise.decay**noise.count
    assert noise.g2 / corr == pytest.approx(true_g2, rel=0.2)
    assert noise.trace / corr == pytest.approx(true_trace, rel=0.15)


@pytest.mark.unit
def test_noise_scale_ignores_what_says_nothing():
    noise = NoiseScale(decay=0.9)
    assert noise.estimate() is None
    noise.update(2.0, 4, 1.0, 4)  # one size only
    noise.update(math.inf, 4, 1.0, 8)  # an overflowed step
    assert noise.count == 0 and noise.estimate() is None
    noise.update(1.0, 4, 2.0, 8)  # |G|² estimate 3 > 0, tr(Σ) -8: not a usable scale yet
    assert noise.estimate() == pytest.approx(-8.0 / 3.0)
    assert NoiseScale.from_dict(noise.to_dict()) == noise


@pytest.mark.unit
def test_growth_rule_whole_units_bounded_never_shrinking():
    unit, lo, hi = 4, 8, 48
    assert grow_to(8, None, unit, lo, hi) == 8  # no estimate yet
    assert grow_to(16, 5.0, unit, lo, hi) == 16  # never shrinks
    assert grow_to(8, 13.2, unit, lo, hi) == 16  # whole units: 13.2 -> 16
    assert grow_to(8, 10.0, unit, lo, hi) == 12
    assert grow_to(8, 1000.0, unit, lo, hi) == 16  # at most doubles per boundary
    assert grow_to(32, 1000.0, unit, lo, hi) == 48  # within the bounds


@pytest.mark.unit
def test_schedule_is_recorded_data():
    s = BatchSchedule.start(8, "adaptive", 0.95)
    assert s.batch == 8 and s.lr_scale() == 1.0
    s.set_from(11, 16)
    s.set_from(21, 16)  # no change, no entry
    s.set_from(31, 32)
    assert s.history == [[1, 8], [11, 16], [31, 32]]
    assert [s.batch_at(k) for k in (1, 10, 11, 30, 31, 99)] == [8, 8, 16, 16, 32, 32]
    assert s.lr_scale() == pytest.approx(2.0)  # sqrt(32 / 8)
    back = BatchSchedule.from_dict(s.to_dict())
    assert back == s


# --- the spec ----------------------------------------------------------------------------


def _adaptive(**over):
    raw = {
        "parallel": {"pipeline_stages": 2, "micro_batches": 2},
        "elastic": {"min_replicas": 2, "max_replicas": 2},
        "train": {"global_batch_size": 8, "batch_schedule": "adaptive"},
    }
    return load_spec(raw, {"train.adaptive.max_batch_size": 32, **over})


@pytest.mark.unit
def test_spec_derives_the_adaptive_batch():
    spec = _adaptive()
    assert spec.micro_batch_size() == 2 and spec.batch_unit() == 4
    assert spec.batch_bounds() == (8, 32)
    assert spec.global_batch(2) == 8 and spec.grad_accum(2) == 2
    assert spec.micro_batches_for(24, 2) == 6
    spec = _adaptive(**{"train.adaptive.min_batch_size": 4})
    assert spec.global_batch(2) == 4 and spec.grad_accum(2) == 1
    assert deepspeed_config(spec, 2)["train_batch_size"] == 4
    # A fixed job's hash does not see the adaptive fields; an adaptive one does.
    fixed = load_spec(None, {"train.adaptive.ema_decay": 0.5})
    assert fixed.spec_hash() == load_spec(None, {}).spec_hash()
    assert _adaptive().spec_hash() != _adaptive(**{"train.adaptive.ema_decay": 0.5}).spec_hash()


@pytest.mark.unit
@pytest.mark.parametrize(
    "over, field, fix",
    [
        ({"train.adaptive.max_batch_size": None}, "train.adaptive.max_batch_size", "set it"),
        ({"train.adaptive.max_batch_size": 30}, "train.adaptive.max_batch_size", "28 or 32"),
        ({"train.adaptive.min_batch_size": 6}, "train.adaptive.min_batch_size", "4 or 8"),
        ({"train.adaptive.min_batch_size": 40}, "train.adaptive.min_batch_size", "raise"),
        ({"elastic.batch_policy": "scaled"}, "elastic.batch_policy", "batch_schedule: fixed"),
        ({"parallel.zero_stage": 0}, "parallel.zero_stage", "set zero_stage: 1"),
        (
            {"deepspeed.zero_optimization.overlap_comm": True},
            "deepspeed.zero_optimization.overlap_comm",
            "remove the key",
        ),
    ],
)
def test_spec_refuses_bad_adaptive_fields(over, field, fix):
    with pytest.raises(SpecError) as info:
        _adaptive(**over)
    msg = str(info.value)
    assert field in msg and fix in msg and "\n" not in msg.strip(), msg


# --- the norms a real DeepSpeed step has -------------------------------------------------


def _probe_rank(rank: int, out: dict) -> None:
    try:
        from spotline.train.process import Topology, init_distributed
        from spotline.train.trainer import Trainer

        spec = load_spec(
            None,
            {
                "model.n_layers": 2,
                "model.d_model": 32,
                "model.n_heads": 2,
                "model.seq_len": 32,
                "data.max_bytes": 200_000,
                "data.prefetch": False,
                "parallel.micro_batches": 4,
                "train.global_batch_size": 8,
                "train.grad_clip": 1.0,
                "train.batch_schedule": "adaptive",
                "train.adaptive.max_batch_size": 32,
            },
        )
        topo = Topology(1, 1, rank)
        init_distributed(topo, "127.0.0.1", 0)  # the only rank: the kernel picks its port
        tr = Trainer(spec, topo, threads=1)
        batches = tr._batches(tr.sampler, 0)
        # Reference: autograd on a copy of the weights, outside the engine.
        ref = {n: p.detach().clone() for n, p in tr.engine.module.named_parameters()}
        module = tr.engine.module

        def grads(part):
            for p in module.parameters():
                p.grad = None
            loss = sum(tr.model_def.loss(module(x), y) for x, y in part) / len(part)
            loss.backward()
            g = torch.cat([p.grad.flatten() for p in module.parameters()])
            for p in module.parameters():
                p.grad = None
            return float(g.double().pow(2).sum())

        want_small, want_big = grads(batches[:1]), grads(batches)
        for n, p in module.named_parameters():
            assert torch.equal(p, ref[n])
        tr.train_step()  # the real step: probe, engine, its clip norm
        out["small_sq"] = want_small
        out["big_sq"] = want_big
        out["engine_big"] = float(tr.engine.get_global_grad_norm()) ** 2
        out["noise"] = tr.schedule.noise.to_dict()
        out["micro_batches"] = tr.micro_batches
        # A boundary grows the batch in place: the engine's accumulation, the lr, not
        # the held-out set.
        held, lr = tr.heldout_loss(2), tr.lr()
        tr._set_batch(16)
        grown = {
            "micro_batches": tr.micro_batches,
            "engine_batch": tr.engine.train_batch_size(),
            "lr_ratio": tr.lr() / lr,
            "same_heldout": tr.heldout_loss(2) == held,
        }
        steps = tr.engine.global_steps
        tr.train_step()  # 8 micro-batches after 4: one optimizer step, at its end
        grown["optimizer_steps"] = tr.engine.global_steps - steps
        # ...and nothing accumulated after it: the boundary was the step's last micro-batch.
        grown["leftover"] = any(
            p.grad is not None and bool(p.grad.any()) for p in tr.engine.module.parameters()
        )
        grown["history"] = tr.schedule.history
        out["grown"] = grown
    except BaseException:  # noqa: BLE001 - reported to the test
        out["error"] = traceback.format_exc()


@pytest.mark.procs
def test_probe_reads_the_micro_batch_and_step_norms_of_a_real_engine():
    """On a real DeepSpeed ZeRO-1 engine (gloo, one rank), the first micro-batch's
    squared gradient norm (from the local gradient, x gas²) and the step's (DeepSpeed's
    clip norm) are those autograd gives for the same batches."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as mgr:
        out = mgr.dict()
        p = ctx.Process(target=_probe_rank, args=(0, out))
        p.start()
        p.join(300)
        assert p.exitcode == 0
        out = dict(out)
    assert "error" not in out, out.get("error")
    assert out["micro_batches"] == 4
    grown = out["grown"]
    assert grown["micro_batches"] == 8 and grown["engine_batch"] == 16
    assert grown["lr_ratio"] == pytest.approx(math.sqrt(2))  # sqrt(16 / 8)
    assert grown["same_heldout"] and grown["optimizer_steps"] == 1 and not grown["leftover"]
    assert grown["history"] == [[1, 8], [2, 16]]
    assert out["engine_big"] == pytest.approx(out["big_sq"], rel=1e-4)
    noise = NoiseScale(out["noise"]["decay"])
    noise.update(out["small_sq"], 2, out["big_sq"], 8)
    got = out["noise"]
    assert got["count"] == 1
    assert got["g2"] == pytest.approx(noise.g2, rel=1e-3)
    assert got["trace"] == pytest.approx(noise.trace, rel=1e-3)


@pytest.mark.unit
def test_probe_takes_the_first_gradient_of_each_parameter():
    model = torch.nn.Linear(3, 2)
    probe = GradProbe(model)
    x = torch.ones(4, 3)
    probe.arm()
    model(x[:2]).sum().backward()
    first = sum(float(p.grad.pow(2).sum()) for p in model.parameters())
    model(x[2:] * 3).sum().backward()  # accumulates: not read
    assert probe.take() == pytest.approx(first)
    model(x).sum().backward()  # not armed
    assert probe.take() == 0.0
    probe.remove()
