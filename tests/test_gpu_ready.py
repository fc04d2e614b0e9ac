"""GPU-ready training, checked on CPU: the precision each device trains at, activation
checkpointing, stages built once on the meta device, and compiled blocks.

The unit tests need no process group. The `ray`-marked test runs real DeepSpeed
engines in two torch.multiprocessing ranks over gloo (as tests/test_sharded_state.py
does): losses with activation checkpointing on and off, compiled and eager, at one
and two pipeline stages, ZeRO-3 built split (zero.Init) against ZeRO-1, and a resume
into a rank whose weights were never initialised.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import pytest
import torch

from gloo_ranks import join
from spotline.config import load_spec
from spotline.models import BuildOptions, build_sequential, model_def
from spotline.models.provider import LayerDef, build_layer
from spotline.train.ds_config import deepspeed_config

TINY = {"model.n_layers": 4, "model.d_model": 32, "model.n_heads": 2, "model.seq_len": 32}
LLAMA = {
    "model": {
        "kind": "llama",
        "n_layers": 4,
        "d_model": 32,
        "n_heads": 4,
        "n_kv_heads": 2,
        "seq_len": 32,
        "vocab_size": 256,
    },
    "tokenizer.kind": "byte",
}


def _gpt(**over):
    return load_spec(None, {**TINY, "data.max_bytes": 200_000, **over})


def _llama(**over):
    return load_spec(None, {**copy.deepcopy(LLAMA), "data.max_bytes": 200_000, **over})


# --- precision ------------------------------------------------------------------------


@pytest.mark.unit
def test_auto_precision_is_bf16_on_a_gpu_and_fp32_on_cpu():
    from spotline.train.process import float32_matmul_precision

    spec = _gpt()
    assert spec.parallel.precision == "auto"
    assert spec.on_device("gpu").parallel.precision == "bf16"
    assert spec.on_device("cpu").parallel.precision == "fp32"
    assert deepspeed_config(spec.on_device("cpu"), 1)["bf16"] == {"enabled": False}
    assert deepspeed_config(spec.on_device("gpu"), 1)["bf16"] == {"enabled": True}
    # TF32 for any fp32 matmul left on a GPU; full fp32 on CPU.
    assert float32_matmul_precision("gpu") == "high"
    assert float32_matmul_precision("cpu") == "highest"
    # A precision the spec sets is kept on either device.
    for p in ("fp32", "bf16"):
        pinned = _gpt(**{"parallel.precision": p})
        assert {pinned.on_device(d).parallel.precision for d in ("gpu", "cpu")} == {p}


@pytest.mark.unit
def test_the_plan_uses_the_precision_in_force_and_its_peak():
    from spotline.job import Job
    from spotline.planning.memory_model import memory_per_device, precision

    gpu = _gpt(**{"resources.device": "gpu"})
    cpu = _gpt(**{"resources.device": "cpu"})
    assert (precision(gpu), precision(cpu)) == ("bf16", "fp32")
    g, c = memory_per_device(gpu)[0], memory_per_device(cpu)[0]
    assert g.weight_bytes * 2 == c.weight_bytes  # bf16 weights: 2 bytes, not 4
    assert g.total_bytes < c.total_bytes
    plan = Job(cpu).plan(peak_tflops=1.0)
    assert plan.precision == "fp32" and "precision         fp32" in plan.render()


# --- activation checkpointing -----------------------------------------------------------


@pytest.mark.unit
def test_the_plan_counts_only_the_inputs_of_recomputed_blocks():
    from spotline.planning.memory_model import memory_per_device

    def act(every: int) -> int:
        spec = _gpt(**{"resources.device": "cpu", "parallel.activation_checkpointing": every})
        return memory_per_device(spec)[0].activation_bytes

    off, every_block, every_other = act(0), act(1), act(2)
    spec = _gpt(**{"resources.device": "cpu"})
    s, b, h = spec.model.seq_len, spec.micro_batch_size(), spec.model.d_model
    per_block, kept_input = 34 * s * b * h * 2, s * b * h * 4  # fp32
    logits = off - 4 * per_block
    # 4 blocks: all kept; all recomputed (inputs, plus one block while it recomputes);
    # blocks 0 and 2 recomputed, 1 and 3 kept.
    assert every_block == logits + 4 * kept_input + per_block
    assert every_other == logits + 2 * per_block + 2 * kept_input + per_block
    assert every_block < every_other < off


def _grads(model, x, y, loss):
    model.zero_grad()
    out = loss(model(x), y)
    out.backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _saved_tensors(model, x) -> int:
    """Tensors autograd keeps from `model(x)`'s forward for its backward."""
    count = 0

    def pack(t):
        nonlocal count
        count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum()
    return count


@pytest.mark.unit
@pytest.mark.parametrize("make", [_gpt, _llama], ids=["gpt", "llama"])
def test_recomputed_blocks_keep_names_gradients_and_less(make):
    md = model_def(make())
    x = torch.randint(0, md.vocab_size, (2, md.seq_len))
    y = torch.randint(0, md.vocab_size, (2, md.seq_len))
    plain = build_sequential(md)
    recomputed = build_sequential(md, BuildOptions(recompute_every=1))
    assert list(plain.state_dict()) == list(recomputed.state_dict())
    recomputed.load_state_dict(plain.state_dict())
    loss_a, grads_a = _grads(plain, x, y, md.loss)
    loss_b, grads_b = _grads(recomputed, x, y, md.loss)
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=0)
    for name, g in grads_a.items():
        torch.testing.assert_close(grads_b[name], g, rtol=1e-6, atol=1e-7)
    # It is really on: the recomputed model keeps fewer tensors for its backward.
    assert _saved_tensors(recomputed, x) < _saved_tensors(plain, x)
    # Every other block: in between.
    half = build_sequential(md, BuildOptions(recompute_every=2))
    assert _saved_tensors(recomputed, x) < _saved_tensors(half, x) < _saved_tensors(plain, x)


# --- built once, on the meta device -----------------------------------------------------


class _Counted(torch.nn.Module):
    """A layer with init_weights that counts its calls."""

    calls: list[int] = []

    def __init__(self, width: int):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        if self.lin.weight.device.type != "meta":
            self.init_weights()

    def init_weights(self) -> None:
        _Counted.calls.append(1)
        g = torch.Generator().manual_seed(0)
        torch.nn.init.normal_(self.lin.weight, generator=g)
        torch.nn.init.zeros_(self.lin.bias)


@pytest.mark.unit
def test_a_layer_is_initialised_once_or_not_at_all():
    _Counted.calls.clear()
    built = LayerDef(_Counted, (8,)).build()
    assert _Counted.calls == [1]  # on the meta device, then once in place
    assert built.lin.weight.device.type == "cpu"
    _Counted.calls.clear()
    empty = LayerDef(_Counted, (8,)).build(init=False)
    assert _Counted.calls == [] and empty.lin.weight.device.type == "cpu"
    # Under an active meta device nothing is allocated, as layer counting expects.
    with torch.device("meta"):
        assert LayerDef(_Counted, (8,)).build().lin.weight.device.type == "meta"


@pytest.mark.unit
@pytest.mark.parametrize("make", [_gpt, _llama], ids=["gpt", "llama"])
def test_built_in_layers_built_in_place_equal_their_constructor(make):
    """Every parameter is set by init_weights: the meta build, materialised and
    initialised in place, equals the layer as its constructor builds it."""
    md = model_def(make())
    for i, ld in enumerate(md.layers):
        direct = ld.cls(*ld.args, **ld.kwargs).state_dict()
        in_place = build_layer(md, i).state_dict()
        assert list(direct) == list(in_place)
        for name, t in direct.items():
            assert torch.equal(t, in_place[name]), (i, name)


_RSS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from spotline.config import load_spec
    from spotline.models import BuildOptions, model_def
    from spotline.models.provider import build_layer
    from spotline.planning.partition import stage_bounds

    def status_kb(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))

    over = json.loads(sys.argv[1])
    opts = BuildOptions(init=sys.argv[2] == "init")
    md = model_def(load_spec(None, over))
    bounds = stage_bounds(md, 4)
    # The first build loads code (about 75 MB of it): warm up on a tiny model first.
    over["model"].update(n_layers=1, d_model=8, n_heads=1)
    tiny = model_def(load_spec(None, over))
    warm = [build_layer(tiny, i, opts) for i in range(len(tiny.layers))]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) restarts from the RSS now
    before = status_kb("VmRSS")
    layers = [build_layer(md, i, opts) for i in range(bounds[1], bounds[2])]
    peak = status_kb("VmHWM")
    stage = sum(p.numel() * p.element_size() for m in layers for p in m.parameters())
    print(json.dumps({"grew": (peak - before) * 1024, "stage": stage}))
    """
)


@pytest.mark.procs
@pytest.mark.parametrize("init", ["init", "empty"])
def test_a_stage_build_holds_about_the_stage_not_the_model(init):
    """Stage 1 of 4 of a Llama whose fp32 copy is about 4x the stage: the build's peak
    host memory (this process's own RSS, in a fresh process) stays near the stage."""
    over = {
        "model": {
            "kind": "llama",
            "n_layers": 8,
            "d_model": 512,
            "n_heads": 8,
            "seq_len": 64,
            "vocab_size": 256,
        },
        "tokenizer.kind": "byte",
    }
    md = model_def(load_spec(None, over))
    with torch.device("meta"):
        full = sum(p.numel() * 4 for ld in md.layers for p in ld.build().parameters())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, json.dumps(over), init],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert full > 3.5 * got["stage"]  # the model is several times the stage
    assert got["grew"] < 1.5 * got["stage"], got  # the build holds about the stage


# --- real engines: equal losses ---------------------------------------------------------


def _engine_spec(make, stages: int, **over):
    return make(
        **{
            "parallel.pipeline_stages": stages,
            "parallel.micro_batches": 2,
            "elastic.min_replicas": 1,
            "elastic.max_replicas": 2,
            "train.global_batch_size": 8,
            **over,
        }
    )


def _losses(spec, stages, rank, steps=3, **kw):
    from spotline.train.process import Topology
    from spotline.train.trainer import Trainer

    trainer = Trainer(spec, Topology(stages, 2 // stages, rank), threads=1, **kw)
    try:
        return [trainer.train_step() for _ in range(steps)]
    finally:
        trainer.prefetch.close()


def _resume(make, rank: int, root: Path, stages: int, **over) -> dict:
    """Train 2 steps, save, train 2 more; a rank built without an init (empty weights)
    loads the save and trains the same 2 steps."""
    from spotline.checkpoint import layout, reshard
    from spotline.train import state
    from spotline.train.process import Topology
    from spotline.train.trainer import Fetched, Trainer

    spec = _engine_spec(make, stages, **over)
    topo = Topology(stages, 2 // stages, rank)
    first = Trainer(spec, topo, threads=1)
    [first.train_step() for _ in range(2)]
    snap = state.snapshot(first.engine, topo, write_weights=topo.replica == 0)
    state.write(snap, layout.rank_dir(root, rank))
    reference = [first.train_step() for _ in range(2)]
    first.prefetch.close()
    torch.distributed.barrier()
    empty = Trainer(spec, topo, threads=1, init=False)
    try:
        empty.train_step()
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    index, meta = reshard.read_index(root)
    state.load(empty.engine, topo, index, meta, reshard.directory_reader(root))
    own = json.loads((layout.rank_dir(root, rank) / layout.META_FILE).read_text())
    empty.load(Fetched(2, own, meta, 0))
    resumed = [empty.train_step() for _ in range(2)]
    empty.prefetch.close()
    # 'auto' resolved where DeepSpeed placed the engine: fp32 on this host.
    placed = (str(empty.engine.device), empty.spec.parallel.precision)
    return {"reference": reference, "resumed": resumed, "refused": refused, "placed": placed}


def _rank(rank: int, ports, out: Path, q) -> None:
    try:
        from spotline.train.process import Topology

        torch.set_num_threads(1)
        join(Topology(1, 2, rank), ports)
        r: dict = {}
        # Every pp=1 engine before the first pipeline: a pipeline engine leaves
        # DeepSpeed's process-wide model-parallel state behind it.
        r["gpt/compiled"] = _losses(_engine_spec(_gpt, 1, **{"parallel.compile": True}), 1, rank)
        # ZeRO-3 builds each layer split over the replicas (zero.Init), tied head too,
        # and resumes into layers split and never initialised.
        r["resume_zero3"] = _resume(
            _llama,
            rank,
            out / "zero3",
            1,
            **{"parallel.zero_stage": 3, "model.tie_embeddings": True},
        )
        for zero in (1, 3):
            r[f"llama_tied/zero{zero}"] = _losses(
                _engine_spec(
                    _llama, 1, **{"model.tie_embeddings": True, "parallel.zero_stage": zero}
                ),
                1,
                rank,
            )
        for stages in (1, 2):  # pp=1: 2 replicas under ZeRO-1; pp=2: 1 replica
            for name, make in (("gpt", _gpt), ("llama", _llama)):
                key = f"{name}/pp{stages}"
                r[key] = {
                    "off": _losses(_engine_spec(make, stages), stages, rank),
                    "every": _losses(
                        _engine_spec(make, stages, **{"parallel.activation_checkpointing": 1}),
                        stages,
                        rank,
                    ),
                }
        r["llama/compiled_recomputed"] = _losses(
            _engine_spec(
                _llama, 2, **{"parallel.compile": True, "parallel.activation_checkpointing": 1}
            ),
            2,
            rank,
        )
        r["resume"] = _resume(
            _llama, rank, out / "llama", 2, **{"parallel.activation_checkpointing": 1}
        )
        q.put((rank, r))
    except BaseException:
        q.put((rank, {"error": traceback.format_exc()}))


@pytest.mark.procs
def test_recomputed_and_compiled_blocks_train_the_same_losses(tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q, ports = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, ports, tmp_path, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank, r in results.items():
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
    r = results[0]
    for key in ("gpt/pp1", "gpt/pp2", "llama/pp1", "llama/pp2"):
        off = torch.tensor(r[key]["off"])
        assert off[-1] < off[0], key  # it trains
        torch.testing.assert_close(torch.tensor(r[key]["every"]), off, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        torch.tensor(r["llama_tied/zero3"]),
        torch.tensor(r["llama_tied/zero1"]),
        rtol=1e-5,
        atol=1e-6,
    )
    torch.testing.assert_close(
        torch.tensor(r["gpt/compiled"]), torch.tensor(r["gpt/pp1"]["off"]), rtol=1e-4, atol=1e-5
    )
    torch.testing.assert_close(
        torch.tensor(r["llama/compiled_recomputed"]),
        torch.tensor(r["llama/pp2"]["off"]),
        rtol=1e-4,
        atol=1e-5,
    )
    for rank, res in results.items():
        assert res["resume_zero3"]["resumed"] == res["resume_zero3"]["reference"], rank
        resume = res["resume"]
        assert "none was loaded before its first step" in resume["refused"], rank
        assert resume["resumed"] == resume["reference"], rank
        assert tuple(resume["placed"]) == ("cpu", "fp32"), rank


@pytest.mark.unit
def test_hfu_counts_the_recomputed_forwards():
    from spotline.metrics.mfu import hardware_flops_per_token, model_flops_per_token
    from spotline.models.flops import layer_flops_per_token

    def extra(every: int) -> float:
        spec = _llama(**{"parallel.activation_checkpointing": every})
        return hardware_flops_per_token(spec) - model_flops_per_token(spec)

    spec = _llama()
    md = model_def(spec)
    per_layer = layer_flops_per_token(spec, md)
    blocks = sum(f for f, ld in zip(per_layer, md.layers, strict=True) if ld.cls is md.block_class)
    assert extra(0) == 0.0  # nothing recomputed: HFU = MFU
    assert extra(1) == pytest.approx(blocks / 3)  # every block's forward once more
    assert extra(2) == pytest.approx(blocks / 6)  # blocks 0 and 2 of 4
