"""A job's spec and checkpoint store as an actor's constructor argument, with its secrets
out of Ray's records.

Ray's GCS keeps every actor's creation task, constructor arguments included, for as
long as the cluster runs. So an actor gets a `SealedJob`: the spec and the store's
settings with every secret masked (`split_secrets`: keys such as key, secret, token,
everything under storage_options, URI userinfo), plus an object reference to the
secrets. Ray resolves only top-level references; one nested in an argument travels as
its id, and the actor resolves it in its constructor (`open`). The secrets themselves
stay in the object store (see the README for what an operator can still see).

This is the one way a spec or a store reaches an actor. Never pass `model_dump_json()`
or a `CheckpointStore` (which pickles its options in clear) as an actor argument.

A submitted job's driver reads its secrets from a one-use package that `spotline submit`
uploads with the job (`take_secrets_package`); the package then leaves the cluster
before any process of the job starts. Opening a SealedJob also removes any copy of it
left on the actor's node (`forget_secrets_packages`), for a package that reached a
node some other way.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from spotline.checkpoint import CheckpointStore
from spotline.config.loader import register_spec_secrets
from spotline.config.redact import (
    forget_secrets_packages,
    join_secrets,
    read_secrets_package,
    split_secrets,
)
from spotline.config.schema import JobSpec

log = logging.getLogger("spotline.secrets")


def take_secrets_package(module: str) -> list[list[Any]]:
    """The secrets a submitted job's driver was given in package `module`, read once.
    Then the package leaves the cluster: out of the runtime_env the job's processes get
    (no other node ever unpacks it), off this node (Ray's unpacked copy, not only the
    file), and out of the GCS (the uploaded archive, which Ray would otherwise keep
    for the job's life). Call it before the driver connects to Ray."""
    from spotline.compat import ray as ray_internals

    found = importlib.util.find_spec(module)
    folder = Path(next(iter(found.submodule_search_locations))) if found else None
    secrets = read_secrets_package(module)  # removes the file; says so when absent
    if folder is None:
        return secrets
    # Ray unpacks a py_module into a folder of its own, named as the upload.
    uri = ray_internals.drop_job_py_module(folder.parent.name)
    if uri is None:
        return secrets  # not a package Ray handed this job: only the file was there
    shutil.rmtree(folder.parent, ignore_errors=True)
    try:
        ray_internals.delete_package(uri, ray_internals.bootstrap_address())
    except Exception as e:  # noqa: BLE001 - said once; the job goes on
        log.warning(
            "the package %s that brought this job's secrets could not be deleted from "
            "Ray's GCS (%s): it goes when the job ends",
            uri,
            type(e).__name__,
        )
    return secrets


class SealedJob:
    """`spec` (and `store`) for actors, secrets by reference.

    The creator keeps this object while its actors may still start or restart: the
    reference inside keeps the secrets in the object store.
    """

    def __init__(self, spec: JobSpec, store: CheckpointStore | None = None) -> None:
        import ray

        spec_public, spec_secrets = split_secrets(spec.model_dump(mode="json"))
        store_public, store_secrets = split_secrets(_store_state(store))
        self.spec_json = json.dumps(spec_public)
        self.store_state = store_public
        secrets = {"spec": spec_secrets, "store": store_secrets}
        # In a list, so Ray hands the actor the reference rather than the value.
        self._secrets = [ray.put(secrets)] if spec_secrets or store_secrets else []

    def _resolve(self) -> dict[str, list]:
        import ray

        return ray.get(self._secrets[0]) if self._secrets else {"spec": [], "store": []}

    def open_spec(self, secrets: dict[str, list] | None = None) -> JobSpec:
        """The spec, secrets restored and registered for redaction (in the actor that
        was given this)."""
        forget_secrets_packages()
        spec_secrets = (secrets or self._resolve())["spec"]
        spec = JobSpec.model_validate(join_secrets(json.loads(self.spec_json), spec_secrets))
        return register_spec_secrets(spec)

    def open(self) -> tuple[JobSpec, CheckpointStore]:
        """The spec and the store, secrets restored (in the actor that was given this)."""
        if self.store_state is None:
            raise ValueError("this SealedJob was made without a store")
        secrets = self._resolve()
        state = join_secrets(json.loads(json.dumps(self.store_state)), secrets["store"])
        state["args"][2] = state.pop("storage_options")
        store = CheckpointStore.__new__(CheckpointStore)
        store.__setstate__(state)
        return self.open_spec(secrets), store


def _store_state(store: CheckpointStore | None) -> Any:
    if store is None:
        return None
    # Through JSON: split_secrets walks dicts and lists (the state holds a tuple).
    state = json.loads(json.dumps(store.__getstate__()))
    # Under the name the spec gives them, so that every option is masked (a profile
    # name too), not only those named like a secret.
    state["storage_options"], state["args"][2] = state["args"][2], None
    return state
