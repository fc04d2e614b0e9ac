"""The `preemption` section of a job spec: which notice sources to watch, and the budget
the controller has from a notice to a committed checkpoint.

Kinds are checked against the notice-source registry (`spotline.registry`), so a
misspelt kind fails when the spec loads, not on the node when the notice comes.
"""

from __future__ import annotations

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from spotline.config.urls import check_host_port, check_http_url
from spotline.registry import NOTICE_SOURCES


class NoticeSourceSpec(BaseModel):
    """One place a preemption notice can come from."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    kind: str
    """Registered source name: 'aws' (IMDSv2 spot/instance-action), 'gcp' (metadata
    instance/preempted), 'azure' (Scheduled Events Preempt), 'ray-drain' (Ray's GCS node
    drain) or 'sigterm' (SIGTERM to this process)."""
    endpoint: str | None = None
    """Override of where the source asks: the metadata base URL for aws/gcp/azure (e.g.
    http://127.0.0.1:8080, so tests serve the protocol on loopback), the GCS address
    host:port for ray-drain. None uses the cloud's own endpoint, or the connected Ray
    cluster. sigterm takes none."""
    poll_interval_s: float = Field(1.0, gt=0.0)
    """Seconds between two polls of this source."""
    default_deadline_s: float | None = Field(None, gt=0.0)
    """Seconds from the notice to the node's end when the protocol gives no deadline (GCP,
    SIGTERM, a Ray drain without a deadline). None uses the source's own default: gcp 30,
    sigterm 30, ray-drain 30, aws 120 and azure 30 (those two normally carry their own
    deadline: instance-action 'time' and the event's NotBefore)."""

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, v: str) -> str:
        return NOTICE_SOURCES.check(v)  # a did-you-mean and the valid kinds

    @field_validator("endpoint")
    @classmethod
    def _endpoint_shape(cls, v: str | None, info: ValidationInfo) -> str | None:
        kind = info.data.get("kind")  # absent when kind itself failed validation
        if v is not None and kind is not None:
            check_notice_endpoint(kind, v)
        return v


class PreemptionSpec(BaseModel):
    """Preemption notices: each becomes a just-in-time checkpoint before the deadline."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    sources: list[NoticeSourceSpec] = Field(default_factory=list)
    """Notice sources a watcher on every node polls. Empty: no notices, only recovery
    from the latest committed checkpoint after a node is lost."""
    jit_checkpoint_budget_s: float = Field(20.0, gt=0.0)
    """Seconds the controller may take from a notice to a committed checkpoint."""

    @model_validator(mode="after")
    def _no_duplicate_sources(self) -> PreemptionSpec:
        seen: set[tuple[str, str | None]] = set()
        for i, s in enumerate(self.sources):
            key = (s.kind, s.endpoint)
            if key in seen:
                where = f" at endpoint {s.endpoint}" if s.endpoint else ""
                raise ValueError(
                    f"preemption.sources[{i}] repeats source {s.kind!r}{where}; "
                    "list each source once"
                )
            seen.add(key)
        return self


_HTTP_SOURCES = {
    "aws": "http://169.254.169.254",
    "gcp": "http://metadata.google.internal",
    "azure": "http://169.254.169.254",
}


def check_notice_endpoint(kind: str, endpoint: str) -> None:
    """Syntax of a built-in source's endpoint; ValueError saying what it must look like.

    A source given as `module:attr` checks its own endpoint when it is built.
    """
    field = f"endpoint of notice source {kind!r}"
    if kind in _HTTP_SOURCES:
        check_http_url(endpoint, field, f"{_HTTP_SOURCES[kind]} or http://127.0.0.1:8080")
    elif kind == "ray-drain":
        check_host_port(
            endpoint,
            field,
            "a GCS address host:port such as 10.0.0.5:6379 (the address `ray start --head` prints)",
        )
    elif kind == "sigterm":
        raise ValueError(f"notice source 'sigterm' takes no endpoint (got {endpoint!r})")
