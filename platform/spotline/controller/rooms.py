"""The controller's rooms that keep a book or a figure, built and wired once.

`build_rooms` makes them around one event log and one clock (`clock.Clock`): the
commit coordinator (the only owner of storage), peer recovery, telemetry and its pace,
the health book and cordons, the JIT book, the partition book, the artifacts, the
bubble book and the backfill door. The controller holds each of them (`Controller`)
and composes the parts that act (`Fleet`, `Growth`, `Intake`, `Departures`, `Door`)
from them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from spotline import constants
from spotline.bubbles.book import BubbleBook
from spotline.checkpoint.coordinator import CommitCoordinator
from spotline.config.schema import JobSpec
from spotline.controller.artifacts import Artifacts
from spotline.controller.backfill_api import BackfillAPI
from spotline.controller.clock import Clock
from spotline.controller.cordons import Cordons
from spotline.controller.events import Events
from spotline.controller.health import HealthBook
from spotline.controller.inbox import Inbox
from spotline.controller.notices import JitBook, JitPolicy
from spotline.controller.recovery import PeerRecovery
from spotline.controller.repartition import PartitionBook
from spotline.controller.snapshot import Record
from spotline.controller.telemetry import Telemetry
from spotline.runtime.cluster import ClusterView
from spotline.runtime.demand import Demand
from spotline.runtime.faults import refusal
from spotline.runtime.progress import Backfill


@dataclass
class Rooms:
    events: Events
    inbox: Inbox
    rec: Record
    coordinator: CommitCoordinator
    recovery: PeerRecovery
    telemetry: Telemetry
    health: HealthBook
    jit: JitBook
    partitions: PartitionBook
    artifacts: Artifacts
    cordons: Cordons
    bubbles: BubbleBook | None
    backfill_api: BackfillAPI


def build_rooms(
    spec: JobSpec,
    store: Any,
    cluster: ClusterView,
    clock: Clock,
    demand: Demand | None,
    peers: Any,
    backfill: Backfill | None,
) -> Rooms:
    events = Events()
    say = events.say
    coordinator = CommitCoordinator(spec, store, say, wall=clock.wall)
    if demand is not None:
        demand.bind(say)  # its failures are warnings: the job trains on
    tel = Telemetry(spec, say, clock.wall, checkpoint_uri=store.uri)
    health = HealthBook(spec, say, tel.metrics)
    artifacts = Artifacts(spec, coordinator, say)
    policy = JitPolicy(constants.SPOTLINE_JIT_MARGIN_S)
    backfill_api = BackfillAPI(backfill, tel)
    if backfill is not None:
        backfill.bind(say, backfill_api.on_result)
        coordinator.pinned = backfill.pinned_steps
    refused = refusal(spec)  # a test's faults in a job not marked as a test
    if refused is not None:
        say(refused, logging.WARNING)
    pp = spec.parallel.pipeline_stages
    return Rooms(
        events=events,
        inbox=Inbox(),
        rec=Record(started_at=clock.wall()),
        coordinator=coordinator,
        recovery=PeerRecovery(spec, peers, say),  # peers: the state keepers
        telemetry=tel,
        health=health,
        jit=JitBook(
            spec, policy, tel.pace, tel.fig, say, constants.SPOTLINE_POLL_INTERVAL_S, clock
        ),
        partitions=PartitionBook(spec, say),
        artifacts=artifacts,
        cordons=Cordons(spec, health, cluster, coordinator, artifacts, demand, say, clock),
        bubbles=BubbleBook(pp) if pp > 1 else None,
        backfill_api=backfill_api,
    )
