"""Replicas started ahead (`spotline.runtime.standby`) are checked alive when the next
group takes them: a dead or silent one is dropped and said, never handed over."""

from __future__ import annotations

import time

import pytest

from spotline import constants
from spotline.config import load_spec
from spotline.runtime.standby import Standby
from spotline.runtime.starter import ReplicaStart

pytestmark = pytest.mark.ray


def test_a_dead_or_silent_replica_started_ahead_is_dropped_with_its_node_named(
    ray_session, monkeypatch
):
    import ray

    class _Rank:
        """A rank's actor: answers `info` as a `TrainWorker` does, or hangs (defined
        here, so that Ray ships it by value)."""

        def __init__(self, silent: bool = False) -> None:
            self.silent = silent

        def info(self) -> dict:
            if self.silent:
                time.sleep(3600)  # a wedged process: alive, but it answers nothing
            return {"rank": 0}

    monkeypatch.setattr(constants, "SPOTLINE_STANDBY_CHECK_TIMEOUT_S", 2.0)
    rank = ray.remote(_Rank).options(num_cpus=0)
    live, killed, silent = rank.remote(), rank.remote(), rank.remote(silent=True)
    ray.get([live.info.remote(), killed.info.remote()])
    ray.kill(killed, no_restart=True)
    spec = load_spec({"name": "standby-check"})
    standby = Standby(spec, store=None)
    standby._replicas = [
        ReplicaStart(
            spec,
            None,
            "cpu",
            [],
            "",
            name,
            None,
            actors=[actor],
            infos=[{"node_id": node}],
            phase="ready",
        )  # fmt: skip
        for name, actor, node in (
            ("standby-live", live, "a" * 56),
            ("standby-killed", killed, "b" * 56),
            ("standby-silent", silent, "c" * 56),
        )
    ]
    taken = standby.take(avoid=set())
    assert [s.actors for s in taken] == [[live]]
    assert len(standby.failures) == 2
    dead, wedged = standby.failures
    assert dead.startswith(f"replica standby-killed started ahead on node {'b' * 12} is not alive")
    assert "worker process died" in dead
    assert wedged.startswith(
        f"replica standby-silent started ahead on node {'c' * 12} is not alive (no answer"
    )
    # The dropped ones are ended, the taken one is the next group's.
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(silent.info.remote(), timeout=60)
    assert ray.get(live.info.remote()) == {"rank": 0}
    ray.kill(live)
