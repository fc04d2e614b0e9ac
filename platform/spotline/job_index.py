"""Where each job last ran, so that `spotline status NAME` (and `report`, `trace`) finds
a job by its name after it ended, when its controller and often its cluster are gone.

One small JSON file per job name under `$SPOTLINE_HOME/jobs/` (default
`~/.spotline/jobs/`), written by the driver that starts the job (`spotline run`, the
SDK's `Job.start`, `jobs/train.py` on a cluster's head node) and, for checkpoints in
object storage, by `spotline submit`. It holds the job's resolved checkpoint URI and
the names of what reading it needs (its endpoint, the signing key's variable), never a
secret: a URI with credentials in it is not recorded, and storage options are left to
the reader's own credential chain. The last job to start under a name wins.

Writing it never fails a job: a home directory that cannot be written is passed over.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("spotline")

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")  # the spec's rule for `name`


def home() -> Path:
    """Spotline's own directory on this machine: SPOTLINE_HOME, else ~/.spotline."""
    return Path(os.environ.get("SPOTLINE_HOME") or Path.home() / ".spotline").expanduser()


def _path(name: str) -> Path:
    return home() / "jobs" / f"{name}.json"


def record(spec, checkpoint_uri: str, address: str | None = None) -> None:
    """Note that the job `spec` names is starting now with its checkpoints at
    `checkpoint_uri` (resolved: absolute, `{job}` filled in)."""
    from spotline.config.redact import mask_uri_userinfo

    if mask_uri_userinfo(checkpoint_uri) != checkpoint_uri:
        return  # credentials in the URI: a record would hold them, a masked one reads nothing
    entry = {
        "name": spec.name,
        "checkpoint_uri": checkpoint_uri,
        "endpoint_url": spec.checkpoint.endpoint_url,
        "signing_key_env": spec.checkpoint.signing_key_env,
        "address": address or os.environ.get("RAY_ADDRESS") or "local",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path = _path(spec.name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entry, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: the job runs on; only the lookup by name is lost
        log.debug("spotline: cannot record where %s runs in %s: %s", spec.name, path, e)


def last_run(name: str) -> dict[str, Any] | None:
    """What `record` noted for the job `name` on this machine, or None."""
    if not _NAME_RE.match(name):
        return None
    try:
        entry = json.loads(_path(name).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("checkpoint_uri"), str):
        return None
    return entry
