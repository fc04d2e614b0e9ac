"""The `preemption` section of a job spec: which notice sources to watch, and the budget
the controller has from a notice to a committed checkpoint.

Kinds are checked against the source registry (`spotline.preemption.sources`), so a
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

from spotline.preemption.sources import source_class


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
        source_class(v)  # raises ValueError with a did-you-mean and the valid kinds
        return v

    @field_validator("endpoint")
    @classmethod
    def _endpoint_shape(cls, v: str | None, info: ValidationInfo) -> str | None:
        kind = info.data.get("kind")  # absent when kind itself failed validation
        if v is not None and kind is not None:
            source_class(kind).check_endpoint(v)
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
