"""The seams over the private names of torch, Ray and DeepSpeed (spotline.compat).

Each module is imported (its names checked against the installed versions) and each
of its functions is called once. What needs no running Ray or built engine is unit
tier; the rest is `ray` tier: a local cluster, and one-rank DeepSpeed engines in a
process of their own.
"""

from __future__ import annotations

import json
import queue
import re
import socket
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

from spotline.compat import Pinned

ROOT = Path(__file__).resolve().parents[1]


def _pinned() -> dict[str, str]:
    """The exact pins of pyproject.toml's dependencies: name -> "name==version"."""
    text = (ROOT / "pyproject.toml").read_text()
    found = re.findall(r'"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^";]+)"', text)
    return {name: f"{name}=={version}" for name, version in found}


def _deepspeed():
    from spotline.train.process import import_deepspeed

    import_deepspeed()
    from spotline.compat import deepspeed as seam

    return seam


@pytest.mark.unit
def test_each_seam_names_the_pin_of_pyproject() -> None:
    from spotline.compat import ray as ray_seam
    from spotline.compat import torch as torch_seam

    pins = _pinned()
    assert pins["torch"] == torch_seam.PIN
    assert pins["ray"] == ray_seam.PIN
    assert pins["deepspeed"] == _deepspeed().PIN


@pytest.mark.unit
def test_a_missing_name_fails_in_one_line_naming_the_library_its_version_and_the_pin() -> None:
    lib = Pinned("torch", "9.9.9", "torch==2.13.0")
    lookups = [
        lambda: lib.attribute("torch.distributed.distributed_c10d", "_no_such_name"),
        lambda: lib.attribute(torch, "nn._no_such_name"),
        lambda: lib.module("torch._no_such_module"),
        lambda: lib.defined("torch.utils._pytree", "tree_leaves", "no_such_function"),
        lambda: lib.defined("torch.nn.modules.module", "Module._no_such_attribute"),
        lambda: lib.defined("torch.nn.modules.module", "._no_such_attribute"),
    ]
    for lookup in lookups:
        with pytest.raises(ImportError) as e:
            lookup()
        text = str(e.value)
        assert "\n" not in text
        assert text.startswith("torch 9.9.9 has no ")
        assert text.endswith("install the pinned torch==2.13.0 (pyproject.toml)")
    # What the source does define passes: a function, a method, an attribute on self,
    # an attribute set on any object.
    lib.defined("torch.nn.modules.module", "Module", "Module.forward", "Module.training")
    lib.defined("torch.nn.modules.module", ".training")


@pytest.mark.unit
def test_torch_seam() -> None:
    import torch.distributed as dist

    from spotline.compat import torch as seam

    assert seam.abort_process_groups() is False  # no group: nothing to abort
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        default = seam.default_store()
        default.set("seam", "1")
        assert default.get("seam") == b"1"
    finally:
        assert seam.abort_process_groups() is True
    assert not dist.is_initialized()

    from torch.distributed import distributed_c10d as c10d

    saved = c10d.default_pg_timeout, c10d.default_pg_nccl_timeout
    try:
        seam.set_default_group_timeout(timedelta(seconds=42))
        assert c10d.default_pg_timeout == c10d.default_pg_nccl_timeout == timedelta(seconds=42)
    finally:
        c10d.default_pg_timeout, c10d.default_pg_nccl_timeout = saved

    assert "pg_status" in json.loads(seam.flight_record_json())

    class Ops(seam.TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func)
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        torch.ones(2) + 1
    assert torch.ops.aten.add.Tensor in ops.seen
    assert seam.tree_leaves([1, (2, {"a": 3})]) == [1, 2, 3]


@pytest.mark.unit
def test_a_build_lock_a_killed_build_left_is_removed_and_a_live_builds_is_kept(
    tmp_path, monkeypatch, caplog
) -> None:
    """torch's JIT build of a DeepSpeed op holds `lock` in its build directory; a build
    killed midway leaves it, and every later load of the op waits on it forever. A
    starting rank removes a lock whose directory has been quiet for the threshold, and
    leaves one beside a file that is still being written, or one just taken."""
    import os
    import time

    from torch.utils.cpp_extension import _get_build_directory
    from torch.utils.file_baton import FileBaton

    from spotline import constants
    from spotline.compat import torch as seam
    from spotline.train.process import clear_stale_build_locks

    # The root is where torch itself builds, with and without TORCH_EXTENSIONS_DIR.
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert seam.extension_build_root() == Path(_get_build_directory("probe", False)).parent
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert seam.extension_build_root() == Path(_get_build_directory("probe", False)).parent

    old = time.time() - constants.SPOTLINE_STALE_BUILD_LOCK_S - 60
    locks = {}
    for op in ("killed", "building", "just_taken"):
        build = Path(_get_build_directory(op, False))
        (build / "build.ninja").write_text("")
        locks[op] = build / "lock"
        assert FileBaton(str(locks[op])).try_acquire()  # the build's own lock
        for f in build.iterdir():
            os.utime(f, (old, old))
    (locks["building"].parent / "shm.o").write_bytes(b"")  # being written now
    os.utime(locks["just_taken"], None)
    assert not FileBaton(str(locks["killed"])).try_acquire()  # what a load would wait on

    caplog.set_level("WARNING", logger="spotline.worker")
    assert clear_stale_build_locks(rank=3) == [str(locks["killed"])]
    assert FileBaton(str(locks["killed"])).try_acquire()  # the next load builds
    assert locks["building"].exists() and locks["just_taken"].exists()
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"rank 3: removed {locks['killed']}, the build lock of DeepSpeed op")
    assert clear_stale_build_locks(rank=3) == []  # said once


@pytest.mark.unit
def test_ray_seam_without_a_cluster(monkeypatch) -> None:
    import ray
    from ray.tune.schedulers import PopulationBasedTraining

    from spotline.compat import ray as seam

    assert seam.head_node_resource().startswith("node:")  # only the head offers it
    seam.listen_on_loopback_only()
    assert ray.util.get_node_ip_address() == "127.0.0.1"  # no cluster: Ray's own answer
    assert isinstance(seam.local_gcs_addresses(), set)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    assert seam.address_from_environment("auto") == "127.0.0.1:1"
    assert seam.bootstrap_address() == "127.0.0.1:1"
    assert seam.parse_address("127.0.0.1:6379") == ("127.0.0.1", "6379")
    assert seam.node_ip_for("example.org") == "example.org"
    assert seam.upload_py_modules_if_needed({"env_vars": {}}) == {"env_vars": {}}
    assert seam.upload_working_dir_if_needed({"env_vars": {}}) == {"env_vars": {}}
    pbt = PopulationBasedTraining(hyperparam_mutations={"train.lr": [0.1, 0.2]})
    assert seam.pbt_hyperparam_mutations(pbt) == {"train.lr": [0.1, 0.2]}
    head = seam.head_with_system_config({"num_cpus": 1}, {"health_check_period_ms": 1000})
    assert head == {"num_cpus": 1, "_system_config": {"health_check_period_ms": 1000}}
    assert seam.prometheus_discovery_file().endswith(".json")
    group = {
        "groupName": "cpu",
        "rayStartParams": {"num-cpus": "3"},
        "template": {"spec": {"containers": [{}]}},
    }
    assert seam.kuberay_group_resources(group, is_head=False)["CPU"] == 3


# A private name of Ray: a module or attribute with one leading underscore on a dotted
# path that starts at `ray` (its private package, a private function of its internal_kv),
# a name imported from Ray with one, or an attribute Ray adds to every actor class (its
# `__ray_` names), or one of its internal resource names (the head node's, say).
_RAY_PRIVATE = re.compile(
    r"\bray(?:\.\w+)*\._(?!_)\w|__ray_\w+__|__internal_\w+__"
    r"|from ray[\w.]* import [^\n]*\b_[a-z]"
)


@pytest.mark.unit
def test_no_private_ray_name_is_used_outside_the_seam() -> None:
    """The package, its tests, benchmarks and job entrypoints reach Ray's private names
    only through `spotline.compat.ray`, so that a new Ray fails at one import, naming
    what went, and nowhere else."""
    root = Path(__file__).resolve().parents[1]
    seam = root / "platform" / "spotline" / "compat"
    found = []
    for folder in ("platform", "tests", "benchmarks", "jobs"):
        for path in sorted((root / folder).rglob("*.py")):
            if path.is_relative_to(seam):
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if _RAY_PRIVATE.search(line):
                    found.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert found == [], "use (or add) a function of spotline.compat.ray:\n" + "\n".join(found)


@pytest.mark.unit
def test_deepspeed_seam_of_the_pipeline_engine_and_the_groups() -> None:
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.pipe.schedule import ForwardPass

    seam = _deepspeed()
    table = dict(PipelineEngine._INSTRUCTION_MAP)
    engine = object.__new__(PipelineEngine)  # the class, never built: no engine starts
    assert seam.wrap_pipeline_instructions(engine, lambda cls, fn: (cls, fn))
    assert engine._INSTRUCTION_MAP[ForwardPass] == (ForwardPass, table[ForwardPass])
    assert table == PipelineEngine._INSTRUCTION_MAP  # the class keeps its own
    assert not seam.wrap_pipeline_instructions(SimpleNamespace(), lambda cls, fn: fn)

    seam.wrap_loss_reduction(engine, lambda reduce: lambda: ("reduced", reduce))
    said, reduce = engine._aggregate_total_loss()
    assert said == "reduced" and reduce.__func__ is PipelineEngine._aggregate_total_loss

    import deepspeed.comm.comm as dcomm
    from deepspeed.utils import groups

    dcomm.cdb, groups._WORLD_GROUP = object(), object()
    groups._EXPERT_PARALLEL_GROUP = {"ep": object()}
    constant = groups._DEVICE_MESH_SPLIT_UNSUPPORTED
    seam.forget_groups()
    assert dcomm.cdb is None and groups._WORLD_GROUP is None
    assert groups._EXPERT_PARALLEL_GROUP == {}
    assert constant == groups._DEVICE_MESH_SPLIT_UNSUPPORTED


# --- with Ray running, and with real engines -------------------------------------------


@pytest.mark.ray
def test_ray_seam_on_a_running_cluster(ray_session, tmp_path) -> None:
    import ray

    from spotline.compat import ray as seam

    node = ray.get_runtime_context().get_node_id()
    assert node in seam.free_resources_per_node()
    assert seam.draining_nodes(timeout_s=10) == {}
    address = ray.get_runtime_context().gcs_address
    assert seam.draining_nodes(10, seam.gcs_client(address)) == {}
    accepted, why = seam.drain_for_preemption("ff" * 28, "a node that is not there", 0.0)
    assert isinstance(accepted, bool) and isinstance(why, str)
    assert seam.draining_nodes(timeout_s=10) == {}  # nothing of this cluster drains

    (tmp_path / "mod").mkdir()
    (tmp_path / "mod" / "__init__.py").write_text("")
    env = seam.upload_py_modules_if_needed({"py_modules": [str(tmp_path / "mod")]})
    assert env["py_modules"][0].startswith("gcs://")
    env = seam.upload_working_dir_if_needed({"working_dir": str(tmp_path / "mod")})
    assert env["working_dir"].startswith("gcs://")

    assert seam.package_stored(env["working_dir"], address)
    assert seam.delete_package(env["working_dir"]) is True
    assert not seam.package_stored(env["working_dir"])

    coordinator = seam.autoscaling_coordinator()
    ray.get(seam.request_resources(coordinator, "spotline:seam-test", [{"CPU": 1.0}], 5.0))
    ray.get(seam.cancel_request(coordinator, "spotline:seam-test"))
    assert isinstance(seam.requested_resources(), list)

    assert (Path(seam.session_dir()) / "logs").is_dir()
    assert psutil.Process(seam.gcs_server_pid()).name().startswith("gcs_server")

    @ray.remote(num_cpus=0, concurrency_groups={"control": 1})
    class Probe:
        def __init__(self) -> None:
            self.marker = "probe-marker-1234"

    probe = Probe.remote()
    got = seam.call_on_actor(
        probe, lambda self, n: (self.marker, n), 3, concurrency_group="control"
    )
    assert ray.get(got) == ("probe-marker-1234", 3)
    assert b"probe-marker-1234" not in seam.gcs_actor_records()  # state, not arguments
    assert seam.remote_name(Probe).endswith("Probe")
    ray.kill(probe)


def _optimizer_seams(out) -> None:
    """In a process of its own: one-rank engines of each optimizer layout, and what the
    seam reads of each."""
    import deepspeed

    from spotline.train.process import Topology, init_distributed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed(Topology(1, 1, 0), "127.0.0.1", port)
    from spotline.compat import deepspeed as seam

    def engine(config: dict):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        optimizer = torch.optim.AdamW(model.parameters())  # as Spotline builds its own
        config = {"train_batch_size": 1, "zero_allow_untested_optimizer": True, **config}
        return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]

    seen = {}
    zero1 = engine({"zero_optimization": {"stage": 1}})
    flats = seam.flat_fp32_partitions(zero1.optimizer)
    fragments = [seam.hp_fragment(p) for p in zero1.module.parameters()]
    seen["hp"] = (
        len(flats),
        all(
            f is not None and f.hp_fragment.data_ptr() >= flats[f.param_group_index].data_ptr()
            for f in fragments
        ),
    )
    seen["hp_none"] = seam.hp_fragment(torch.ones(1)) is None
    zero3 = engine({"zero_optimization": {"stage": 3}})
    parts = seam.zero3_fp32_partitions(zero3.optimizer)
    ranks = {seam.zero3_partition_rank(zero3.optimizer, p) for p in zero3.module.parameters()}
    parts[0].data.fill_(0.5)
    seam.zero3_refresh_partitions(zero3.optimizer)
    first = next(iter(zero3.module.parameters()))
    seen["zero3"] = (len(parts), ranks, float(first.ds_tensor.view(-1)[0]))
    unfused = engine({"bf16": {"enabled": True}})
    copies = seam.unfused_fp32_copies(unfused.optimizer)
    seen["unfused"] = (
        len(copies),
        all(lp.dtype == torch.bfloat16 and hp.dtype == torch.float32 for lp, hp in copies),
        seam.flat_fp32_partitions(unfused.optimizer),
    )
    out.put(seen)


@pytest.mark.ray
def test_deepspeed_seam_reads_each_optimizer_layout() -> None:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_optimizer_seams, args=(out,), daemon=True)
    proc.start()
    try:
        while True:
            try:
                seen = out.get(timeout=1)
                break
            except queue.Empty:
                assert proc.is_alive(), f"the engines' process ended ({proc.exitcode})"
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert seen["hp"] == (1, True)
    assert seen["hp_none"]
    assert seen["zero3"] == (1, {0}, 0.5)
    assert seen["unfused"] == (4, True, None)
