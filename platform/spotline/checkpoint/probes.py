"""Preflight probes of a checkpoint root: can this process find credentials for it, and
can it write, read back and delete a small object there within a deadline?

Run by the driver's preflight before any worker starts and by the CLI's checks, so a bad
bucket, an unreachable endpoint, missing credentials or a read-only disk fails in
seconds with the field to fix, not at the first checkpoint. A probe never waits past
its deadline (a hung mount is abandoned on a daemon thread) and leaves nothing behind.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from spotline import constants
from spotline.storage.checkpoint_root import StepStorage
from spotline.storage.errors import StorageError
from spotline.storage.s3 import S3Backend, import_s3fs


def run_with_deadline(fn: Callable[[], Any], timeout_s: float) -> Any:
    """Run ``fn`` in a daemon thread; raise TimeoutError if it has not finished in time.

    A hung NFS mount or a black-holed endpoint must not hang the caller; the stuck
    thread is abandoned (daemon, so it never blocks interpreter exit).
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=target, name="spotline-storage-check", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("result")


def check_credentials(storage: StepStorage) -> None:
    """S3: fail now (StorageError) if no credentials can be found. No-op for local paths."""
    backend = storage.backend
    if isinstance(backend, S3Backend):
        check_s3_credentials(backend)


def check_s3_credentials(backend: S3Backend) -> None:
    """Credentials in the storage options, or botocore's chain (environment, profile,
    instance role); StorageError naming the fix when there are none."""
    opts = backend.options
    if opts.get("anon"):
        return
    client_kwargs = opts.get("client_kwargs") or {}
    if (opts.get("key") or opts.get("username") or client_kwargs.get("aws_access_key_id")) and (
        opts.get("secret") or opts.get("password") or client_kwargs.get("aws_secret_access_key")
    ):
        return
    import_s3fs(backend.fields)
    import botocore.exceptions
    import botocore.session

    profile = opts.get("profile")
    try:
        session = botocore.session.Session(profile=profile)
        creds = session.get_credentials()
    except botocore.exceptions.ProfileNotFound as e:
        raise StorageError(
            f"AWS profile {profile or os.environ.get('AWS_PROFILE')!r} for {backend.uri} was "
            f"not found ({e}); fix the profile name in AWS_PROFILE or "
            f"{backend.fields.storage_options}.profile, or add it to ~/.aws/config"
        ) from e
    except botocore.exceptions.BotoCoreError as e:
        raise StorageError(
            f"could not load AWS credentials for {backend.uri} ({e}); "
            f"{backend.fields.credentials_fix()}"
        ) from e
    if creds is None:
        raise StorageError(
            f"no AWS credentials found for {backend.uri}: {backend.fields.credentials_fix()}"
        )


def check_writable(storage: StepStorage, timeout_s: float | None = None) -> None:
    """Write, read back and delete a small probe object under the root.

    Any failure (bad bucket, unreachable endpoint, no credentials, no permission,
    read-only disk, no answer within ``timeout_s``) becomes a StorageError that
    says what happened and how to fix it.
    """
    timeout = constants.SPOTLINE_STORAGE_CHECK_TIMEOUT_S if timeout_s is None else timeout_s
    check_credentials(storage)
    backend = storage.backend
    fs = backend.make_fs(probe_timeout_s=timeout)
    probe = (
        f"{backend.root}/.spotline-probe-{socket.gethostname()}-{os.getpid()}-"
        f"{uuid.uuid4().hex[:8]}"
    )
    payload = f"spotline storage probe {time.time()}\n".encode()

    def run() -> None:
        fs.pipe_file(probe, payload)
        back = fs.cat_file(probe)
        fs.rm_file(probe)
        if back != payload:
            raise StorageError(
                f"{storage.fields.uri} {storage.uri}: a probe object read back different "
                "bytes than were written; the storage (or a proxy in front of it) is not "
                "reliable"
            )

    try:
        run_with_deadline(run, timeout)
    except StorageError:
        raise
    except (*backend.storage_errors(), TimeoutError) as e:
        raise StorageError(
            f"{storage.fields.uri} {storage.uri} is not writable: {backend.explain(e)}"
        ) from e
