"""What a job keeps beside its checkpoints for readers outside it.

The summary and the goodput ledger (for `spotline status/report` on a finished job and
for a restarted controller), the Chrome trace of the pipeline's latest steps, the
job's tokenizer files (so an export carries the tokenizer the model was trained with),
and the evidence of each hang: the ranks' stacks and, on NCCL, their flight records
(`stacks/NAME/`).
Everything goes through the commit coordinator, the only owner of storage, and never
into a URI this job does not own: another job's artifacts stay intact.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from spotline.checkpoint import TOKENIZER_ARTIFACTS, TRACE_ARTIFACT

STACKS_ARTIFACTS = "stacks"
"""Where the evidence of each hang goes: `stacks/NAME/stacks.json` (every rank's threads
and frames, innermost first) and `stacks/NAME/flight-rank-NNNNN.json` (torch's NCCL
flight record of that rank, as torch wrote it)."""


class Artifacts:
    def __init__(self, spec, coordinator, event):
        self.spec = spec
        self.coordinator = coordinator
        self._event = event
        self.owned = False  # the URI holds no other job's checkpoints (see `own`)

    def own(self) -> None:
        """The job owns its checkpoint URI (checked, and not a finished job's report):
        from now on its artifacts are written, starting with the tokenizer files."""
        self.owned = True
        self._store_tokenizer()

    def _store_tokenizer(self) -> None:
        from spotline.data.tokenizer import tokenizer_files

        try:
            files = tokenizer_files(self.spec)
        except ValueError as e:  # DataError: reading the files
            self._event(f"could not read the tokenizer files: {e}", logging.WARNING)
            return
        for name, data in files.items():
            self.coordinator.write_artifact(f"{TOKENIZER_ARTIFACTS}/{name}", data)

    def write(self, summary, ledger: dict[str, Any], trace=None) -> None:
        """Keep the summary, the ledger and (`trace`, when given and not None) the trace
        current. `summary` and `trace` are called only when something is written."""
        if not self.owned:
            return
        self.coordinator.store_summary(summary(), ledger)
        if trace is not None:
            out = trace()
            if out is not None:
                self.coordinator.write_artifact(TRACE_ARTIFACT, json.dumps(out).encode())

    def store_stacks(self, name: str, record: dict[str, Any]) -> str | None:
        """Keep a hang's stacks (`RayStacks.take`'s record) under `stacks/NAME/`; the URI
        of its stacks.json, None when nothing was written (a URI this job does not own,
        or storage refused: the coordinator said so)."""
        if not self.owned:
            return None
        record = dict(record)
        flights = {}
        for rank, got in (record.pop("flight", None) or {}).items():
            data = got.get("json")
            if isinstance(data, bytes):
                path = f"{STACKS_ARTIFACTS}/{name}/flight-rank-{int(rank):05d}.json"
                flights[rank] = {"uri": self.coordinator.write_artifact(path, data)}
            else:
                flights[rank] = {k: v for k, v in got.items() if k != "json"}
        record["flight"] = flights
        data = json.dumps(record, default=str).encode()
        return self.coordinator.write_artifact(f"{STACKS_ARTIFACTS}/{name}/stacks.json", data)


def trace(
    name: str,
    bubbles,
    backfill,
    partition: dict[str, Any] | None,
    stragglers: list[dict[str, Any]] | None = None,
) -> dict[str, Any] | None:
    """Chrome-trace JSON of the latest recorded steps of every stage (None for pp=1),
    with the stage partition in force, every re-partition and the ranks straggling now
    in its metadata."""
    if bubbles is None:
        return None
    slices = backfill.slices() if backfill is not None else {}
    out = bubbles.trace(name, slices)
    out["otherData"] = {"partition": partition, "stragglers": stragglers or []}
    return out
