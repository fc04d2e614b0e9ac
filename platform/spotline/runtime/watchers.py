"""The per-node watcher as a Ray actor: `spotline:<job>:watcher:<node>` on the dashboard.

One actor is pinned to every node. It polls the job's notice sources that ask about
the node it runs on (cloud metadata, Ray's drain; SIGTERM is watched by the worker
processes themselves) and pushes each new notice to the controller actor.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from spotline import constants
from spotline.preemption.sources import Notice, make_source
from spotline.preemption.watcher import NoticeWatcher
from spotline.runtime.sealed import SealedJob

log = logging.getLogger("spotline.preemption")

NODE_WATCHED_KINDS = ("aws", "gcp", "azure", "ray-drain")
"""Source kinds a node watcher polls; 'sigterm' is installed in each worker process."""


def watcher_name(job: str, node_id: str) -> str:
    # The whole id: node ids may share a long prefix (a provider's own numbering), and
    # a watcher found by name is taken for a stale one and replaced.
    return f"spotline:{job}:watcher:{node_id}"


class NodeWatcherActor:
    def __init__(self, job: SealedJob, node_id: str, controller: Any):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
        spec = job.open_spec()
        self.node_id = node_id
        self.controller = controller
        sources = [
            make_source(s, node_id=node_id)
            for s in spec.preemption.sources
            if s.kind in NODE_WATCHED_KINDS
        ]
        self.watcher = NoticeWatcher(sources, self._deliver, name=f"spotline-watch-{node_id[:8]}")
        self.watcher.start()

    def _deliver(self, notice: Notice) -> bool:
        """True once the controller accepted it; the watcher re-sends until then (the
        controller dedupes). Bounded: a controller that does not answer is retried."""
        import ray

        try:
            ref = self.controller.notify.remote(dataclasses.asdict(notice))
            return bool(ray.get(ref, timeout=constants.SPOTLINE_NOTICE_ACK_TIMEOUT_S))
        except Exception as e:  # noqa: BLE001 - not delivered: the watcher tries again
            log.warning(
                "notice for node %s not acknowledged yet (%s); re-sending", self.node_id[:12], e
            )
            return False

    def notices(self) -> list[dict[str, Any]]:
        return [dataclasses.asdict(n) for n in self.watcher.notices]

    def stop(self) -> None:
        self.watcher.stop()
