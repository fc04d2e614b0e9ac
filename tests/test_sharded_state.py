"""Sharded training state (spotline.train.state, its engine adapter, and the files and
reads of spotline.checkpoint.layout and .reshard) on real DeepSpeed engines over gloo.

Ranks run as torch.multiprocessing processes with the same `Trainer` the Ray workers
host. Each rank saves only what it owns (`snapshot` + `write`, with every
torch.distributed / deepspeed.comm collective patched to raise) and loads only what
it needs at its new shape (`load`, patched the same way).

The reference for "exact" is DeepSpeed's own full state, gathered with
`portable_ref.gather` (tests/; collective, comparison only) at save time and again
after the load.

Launches (each a fresh set of processes; shapes are (pipeline stages, replicas)):
  A (2,2) ZeRO-1: train, save A, train two steps, load A, train the same two steps
    again; then the same round trip with bf16 without ZeRO (BF16_Optimizer).
  B (1,1) from A; C (2,1): first the DP-only change A -> (2,1), then from B;
  D (4,1) from C: the reshard chain (2,2) -> (1,1) -> (2,1) -> (4,1).
  V (1,2): ZeRO-0/2/3 and bf16 round trips, a partial (chunked) read of B at D=2,
  and the load errors.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import portable_ref as portable  # tests/: the full-state reference (collective)
from gloo_ranks import join

pytestmark = pytest.mark.procs

CHUNK_B = 1024  # checkpoint B is hashed in small chunks, so a D=2 load reads parts of entries


def _spec(stages: int, replicas: int, **over):
    from spotline.config import load_spec

    return load_spec(
        None,
        {
            "model.n_layers": 4,
            "model.d_model": 32,
            "model.n_heads": 2,
            "model.seq_len": 32,
            "data.max_bytes": 200_000,
            "parallel.pipeline_stages": stages,
            "parallel.micro_batches": 2,
            # Constant global batch at every replica count in [1, 2].
            "elastic.min_replicas": 1,
            "elastic.max_replicas": 2,
            "train.global_batch_size": 8,
            **over,
        },
    )


# --- in the rank processes -------------------------------------------------------------

_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "_all_gather_base",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "reduce_scatter_fn",
    "allgather_fn",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "monitored_barrier",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "inference_all_reduce",
)


@contextlib.contextmanager
def _no_collectives(what: str):
    """Every collective of torch.distributed and deepspeed.comm raises inside."""
    import deepspeed.comm as ds_comm
    import deepspeed.comm.comm as ds_comm_impl
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    saved = []

    def refuse(name):
        def f(*args, **kwargs):
            raise AssertionError(f"collective {name} called during {what}")

        return f

    for mod in (dist, c10d, ds_comm, ds_comm_impl):
        for name in _COLLECTIVES:
            if hasattr(mod, name):
                saved.append((mod, name, getattr(mod, name)))
                setattr(mod, name, refuse(name))
    try:
        yield
    finally:
        for mod, name, fn in reversed(saved):
            setattr(mod, name, fn)


def _trainer(stages, replicas, rank, ports, **over):
    from spotline.train.process import Topology
    from spotline.train.trainer import Trainer

    topo = Topology(stages, replicas, rank)
    if not torch.distributed.is_initialized():
        join(topo, ports)
    return Trainer(_spec(stages, replicas, **over), topo, threads=1)


def _save(trainer, root: Path, chunk_bytes: int | None = None) -> dict:
    """Sharded save of this rank, collectives forbidden; returns sizes."""
    from spotline.checkpoint import layout
    from spotline.train import state

    topo = trainer.topo
    with _no_collectives("snapshot"):
        snap = state.snapshot(trainer.engine, topo, write_weights=topo.replica == 0)
    kw = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    with _no_collectives("write"):
        entries = state.write(snap, layout.rank_dir(root, topo.rank), **kw)
    return {"snap_bytes": snap.nbytes, "entries": len(entries)}


def _load(trainer, root: Path, step: int, index=None, meta=None, read=None) -> dict:
    """Sharded load, collectives forbidden, then what Trainer.load does after it."""
    from spotline.checkpoint import reshard
    from spotline.train import state

    torch.distributed.barrier()  # every rank has written (outside the save under test)
    if index is None:
        index, meta = reshard.read_index(root)
    read = read or reshard.directory_reader(root)
    with _no_collectives("load"):
        stats = state.load(trainer.engine, trainer.topo, index, meta, read)
    trainer.step = step
    trainer._sync_lr()
    return stats


def _stage_bytes(root: Path, stage: int) -> dict:
    """Bytes of the checkpoint at `root` per kind, of the params of `stage` at the
    checkpoint's shape, and in all."""
    from spotline.checkpoint import reshard

    index, _ = reshard.read_index(root)
    out = {"total": sum(e["nbytes"] for e in index)}
    for e in index:
        if e["rank"] // _replicas_of(root) == stage:
            out[e["kind"]] = out.get(e["kind"], 0) + e["nbytes"]
    return out


def _replicas_of(root: Path) -> int:
    from spotline.checkpoint import reshard

    return reshard.read_index(root)[1]["topology"]["replicas"]


def _gather(trainer) -> dict:
    """Full fp32 weights, moments and step of this stage (collective: comparison only)."""
    opt = trainer.engine.optimizer
    if type(opt).__name__ != "FP16_UnfusedOptimizer":
        return portable.gather(trainer.engine)
    # bf16 without ZeRO at pp=1: portable.gather reads the bf16 params and no moments
    # (its optimizer keeps per-param fp32 copies); read those copies here.
    masters = {
        id(lp): hp
        for lps, hps in zip(opt.fp16_groups, opt.fp32_groups, strict=True)
        for lp, hp in zip(lps, hps, strict=True)
    }
    params = {}
    for n, p in trainer.engine.module.named_parameters():
        hp = masters[id(p)]
        st = opt.optimizer.state[hp]
        params[n] = {"param": hp.detach().clone()}
        params[n].update({k: st[k].detach().clone() for k in ("exp_avg", "exp_avg_sq")})
    step = float(next(iter(opt.optimizer.state.values()))["step"])
    return {"params": params, "adam_step": step}


def _ref(portable_root: Path, step: int) -> dict:
    files = sorted((portable_root / f"global_step{step}" / "spotline").glob("stage_*.safetensors"))
    return portable.load_files(files)


def _exact(trainer, ref: dict) -> dict:
    """Is this rank's state (full fp32, moments, step, module weights) the saved one?"""
    now = _gather(trainer)
    names = sorted(now["params"])
    fp32_moments = all(
        torch.equal(now["params"][n][k], ref["params"][n][k])
        for n in names
        for k in ("param", "exp_avg", "exp_avg_sq")
    )
    weights = True
    for n, p in trainer.engine.module.named_parameters():
        if p.data.numel() == ref["params"][n]["param"].numel():  # ZeRO-3: when gathered
            lp = ref["params"][n]["param"].to(p.dtype).reshape(p.shape)
            weights &= torch.equal(p.detach().cpu(), lp)
    return {
        "exact": fp32_moments and weights,
        "adam_step": now["adam_step"],
        "names": names,
        "global_steps": trainer.engine.global_steps,
    }


def _phase_a(rank, ports, out):
    """(2,2): save A at step 2; the same-shape load reads only this rank's share."""
    trainer = _trainer(2, 2, rank, ports)
    r = {"losses": [trainer.train_step() for _ in range(2)]}
    portable.save_reference(trainer, out / "portable")  # the reference (and C's full load)
    r["save"] = _save(trainer, out / "shards")
    r["next_losses"] = [trainer.train_step() for _ in range(2)]  # moves the state on
    r["load"] = _load(trainer, out / "shards", 2)
    r.update(_exact(trainer, _ref(out / "portable", 2)))
    r["reloaded_next_losses"] = [trainer.train_step() for _ in range(2)]  # steps 3, 4 again
    r["stage_bytes"] = _stage_bytes(out / "shards", trainer.topo.stage)
    # The guard catches a collective (the full gather is one, over each stage's replicas).
    try:
        with _no_collectives("the full gather"):
            portable.gather(trainer.engine)
        r["guard"] = "no collective seen"
    except AssertionError as e:
        r["guard"] = str(e)
    trainer.prefetch.close()
    # bf16 without ZeRO on a pipeline: DeepSpeed's BF16_Optimizer (a second engine in
    # the same processes).
    bf16 = _trainer(2, 2, rank, ports, **{"parallel.zero_stage": 0, "parallel.precision": "bf16"})
    r["bf16_pipe"] = _round_trip(bf16, out / "bf16_pipe")
    return r


def _phase_b(rank, ports, a, out):
    """(1,1) from A; save B (small hash chunks) at step 4."""
    trainer = _trainer(1, 1, rank, ports)
    r = {"load": _load(trainer, a / "shards", 2)}
    r.update(_exact(trainer, _ref(a / "portable", 2)))
    r["losses"] = [trainer.train_step() for _ in range(2)]
    portable.save_reference(trainer, out / "portable")
    r["save"] = _save(trainer, out / "shards", chunk_bytes=CHUNK_B)
    return r


def _phase_c(rank, ports, a, b, out):
    """(2,1): the DP-only change from A (portable load vs sharded load), then from B."""
    trainer = _trainer(2, 1, rank, ports)
    # Reference: the existing, full-tensor load of the same checkpoint, then 2 steps.
    portable.load_reference(trainer, a / "portable", 2)
    r = {"portable_losses": [trainer.train_step() for _ in range(2)]}
    # The same shape, the same checkpoint, loaded sharded over the state trained above.
    r["dp_load"] = _load(trainer, a / "shards", 2)
    r["dp_exact"] = _exact(trainer, _ref(a / "portable", 2))
    r["sharded_losses"] = [trainer.train_step() for _ in range(2)]
    # The chain: from B (1,1).
    r["load"] = _load(trainer, b / "shards", 4)
    r.update(_exact(trainer, _ref(b / "portable", 4)))
    r["losses"] = [trainer.train_step() for _ in range(2)]
    portable.save_reference(trainer, out / "portable")
    r["save"] = _save(trainer, out / "shards")
    return r


def _phase_d(rank, ports, c):
    """(4,1) from C."""
    trainer = _trainer(4, 1, rank, ports)
    r = {"load": _load(trainer, c / "shards", 6)}
    r.update(_exact(trainer, _ref(c / "portable", 6)))
    r["losses"] = [trainer.train_step()]
    return r


VARIANTS = {
    "zero0": {"parallel.zero_stage": 0},
    "zero2": {"parallel.zero_stage": 2},
    # Params under 1000 elements stay gathered (persistent) between steps, the others
    # are partitioned: both ZeRO-3 paths.
    "zero3": {
        "parallel.zero_stage": 3,
        "deepspeed": {"zero_optimization": {"stage3_param_persistence_threshold": 1000}},
    },
    "bf16_zero1": {"parallel.zero_stage": 1, "parallel.precision": "bf16"},
    "bf16_zero3": {
        "parallel.zero_stage": 3,
        "parallel.precision": "bf16",
        "deepspeed": {"zero_optimization": {"stage3_param_persistence_threshold": 1000}},
    },
    "bf16_zero0": {"parallel.zero_stage": 0, "parallel.precision": "bf16"},
}


def _round_trip(trainer, root: Path) -> dict:
    r = {"losses": [trainer.train_step() for _ in range(2)]}
    ref = _gather(trainer)
    r["saved_adam_step"] = ref["adam_step"]
    r["save"] = _save(trainer, root)
    # Steps 3 and 4, then again after the reload: the second one also depends on the
    # restored moments, Adam step and lr.
    r["next_losses"] = [trainer.train_step() for _ in range(2)]
    r["load"] = _load(trainer, root, 2)
    r.update(_exact(trainer, ref))
    r["reloaded_next_losses"] = [trainer.train_step() for _ in range(2)]
    r["optimizer"] = type(trainer.engine.optimizer).__name__
    return r


def _errors(trainer, root: Path) -> dict:
    """What a load of a damaged checkpoint raises (and that it changes nothing)."""
    from spotline.checkpoint import reshard
    from spotline.checkpoint.layout import CheckpointFormatError
    from spotline.train import state

    index, meta = reshard.read_index(root)
    read = reshard.directory_reader(root)
    before = _gather(trainer)
    name = sorted({e["param"] for e in index})[-1]

    def corrupt(entry, start, length):
        data = bytearray(read(entry, start, length))
        data[0] ^= 1
        return bytes(data)

    cases = {
        "missing": ([e for e in index if e["param"] != name], read),
        "shape": (
            [{**e, "shape": [*e["shape"], 1]} if e["param"] == name else e for e in index],
            read,
        ),
        # This rank's own fp32 fragments gone: its range is not covered.
        "uncovered": (
            [e for e in index if not (e["rank"] == trainer.topo.rank and e["kind"] == "fp32")],
            read,
        ),
        "sha": (index, corrupt),
    }
    out = {}
    for case, (idx, rd) in cases.items():
        try:
            with _no_collectives("load"):
                state.load(trainer.engine, trainer.topo, idx, meta, rd)
            out[case] = "no error"
        except CheckpointFormatError as e:
            out[case] = str(e)
    after = _gather(trainer)
    out["unchanged"] = all(
        torch.equal(before["params"][n][k], after["params"][n][k])
        for n in before["params"]
        for k in ("param", "exp_avg", "exp_avg_sq")
    )
    return out


def _phase_v(rank, ports, b, out):
    """(1,2): round trips per ZeRO stage / precision; B (1,1) read in parts at D=2."""
    r = {}
    for name, over in VARIANTS.items():
        trainer = _trainer(1, 2, rank, ports, **over)
        r[name] = _round_trip(trainer, out / name)
        if name == "zero2":
            r["errors"] = _errors(trainer, out / name)
        trainer.prefetch.close()
        del trainer
    trainer = _trainer(1, 2, rank, ports)
    r["partial"] = {"load": _load(trainer, b / "shards", 4)}
    r["partial"].update(_exact(trainer, _ref(b / "portable", 4)))
    r["partial"]["stage_bytes"] = _stage_bytes(b / "shards", 0)
    return r


_PHASES = {"a": _phase_a, "b": _phase_b, "c": _phase_c, "d": _phase_d, "v": _phase_v}


def _rank_main(rank, ports, phase, args, queue):
    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        report = _PHASES[phase](rank, ports, *args)
        queue.put({"rank": rank, **report})
    except BaseException:  # noqa: BLE001 - shipped to the test
        queue.put({"rank": rank, "error": traceback.format_exc()})


def _launch(world: int, phase: str, *args) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue, ports = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(r, ports, phase, args, queue)) for r in range(world)
    ]
    for p in procs:
        p.start()
    reports = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    errors = [r["error"] for r in reports if "error" in r]
    assert not errors, errors[0]
    return sorted(reports, key=lambda r: r["rank"])


# --- fixtures: one launch each, in chain order ---------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tmp_path_factory.mktemp("sharded")


@pytest.fixture(scope="module")
def phase_a(ckpt):
    return _launch(4, "a", ckpt / "a")


@pytest.fixture(scope="module")
def phase_b(ckpt, phase_a):
    return _launch(1, "b", ckpt / "a", ckpt / "b")


@pytest.fixture(scope="module")
def phase_c(ckpt, phase_b):
    return _launch(2, "c", ckpt / "a", ckpt / "b", ckpt / "c")


@pytest.fixture(scope="module")
def phase_d(ckpt, phase_c):
    return _launch(4, "d", ckpt / "c")


@pytest.fixture(scope="module")
def phase_v(ckpt, phase_b):
    return _launch(2, "v", ckpt / "b", ckpt / "v")


def _moment_bytes(d: dict) -> int:
    return sum(d.get(k, 0) for k in ("fp32", "exp_avg", "exp_avg_sq"))


def _adam_bytes(d: dict) -> int:
    return sum(d.get(k, 0) for k in ("exp_avg", "exp_avg_sq"))


# --- tests -------------------------------------------------------------------------------


def test_same_shape_reload_is_exact_and_reads_only_own_share(ckpt, phase_a):
    for r in phase_a:
        assert r["exact"], f"rank {r['rank']}: state changed by a (2,2) -> (2,2) reload"
        assert r["adam_step"] == 2.0 and r["global_steps"] == 2
        assert r["guard"].startswith("collective "), r["guard"]
        # Loading put back the weights, moments, step and lr: steps 3, 4 replay exactly.
        assert r["reloaded_next_losses"] == r["next_losses"]
        bf = r["bf16_pipe"]
        assert bf["optimizer"] == "BF16_Optimizer"
        assert bf["exact"] and bf["adam_step"] == bf["saved_adam_step"] == 2.0
        assert bf["reloaded_next_losses"] == bf["next_losses"]
    for r in phase_a:
        read, stage = r["load"]["bytes_by_kind"], r["stage_bytes"]
        # Moments: exactly this rank's half of its stage's (a read-everything
        # implementation reads all of it).
        assert _adam_bytes(read) <= 0.5 * _adam_bytes(stage) + 4096, (read, stage)
        assert _adam_bytes(read) >= 0.4 * _adam_bytes(stage)
        # fp32 weights are the master itself: written once, as fp32 shares, and read
        # whole by each rank of the stage to rebuild its module. No "weight" entries.
        assert "weight" not in stage and "weight" not in read, (read, stage)
        assert read["fp32"] == stage["fp32"]
        assert r["load"]["bytes_read"] < 0.5 * stage["total"]
        print(
            f"(2,2)->(2,2) rank {r['rank']}: read {r['load']['bytes_read']} B of "
            f"{stage['total']} B in the checkpoint ({r['load']['entries_read']} entries); "
            f"moments {_adam_bytes(read)} of its stage's {_adam_bytes(stage)} B"
        )
    # Every rank wrote a share of the same size (fp32 params: no separate weights).
    sizes = [r["save"]["snap_bytes"] for r in phase_a]
    assert all(s > 0 for s in sizes)
    assert abs(sizes[0] - sizes[1]) <= 0.05 * sizes[0], sizes


def test_save_is_deterministic(ckpt, phase_a, phase_v):
    # The index hashes are those of the bytes on disk; the same snapshot written again
    # gives the same file and the same index.
    import hashlib

    from safetensors.torch import load_file

    from spotline.checkpoint import layout, reshard
    from spotline.checkpoint.layout import load_json
    from spotline.train import state

    index, meta = reshard.read_index(ckpt / "a" / "shards")
    assert meta["topology"] == {"pipeline_stages": 2, "replicas": 2, "zero_stage": 1}
    read = reshard.directory_reader(ckpt / "a" / "shards")
    for e in index:
        assert hashlib.sha256(read(e, 0, e["nbytes"])).hexdigest() == e["sha256"]
    rank0 = layout.rank_dir(ckpt / "a" / "shards", 0)
    tensors = load_file(str(rank0 / layout.STATE_FILE))
    doc = load_json(rank0 / layout.META_FILE)
    entries = [
        {k: e[k] for k in ("key", "param", "kind", "start", "numel", "shape", "dtype", "rank")}
        for e in doc["entries"]
    ]
    snap = layout.RankSnapshot(tensors, entries, doc["meta"])
    again = ckpt / "again"
    state.write(snap, layout.rank_dir(again, 0))
    assert (layout.rank_dir(again, 0) / layout.STATE_FILE).read_bytes() == (
        rank0 / layout.STATE_FILE
    ).read_bytes()
    assert load_json(layout.rank_dir(again, 0) / layout.META_FILE) == doc


def test_reshard_chain_is_exact(phase_a, phase_b, phase_c, phase_d):
    names = set()
    for shape, reports, step in (
        ("(2,2) -> (1,1)", phase_b, 2),
        ("(1,1) -> (2,1)", phase_c, 4),
        ("(2,1) -> (4,1)", phase_d, 6),
    ):
        for r in reports:
            assert r["exact"], f"{shape} rank {r['rank']}: state changed"
            assert r["adam_step"] == float(step) and r["global_steps"] == step
            assert all(n.split(".")[0].isdigit() for n in r["names"])
        stage_names = [set(r["names"]) for r in reports]
        assert not set.intersection(*stage_names) or len(reports) == 1
        names.add(frozenset(set.union(*stage_names)))
        print(
            f"{shape}: bytes read per rank "
            + ", ".join(f"{r['load']['bytes_read']}" for r in reports)
        )
    assert len(names) == 1, "every shape holds the same parameters"
    # (1,1) holds everything, so it reads all of A's fp32 and moments.
    a_bytes = [r["stage_bytes"] for r in phase_a if r["rank"] in (0, 2)]  # one per stage
    assert _moment_bytes(phase_b[0]["load"]["bytes_by_kind"]) == sum(map(_moment_bytes, a_bytes))
    assert all(len(r["losses"]) >= 1 and r["losses"][0] > 0 for r in phase_d)


def test_dp_only_change_trains_exactly_like_the_reference_load(phase_a, phase_c):
    # (2,2) -> (2,1) with a constant global batch. The reference is the same step-2
    # checkpoint loaded at (2,1) through the full-tensor path (portable.load), trained 2
    # steps; then the sharded load of that checkpoint over the trained state, trained
    # the same 2 steps. Same state, same data, same shape -> bitwise the same losses.
    # (An uninterrupted (2,2) run is no bitwise reference: its data-parallel sum runs
    # in another order.)
    for r in phase_c:
        assert r["dp_exact"]["exact"] and r["dp_exact"]["adam_step"] == 2.0
        assert r["sharded_losses"] == r["portable_losses"]
    # And it is the state (2,2) had: its step 3 loss matches up to summation order.
    assert abs(phase_c[0]["sharded_losses"][0] - phase_a[0]["next_losses"][0]) < 1e-4


def test_zero_stages_and_bf16_round_trips_are_exact(phase_v):
    expected = {
        "zero0": "AdamW",
        "zero2": "DeepSpeedZeroOptimizer",
        "zero3": "DeepSpeedZeroOptimizer_Stage3",
        "bf16_zero1": "DeepSpeedZeroOptimizer",
        "bf16_zero3": "DeepSpeedZeroOptimizer_Stage3",
        "bf16_zero0": "FP16_UnfusedOptimizer",
    }
    for name, opt in expected.items():
        for r in phase_v:
            v = r[name]
            assert v["optimizer"] == opt, (name, v["optimizer"])
            assert v["exact"], f"{name} rank {r['rank']}: state changed by a reload"
            # FP16_UnfusedOptimizer counts one more step than the steps trained.
            assert v["adam_step"] == v["saved_adam_step"], (name, r["rank"], v["adam_step"])
            assert v["adam_step"] == (3.0 if name == "bf16_zero0" else 2.0), name
            assert v["reloaded_next_losses"] == v["next_losses"], name
    # ZeRO-0: replica 0 writes the whole state, replica 1 nothing but its meta.
    assert phase_v[1]["zero0"]["save"]["entries"] == 0 < phase_v[0]["zero0"]["save"]["entries"]


def test_partial_reads_are_chunk_verified(phase_v):
    # B was written by one rank (whole params, hashed per 1 KiB); at D=2 each rank holds
    # half of every flat partition: it reads the chunks it needs, not whole entries.
    for r in phase_v:
        p = r["partial"]
        assert p["exact"] and p["adam_step"] == 4.0
        read, stage = p["load"]["bytes_by_kind"], p["stage_bytes"]
        assert _adam_bytes(read) < 0.6 * _adam_bytes(stage), (read, stage)
        print(
            f"(1,1) -> (1,2) rank {r['rank']}: moments {_adam_bytes(read)} of {_adam_bytes(stage)} B"
        )


def test_damaged_checkpoints_raise_and_change_nothing(phase_v):
    for r in phase_v:
        e = r["errors"]
        assert "checkpoint has no state for parameter" in e["missing"]
        assert "saved shape" in e["shape"]
        assert "not covered by the saved fragments" in e["uncovered"]
        assert "sha256 mismatch" in e["sha"]
        assert e["unchanged"]


def test_full_params_assembles_every_ranks_fragments(ckpt, phase_a):
    # What export and backfill read: whole fp32 params from all four ranks' fragments.
    from spotline.checkpoint import reshard

    root = ckpt / "a" / "shards"
    index, _ = reshard.read_index(root)
    weights = reshard.full_params(index, reshard.directory_reader(root))
    ref = _ref(ckpt / "a" / "portable", 2)
    assert sorted(weights) == sorted(ref["params"])
    for name, t in weights.items():
        assert torch.equal(t, ref["params"][name]["param"].reshape(t.shape)), name
