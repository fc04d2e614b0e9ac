"""A pytest plugin: your job on a local cluster of simulated spot nodes, and the faults a
cloud brings, in your own test suite.

    # found by pytest once Spotline is installed (entry point `pytest11`: spotline)
    from spotline.testing import assert_exact_resume, assert_no_lost_commit

    def test_my_job_survives_a_notice(spot_cluster, tmp_path):
        run = spot_cluster.run(my_spec(tmp_path / "a"))
        spot_cluster.wait_for(run, lambda s: s["step"] >= 10, "ten steps")
        spot_cluster.notice(spot_cluster.node_of(run, rank=0), deadline=20)
        result = run.wait(verbose=False)
        reference = spot_cluster.run(my_spec(tmp_path / "b")).wait(verbose=False)
        assert_exact_resume(result, reference)
        assert_no_lost_commit(result, spot_cluster.faults)

`spot_cluster` is a `SpotCluster`: an on-demand head and `nodes` spot nodes on
127.0.0.1, started once per test module and reset to its fresh nodes before each test.
Override the `spot_cluster_config` fixture to change its shape. The fixture disconnects
the test process from any Ray cluster it was connected to; it stops only the processes
it started.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from spotline.chaos.verdict import DEFAULT_TOLERANCE, Applied, first_difference, lost_commits


@dataclass
class SpotClusterConfig:
    """The shape of the test cluster."""

    nodes: int = 2
    """Spot nodes at the start of each test."""
    slots: int = 2
    """Units of `spot_gpu` per node: the workers one node holds (a replica's stages)."""
    cpus: float = 2.0
    """Logical CPUs per spot node."""
    dashboard: bool = False
    """Ray's dashboard (its state API, `ray.util.state`) on a free loopback port."""
    worker_env: dict[str, str] = field(default_factory=dict)
    """Environment variables for every worker the jobs start."""


@dataclass
class Fault:
    """A notice or loss the test brought, and where each running job stood then."""

    kind: str
    node: int
    node_id: str
    t: float
    jobs: dict[str, Applied] = field(default_factory=dict)
    """Job name -> the job at that moment (its running group, newest commit)."""


class SpotCluster:
    """A local spot cluster with the faults of `spotline.chaos.cluster.LocalSpotCluster`
    and the jobs the test runs on it."""

    def __init__(self, config: SpotClusterConfig) -> None:
        from spotline.chaos.cluster import LocalSpotCluster, SpotNodeShape

        self.config = config
        self.cluster = LocalSpotCluster(
            config.nodes,
            SpotNodeShape(slots=config.slots, cpus=config.cpus),
            dashboard=config.dashboard,
            worker_env=dict(config.worker_env),
        )
        self.runs: list[Any] = []
        self.faults: list[Fault] = []
        self.changes: list[str] = []
        """What the latest `run` changed in its spec to run here."""

    # --- the cloud ----------------------------------------------------------------------------

    @property
    def nodes(self) -> list[int]:
        """The spot nodes up now, by number (0.. at the start; a join takes the next)."""
        return self.cluster.live()

    def notice(self, node: int, deadline: float) -> str:
        """A preemption notice for spot node `node`: Ray drains it, and it goes
        `deadline` seconds later. Returns its Ray node id."""
        fault = self._fault("notice", node)
        self.cluster.notice(node, deadline)
        return fault.node_id

    def lose(self, node: int) -> str:
        """Spot node `node` vanishes with every process on it, without notice."""
        fault = self._fault("loss", node)
        self.cluster.lose(node)
        return fault.node_id

    def join(self) -> int:
        """A fresh spot node joins; returns its number."""
        return self.cluster.join()

    def node_id(self, node: int) -> str:
        return self.cluster.node_id(node)

    # --- jobs -----------------------------------------------------------------------------------

    def run(self, spec: Any, adapt: bool = True) -> Any:
        """Start the job of `spec` (a JobSpec or a spec dict) on the spot nodes; its
        `spotline.JobRun`. With `adapt` (as `spotline chaos` does), its workers compute
        on CPU with one `spot_gpu` each and read notices from Ray's drain (added when the
        spec has no notice source); `changes` says what changed."""
        import spotline
        from spotline.chaos.adapt import adapt as adapted
        from spotline.config import load_spec

        if isinstance(spec, dict):
            spec = load_spec(spec)
        if adapt:
            a = adapted(
                spec,
                name=spec.name,
                checkpoint_uri=spec.checkpoint.uri,
                staging_dir=spec.checkpoint.staging_dir,
                notices="drain",
            )
            spec, self.changes = a.spec, a.changes
        run = spotline.Job(spec).start()
        self.runs.append(run)
        return run

    def wait_for(self, run: Any, pred, what: str, timeout: float = 300.0) -> dict[str, Any]:
        """`run`'s status once `pred(status)` holds (see the module's `wait_for`)."""
        return wait_for(run, pred, what, timeout)

    def node_of(self, run: Any, rank: int) -> int:
        """The number of the spot node `rank` of `run` is on now."""
        st = run.status()
        node_id = next((w["node_id"] for w in st["workers"] if w["rank"] == rank), None)
        if node_id is None:
            raise AssertionError(f"rank {rank} of {run.spec.name} is not running now")
        return self.cluster.number(node_id)

    def reset(self, nodes: int | None = None) -> None:
        """Exactly `nodes` (default: the config's) fresh spot nodes; forget the faults."""
        for run in self.runs:
            _end(run)
        self.runs.clear()
        self.faults.clear()
        self.cluster.reset(self.config.nodes if nodes is None else nodes)

    def close(self) -> None:
        for run in self.runs:
            _end(run)
        self.cluster.close()

    def _fault(self, kind: str, node: int) -> Fault:
        import ray

        node_id = self.cluster.node_id(node)
        fault = Fault(kind, node, node_id, time.time())
        for run in self.runs:
            try:
                st = run.status()
                result = ray.get(run.controller.result.remote())
            except Exception:  # noqa: BLE001 - a job that ended has no controller left
                continue
            running = st["state"] == "running" and bool(st["workers"])
            fault.jobs[run.spec.name] = Applied(
                at=0.0,
                t=fault.t,
                kind=kind,
                node=node,
                node_id=node_id,
                step=st["step"] or 0,
                committed=max(st["committed_steps"] or [0]) or None,
                attempt=len(result["attempts"]) - 1 if running and result["attempts"] else None,
                hit=node_id in {w["node_id"] for w in st["workers"] or []},
            )
        self.faults.append(fault)
        return fault


def _end(run: Any) -> None:
    """Stop a job the test left running (its controller may be gone already)."""
    import contextlib

    import ray

    with contextlib.suppress(Exception):
        if run.status()["state"] not in ("finished", "failed", "stopped"):
            ray.kill(run.controller)


def wait_for(run: Any, pred, what: str, timeout: float = 300.0) -> dict[str, Any]:
    """`run`'s status once `pred(status)` holds. AssertionError naming `what`, with the
    job's last status and latest events, when the job ends first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    st: dict[str, Any] = {}
    while time.monotonic() < deadline:
        st = run.status()
        if pred(st):
            return st
        if st["state"] in ("finished", "failed", "stopped"):
            break
        time.sleep(0.2)
    brief = {k: st.get(k) for k in ("state", "step", "replicas", "committed_steps", "error")}
    brief["events"] = st.get("events", [])[-25:]
    ended = st.get("state") in ("finished", "failed", "stopped")
    why = "the job ended before" if ended else f"timed out after {timeout:.0f}s waiting for"
    raise AssertionError(f"{why} {what}; last status: {brief}")


# --- assertions ---------------------------------------------------------------------------------


def assert_exact_resume(
    result: Any, reference: Any, tolerance: float = DEFAULT_TOLERANCE, upto: int | None = None
) -> None:
    """Every step `result` trained (the loss of the group that trained it last) has the
    loss of the uninterrupted `reference`, within `tolerance` relative; `upto`: only
    the steps up to it (default: every step both trained). Where `result` trained at
    another replica count than `reference`, the comparison is `spotline chaos`'s (see
    `spotline.chaos.verdict.first_difference`)."""
    got = {int(k): v for k, v in result.losses.items()}
    want = {int(k): v for k, v in reference.losses.items()}
    diff = first_difference(got, want, upto, tolerance, result.attempts, reference.attempts)
    assert diff.compared, f"{result.name}: no step in common with {reference.name}"
    if diff.first is not None:
        group = next(
            (a for a in result.attempts if any(s == diff.first for s, _ in a.get("losses") or [])),
            {},
        )
        raise AssertionError(
            f"{result.name} is not an exact resume: step {diff.first} has loss {diff.got!r}, "
            f"{diff.against} {diff.want!r} (group {group.get('attempt')!r}, resumed "
            f"from step {group.get('restored_from')} via {group.get('restored_via') or '-'})"
        )


def assert_no_lost_commit(result: Any, faults: list[Fault]) -> None:
    """After each fault the test brought, `result`'s next group resumed from the newest
    step committed before it, or a newer one: no committed step was lost."""
    applied = [f.jobs[result.name] for f in faults if result.name in f.jobs]
    lost = lost_commits(result.attempts, applied)
    assert not lost, f"{result.name} lost committed steps: " + "; ".join(lost)


# --- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spot_cluster_config() -> SpotClusterConfig:
    """The test cluster's shape; override this fixture to change it."""
    return SpotClusterConfig()


@pytest.fixture(scope="module")
def spot_cluster_shared(spot_cluster_config: SpotClusterConfig):
    """One cluster for the tests of a module: its start-up is the slow part."""
    import ray

    ray.shutdown()
    cluster = SpotCluster(spot_cluster_config)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def spot_cluster(spot_cluster_shared: SpotCluster) -> SpotCluster:
    """The module's spot cluster with its fresh nodes, no faults and no jobs."""
    spot_cluster_shared.reset()
    return spot_cluster_shared
