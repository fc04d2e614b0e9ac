"""`spotline chaos` end to end, and the pytest plugin users import, on local multi-node
clusters (`ray.cluster_utils.Cluster`).

The command line starts a cluster of its own; the rest share one cluster through the
plugin's `spot_cluster` fixture, as a user's suite would.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import init_local_ray, tiny_spec
from spotline.cli import main
from spotline.testing import SpotClusterConfig

pytestmark = pytest.mark.chaos

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")


@pytest.fixture(scope="module", autouse=True)
def _local_ray_back_after():
    """These tests take the process off the suite's local Ray cluster; put one back."""
    import ray

    had = ray.is_initialized()
    ray.shutdown()
    yield
    if had:
        init_local_ray()


# What a user's suite would set for its jobs' workers (here, a variable they ignore).
_WORKER_ENV = {"HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def spot_cluster_config() -> SpotClusterConfig:
    return SpotClusterConfig(worker_env=_WORKER_ENV)


def test_quickstart_under_the_gentle_trace_passes_with_exact_resume(tmp_path, capsys):
    out, figures = tmp_path / "report", tmp_path / "chaos.json"
    code = main(
        [
            "chaos",
            QUICKSTART,
            "--trace",
            "gentle",
            "--duration",
            "40",
            "--out",
            str(out),
            "--json",
            str(figures),
        ]
    )
    printed = capsys.readouterr().out
    f = json.loads(figures.read_text())
    assert code == 0, (f["reasons"], printed[-3000:])
    assert f["verdict"] == "PASS" and f["exact_resume"] is True
    assert f["first_differing_step"] is None and f["committed_steps"] > 0
    assert f["goodput"] > 0
    kinds = [e["kind"] for e in f["events"]]
    assert kinds == ["notice", "gone", "join"], f["events"]
    # The job's total is its events' own; a notice answered by a commit loses nothing.
    assert f["steps_lost"] == sum(e["steps_lost"] for e in f["events"]), f["events"]
    assert f["events"][0]["steps_lost"] == 0, f["events"]
    assert all("at" in e and "steps_lost" in e for e in f["events"])
    # quickstart has no notice source: the report says what its notice cost.
    assert any("preemption.sources is empty" in s for s in f["settings"]), f["settings"]
    assert "# PASS: quickstart under trace gentle" in printed
    for name in ("verdict.md", "events.log", "timeline.png", "chaos.json", "device_time.png"):
        assert (out / name).is_file(), name
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "trace: notice at" in (out / "events.log").read_text()
    (out / "timeline.png").unlink()
    assert main(["report", str(out)]) == 0  # the directory opens again
    assert (out / "timeline.png").is_file()


# --- on the plugin's shared cluster ---------------------------------------------------------

_ELASTIC = {
    # One stage: what these rehearsals check (the data's purity, the work a loss costs)
    # does not depend on the pipeline, and a one-rank replica starts in half the time.
    "parallel.pipeline_stages": 1,
    "elastic.min_replicas": 1,
    "elastic.max_replicas": 2,
    "train.steps": 5000,  # the trace's end stops it
}
_LOSS_TRACE = {
    "about": "node 1 lost without notice",
    "duration_s": 20,
    "events": [{"at": 8, "kind": "loss", "node": 1}],
}

_DRIFTING = '''
"""A data source that reads on from a cursor of its own, as a streaming loader does:
batch k is not a function of (seed, k), so a resumed group draws other tokens."""
from spotline.data.streams import ArrayStream
from spotline.data.text import TextDataset


class _Drifting(ArrayStream):
    calls = 0

    def rows(self, starts, length):
        type(self).calls += 1
        return super().rows((starts + type(self).calls) % (self.size - length), length)


class DriftingText(TextDataset):
    def __init__(self, spec, tokenizer=None, **kwargs):
        super().__init__(spec, tokenizer, **kwargs)
        self.train = _Drifting(self.train.tokens)
'''


def _rehearse(spot_cluster, spec, tmp_path: Path) -> dict:
    from spotline.chaos import run_chaos

    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(_LOSS_TRACE))
    return run_chaos(spec, str(trace), tmp_path / "report", cluster=spot_cluster.cluster)


def test_a_data_source_that_is_not_a_pure_function_of_the_step_is_not_exactly_resumable(
    spot_cluster, tmp_path
):
    user = tmp_path / "project"
    user.mkdir()
    (user / "chaos_data.py").write_text(_DRIFTING)
    spec = tiny_spec(
        tmp_path,
        "drifting",
        **_ELASTIC,
        **{"data.kind": "chaos_data:DriftingText", "runtime_env.working_dir": str(user)},
    )
    f = _rehearse(spot_cluster, spec, tmp_path)
    assert f["verdict"] == "FAIL" and f["exact_resume"] is False
    assert f["not_exactly_resumable"] is True and f["data_pure"] is False
    # The first step the group after the loss trained: it drew other tokens.
    resumed = next(a["restored_from"] for a in f["attempts"] if a["restored_from"] is not None)
    assert f["first_differing_step"] == resumed + 1, f["attempts"]
    (reason,) = f["reasons"]
    assert f"not exactly resumable: step {resumed + 1}" in reason
    assert "not a pure function of the step" in reason and "chaos_data:DriftingText" in reason


def test_a_checkpoint_interval_far_above_the_loss_spacing_reports_the_lost_work(
    spot_cluster, tmp_path
):
    spec = tiny_spec(
        tmp_path,
        "sparse-commits",
        **_ELASTIC,
        **{"checkpoint.interval_steps": 10_000, "recovery.peer_snapshots": False},
    )
    f = _rehearse(spot_cluster, spec, tmp_path)
    (loss,) = [e for e in f["events"] if e["kind"] == "loss"]
    assert loss["hit"] and loss["restored_from"] == 0 and loss["steps_lost"] > 0
    assert f["steps_lost"] == loss["steps_lost"]
    line = next(s for s in f["settings"] if s.startswith("checkpoint.interval_steps 10000"))
    assert f"{loss['steps_lost']} step(s) were lost" in line
    assert "recovery.peer_snapshots: true would lose at most k steps" in line
    assert "commit more often: checkpoint.interval_steps" in line
    assert f["exact_resume"] is True and f["verdict"] == "PASS", f["reasons"]


def _user_spec(tmp: Path, name: str) -> dict:
    """A user's small job, as a spec dict: two stages, one or two replicas."""
    return {
        "name": name,
        "model": {"n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 32},
        "data": {"max_bytes": 300_000},
        "parallel": {"pipeline_stages": 2, "micro_batches": 2},
        "elastic": {"min_replicas": 1, "max_replicas": 2},
        "train": {"steps": 40, "global_batch_size": 8, "warmup_steps": 5},
        "checkpoint": {
            "uri": f"file://{tmp}/ckpt",
            "interval_steps": 10,
            "staging_dir": str(tmp / "staging"),
        },
    }


def test_the_plugin_alone_rehearses_a_notice(spot_cluster, tmp_path):
    """Written as a user's suite would, with the public fixture and helpers only."""
    from spotline.testing import assert_exact_resume, assert_no_lost_commit

    run = spot_cluster.run(_user_spec(tmp_path / "a", "plugin"))
    spot_cluster.wait_for(run, lambda s: s["replicas"] == 2 and s["step"] >= 5, "training")
    spot_cluster.notice(spot_cluster.node_of(run, rank=2), deadline=20)
    result = run.wait(verbose=False)
    assert result.state == "finished" and len(result.notices) == 1
    assert result.notices[0]["outcome"] == "just-in-time checkpoint committed"
    spot_cluster.join()  # the uninterrupted run gets both replicas
    reference = spot_cluster.run(_user_spec(tmp_path / "b", "plugin-ref")).wait(verbose=False)
    assert_exact_resume(result, reference)
    assert_no_lost_commit(result, spot_cluster.faults)
    assert any("ray-drain" in c for c in spot_cluster.changes)


def test_the_worker_env_reaches_the_processes_of_every_node(spot_cluster):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def env() -> dict[str, str | None]:
        return {k: os.environ.get(k) for k in _WORKER_ENV}

    nodes = [spot_cluster.node_id(n) for n in spot_cluster.nodes]
    nodes.append(ray.get_runtime_context().get_node_id())  # the head's
    seen = ray.get(
        [
            env.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
            for n in nodes
        ]
    )
    assert seen == [_WORKER_ENV] * len(nodes)
