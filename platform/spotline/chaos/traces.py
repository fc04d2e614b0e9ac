"""Spot traces: what the cloud does to a cluster over a run, as timed events on nodes.

A trace is a list of events on the spot nodes of a cluster, numbered from 0:

    notice  the node gets a preemption notice with `deadline_s` seconds to go (Ray's
            GCS drain, what the autoscaler and KubeRay do on a cloud's notice); it goes
            when the deadline passes
    loss    the node vanishes with no notice, every process on it at once
    join    a fresh spot node joins; it takes the next number

Times (`at`) are seconds from the job's first training step. A trace with `span_s`
gives its times as positions in a span of that many seconds, stretched or shrunk to
the run's duration; notice deadlines are never scaled (a cloud's notice is as long
as it is, whatever the run lasts).

Built-in traces (`BUILTIN`) are written for any number of nodes and scaled to the
duration. A user's trace is JSON (or YAML) in the schema of docs/guide/chaos.md;
`load_trace` refuses a bad one at load, naming the event and the fix.

Pure data and checks: nothing here starts or touches a cluster.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotline.config import SpecError

KINDS = ("notice", "loss", "join")
_EVENT_FIELDS = {
    "notice": {"at", "kind", "node", "deadline_s"},
    "loss": {"at", "kind", "node"},
    "join": {"at", "kind"},
}
MIN_DURATION_S = 30.0
_TRACE_FIELDS = {"name", "about", "nodes", "duration_s", "span_s", "events"}


class TraceError(SpecError):
    """A trace that cannot be replayed: the message names the event and the fix."""


@dataclass(frozen=True)
class Event:
    at: float
    """Seconds from the job's first step."""
    kind: str
    """'notice', 'loss', 'join', or 'gone' (a noticed node's deadline passing)."""
    node: int
    """The node's number: 0..nodes-1 at the start, then one more per join."""
    deadline_s: float | None = None
    index: int | None = None
    """Its place in the trace's events (None for 'gone', which the trace implies)."""

    def describe(self) -> str:
        if self.kind == "notice":
            return f"notice at {self.at:g}s for node {self.node}, deadline {self.deadline_s:g}s"
        if self.kind == "join":
            return f"join at {self.at:g}s (node {self.node})"
        if self.kind == "gone":
            return f"node {self.node} goes at {self.at:g}s (its notice's deadline)"
        return f"loss at {self.at:g}s of node {self.node}, without notice"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"at": round(self.at, 3), "kind": self.kind, "node": self.node}
        if self.deadline_s is not None:
            out["deadline_s"] = self.deadline_s
        return out


@dataclass(frozen=True)
class Trace:
    name: str
    about: str
    nodes: int
    """Spot nodes at the start."""
    duration_s: float
    """How long the run lasts, from the job's first step."""
    events: list[Event] = field(default_factory=list)

    def timeline(self) -> list[Event]:
        """The events in the order they land, with each noticed node's going."""
        gone = [
            Event(e.at + (e.deadline_s or 0.0), "gone", e.node)
            for e in self.events
            if e.kind == "notice"
        ]
        return sorted([*self.events, *gone], key=lambda e: (e.at, e.kind == "join"))

    def count(self, kind: str) -> int:
        return sum(e.kind == kind for e in self.events)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "about": self.about,
            "nodes": self.nodes,
            "duration_s": self.duration_s,
            "events": [e.to_dict() for e in self.events],
        }


# --- built-in traces ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Step:
    """One event of a built-in trace: at a fraction of the duration (or of the time left
    before a notice's node must be gone), on the newest or oldest live node(s)."""

    at: float
    kind: str
    pick: str = "newest"  # 'newest' or 'oldest' live node
    deadline: float | None = None  # seconds (a cloud's notice), or a fraction of duration
    scaled_deadline: bool = False
    count: int = 1  # how many nodes at once (notices of one capacity reclaim)


@dataclass(frozen=True)
class Builtin:
    name: str
    about: str
    default_duration_s: float
    steps: tuple[_Step, ...]
    min_duration_s: float = 0.0

    def build(self, nodes: int, duration_s: float) -> Trace:
        if duration_s < self.min_duration_s:
            raise TraceError(
                f"--duration {duration_s:g}: trace {self.name!r} needs at least "
                f"{self.min_duration_s:g}s (its notices are the cloud's own length); raise "
                "--duration or pick a shorter trace (gentle, stormy)"
            )
        live = list(range(nodes))
        joined = nodes
        raw: list[dict[str, Any]] = []
        for s in self.steps:
            deadline = (
                None
                if s.deadline is None
                else s.deadline * duration_s
                if s.scaled_deadline
                else s.deadline
            )
            # A notice lands early enough that its node is gone within the duration.
            room = duration_s - (deadline or 0.0) if s.kind == "notice" else duration_s
            at = round(s.at * room, 2)
            if s.kind == "join":
                raw.append({"at": at, "kind": "join"})
                live.append(joined)
                joined += 1
                continue
            if not live:
                continue  # nothing left to take: the storm passes over an empty pool
            victims = live[-s.count :] if s.pick == "newest" else live[: s.count]
            for v in victims:
                live.remove(v)
                event = {"at": at, "kind": s.kind, "node": v}
                if s.kind == "notice":
                    event["deadline_s"] = round(deadline or 0.0, 2)
                raw.append(event)
        return check_trace(
            {"name": self.name, "about": self.about, "nodes": nodes, "events": raw},
            f"trace {self.name}",
            nodes,
            duration_s,
        )


BUILTIN: dict[str, Builtin] = {
    b.name: b
    for b in (
        Builtin(
            "gentle",
            "one notice with a comfortable deadline, then a fresh node joins",
            60.0,
            (_Step(0.25, "notice", deadline=0.2, scaled_deadline=True), _Step(0.6, "join")),
        ),
        Builtin(
            "stormy",
            "three notices (one with a short deadline), a node lost without notice, and "
            "fresh nodes joining between them",
            120.0,
            (
                _Step(0.12, "notice", deadline=0.1, scaled_deadline=True),
                _Step(0.3, "join"),
                _Step(0.4, "loss", pick="oldest"),
                _Step(0.5, "join"),
                _Step(0.65, "notice", deadline=0.04, scaled_deadline=True),
                _Step(0.75, "join"),
                _Step(0.9, "notice", deadline=0.08, scaled_deadline=True),
            ),
        ),
        Builtin(
            "aws-2min",
            "AWS EC2 Spot: a two-minute interruption notice (IMDS spot/instance-action). "
            "EC2 reclaims capacity by pool, so an interruption can reach several instances "
            "of the pool together; replacement capacity comes back later. Rebalance "
            "recommendations are not replayed. The pattern is scaled to the duration; "
            "the notice keeps its 120 s",
            420.0,
            (
                _Step(0.1, "notice", deadline=120.0),
                _Step(0.35, "join"),
                _Step(0.75, "notice", deadline=120.0, count=2),
                _Step(0.75, "join"),
                _Step(0.9, "join"),
            ),
            min_duration_s=360.0,
        ),
        Builtin(
            "gcp-30s",
            "Google Cloud Spot VMs: a 30-second preemption notice (ACPI soft off; metadata "
            "instance/preempted). Compute Engine may preempt at any time, often several VMs "
            "of a zone close together, and capacity returns later. The pattern is scaled "
            "to the duration; the notice keeps its 30 s",
            150.0,
            (
                _Step(0.2, "notice", deadline=30.0),
                _Step(0.3, "notice", deadline=30.0, pick="oldest"),
                _Step(0.6, "join"),
                _Step(0.7, "join"),
                _Step(0.9, "notice", deadline=30.0),
            ),
            min_duration_s=120.0,
        ),
        Builtin(
            "azure-30s",
            "Azure Spot VMs: a Preempt scheduled event at least 30 seconds ahead. Azure "
            "evicts for capacity or when the price passes your max price, which can take "
            "several VMs of a scale set at once; capacity returns later. The pattern is "
            "scaled to the duration; the notice keeps its 30 s",
            150.0,
            (
                _Step(0.35, "notice", deadline=30.0, count=2),
                _Step(0.6, "join"),
                _Step(0.7, "join"),
                _Step(0.95, "notice", deadline=30.0),
            ),
            min_duration_s=120.0,
        ),
    )
}


# --- loading and checking ------------------------------------------------------------------


def load_trace(
    name_or_path: str, nodes: int | None, duration_s: float | None, default_nodes: int
) -> Trace:
    """A built-in trace by name, or a user's JSON/YAML trace file, checked against a
    cluster of `nodes` spot nodes (None: the trace's own `nodes`, else `default_nodes`)
    and a run of `duration_s` (None: the trace's own)."""
    if name_or_path in BUILTIN:
        b = BUILTIN[name_or_path]
        return b.build(nodes or default_nodes, duration_s or b.default_duration_s)
    path = Path(name_or_path)
    if not path.is_file():
        close = difflib.get_close_matches(name_or_path, BUILTIN, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise TraceError(
            f"--trace {name_or_path!r} is neither a built-in trace nor a file; {hint}"
            f"built-in traces: {', '.join(BUILTIN)}; or give a JSON trace file "
            "(docs/guide/chaos.md)"
        )
    raw = _read(path)
    n = nodes or raw.get("nodes") or default_nodes
    return check_trace(raw, str(path), n, duration_s)


def _read(path: Path) -> dict[str, Any]:
    text = path.read_text()
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            raw = yaml.safe_load(text)
        else:
            raw = json.loads(text)
    except (ValueError, ImportError) as e:  # json and yaml errors are ValueErrors
        first = str(e).splitlines()[0]
        raise TraceError(f"{path}: not valid JSON/YAML ({first}); fix the file") from None
    if not isinstance(raw, dict):
        raise TraceError(f'{path}: a trace is an object with "events"; see docs/guide/chaos.md')
    return raw


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_trace(raw: dict[str, Any], where: str, nodes: int, duration_s: float | None) -> Trace:
    """The trace `raw` (its dict form) for a cluster of `nodes` spot nodes and a run of
    `duration_s` seconds (None: the trace's own duration_s); TraceError naming the first
    event (or field) that cannot be replayed, and the fix."""
    unknown = set(raw) - _TRACE_FIELDS
    if unknown:
        key = sorted(unknown)[0]
        close = difflib.get_close_matches(key, _TRACE_FIELDS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise TraceError(
            f"{where}: unknown field {key!r}; {hint}fields: {', '.join(sorted(_TRACE_FIELDS))}"
        )
    if not isinstance(nodes, int) or nodes < 1:
        raise TraceError(f"{where}: nodes is {nodes!r}; give a whole number of spot nodes >= 1")
    events = raw.get("events")
    if not isinstance(events, list) or not events:
        raise TraceError(f'{where}: "events" must be a non-empty list of events')
    duration = duration_s if duration_s is not None else raw.get("duration_s")
    span = raw.get("span_s")
    if span is not None and (not _number(span) or span <= 0):
        raise TraceError(f"{where}: span_s {span!r} must be a number of seconds > 0")
    if duration is None:
        duration = span or _natural_duration(events)
    if not _number(duration) or duration <= 0:
        raise TraceError(f"{where}: duration {duration!r} must be a number of seconds > 0")
    scale = float(duration) / span if span else 1.0
    checked = [_check_event(e, i, where, scale, float(duration)) for i, e in enumerate(events)]
    checked.sort(key=lambda e: (e.at, e.index))
    _check_nodes(checked, where, nodes)
    name = raw.get("name") or Path(where).stem
    return Trace(str(name), str(raw.get("about") or ""), nodes, float(duration), checked)


def _natural_duration(events: list[Any]) -> float:
    """A trace without a duration lasts until its last event (a notice's node gone)
    and a quarter more, at least `MIN_DURATION_S`, so the job is seen after it."""
    ends = [
        float(e.get("at", 0)) + float(e.get("deadline_s") or 0)
        for e in events
        if isinstance(e, dict) and _number(e.get("at")) and _number(e.get("deadline_s") or 0)
    ]
    return max(MIN_DURATION_S, 1.25 * max(ends, default=0.0))


def _check_event(e: Any, i: int, where: str, scale: float, duration: float) -> Event:
    at_where = f"{where}: events[{i}]"
    if not isinstance(e, dict):
        raise TraceError(
            f'{at_where} is not an object like {{"at": 30, "kind": "loss", "node": 0}}'
        )
    kind = e.get("kind")
    if kind not in KINDS:
        raise TraceError(f"{at_where}: kind {kind!r}; give one of {', '.join(KINDS)}")
    extra = set(e) - _EVENT_FIELDS[kind]
    if extra:
        raise TraceError(
            f"{at_where} ({kind}): unknown field {sorted(extra)[0]!r}; a {kind} takes "
            f"{', '.join(sorted(_EVENT_FIELDS[kind]))}"
        )
    at = e.get("at")
    if not _number(at) or at < 0:
        raise TraceError(f"{at_where} ({kind}): at {at!r} must be seconds >= 0 from the first step")
    at = float(at) * scale
    node = e.get("node", -1)
    if kind != "join" and (not isinstance(node, int) or isinstance(node, bool) or node < 0):
        raise TraceError(
            f"{at_where} ({kind} at {at:g}s): node {node!r} must be a node number >= 0"
        )
    deadline = e.get("deadline_s")
    if kind == "notice":
        if not _number(deadline) or deadline <= 0:
            raise TraceError(
                f"{at_where} (notice at {at:g}s for node {node}): deadline_s {deadline!r} "
                "must be seconds > 0 (the cloud's notice length, e.g. 120 on AWS, 30 on GCP "
                "and Azure)"
            )
        deadline = float(deadline)
    if at > duration:
        raise TraceError(
            f"{at_where} ({kind} at {at:g}s) is past the run's duration ({duration:g}s); move "
            "it earlier or raise --duration"
        )
    if kind == "notice" and at + deadline > duration:
        raise TraceError(
            f"{at_where} (notice at {at:g}s for node {node}, deadline {deadline:g}s): its node "
            f"goes at {at + deadline:g}s, past the run's duration ({duration:g}s); move it "
            f"earlier, shorten deadline_s, or raise --duration to {at + deadline:g}"
        )
    return Event(at, kind, node if kind != "join" else -1, deadline, i)


def _check_nodes(events: list[Event], where: str, nodes: int) -> None:
    """Every event names a node the cluster has at that moment; joins get their numbers."""
    live = set(range(nodes))
    going: dict[int, float] = {}  # noticed node -> when it goes
    next_node = nodes
    for n, e in enumerate(events):
        for node, t in list(going.items()):
            if t <= e.at:
                live.discard(node)
                del going[node]
        if e.kind == "join":
            events[n] = Event(e.at, "join", next_node, None, e.index)
            live.add(next_node)
            next_node += 1
            continue
        if e.node not in live or e.node in going:
            state = (
                "has a notice already"
                if e.node in going
                else "is gone by then"
                if e.node < next_node
                else "does not exist then"
            )
            have = ", ".join(str(x) for x in sorted(live - set(going))) or "none"
            raise TraceError(
                f"{where}: events[{e.index}] ({e.describe()}): node {e.node} {state}; the "
                f"cluster has {nodes} spot node(s) (0-{nodes - 1}) and a join adds the next "
                f"number; live then: {have}. Name a live node, add a join, or raise --nodes"
            )
        if e.kind == "loss":
            live.discard(e.node)
        else:
            going[e.node] = e.at + (e.deadline_s or 0.0)


def builtin_names() -> list[str]:
    return list(BUILTIN)
