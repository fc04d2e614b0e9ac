"""The s3:// backend of a checkpoint root: s3fs (aiobotocore) for listings, reads and small
writes, and boto3's managed transfer for the step files themselves.

Both clients are built from the same checked storage options and endpoint, with
botocore's standard credential chain; an option boto3 cannot be given the same way
keeps the upload on s3fs, so no option is ever silently dropped.

s3fs, boto3 and botocore are imported only when an s3:// root is used; a missing one is
a StorageError that says what to install. No message here holds a secret.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from spotline.config.redact import redact
from spotline.storage.backends import TRANSFER_THREADS, Backend, bad_uri
from spotline.storage.errors import SPEC_FIELDS, StorageError, StoreFields
from spotline.storage.fs import FSSPEC_COMMON_OPTIONS, StorageOptionsError, check_s3_options
from spotline.storage.retry import exception_chain

# S3 refuses multipart parts smaller than this (except the last one).
S3_MIN_PART_BYTES = 5 * 2**20
# S3 uploads: part size and parts in flight per file (boto3's defaults). boto3 raises
# the part size itself when a file would need more than S3's 10,000 parts.
DEFAULT_PART_BYTES = 8 * 2**20
PART_THREADS = 10
# s3fs options with a boto3 equivalent, and the credentials among them.
BOTO3_CREDENTIALS = {
    "key": "aws_access_key_id",
    "username": "aws_access_key_id",
    "secret": "aws_secret_access_key",
    "password": "aws_secret_access_key",
    "token": "aws_session_token",
}
_BOTO3_MAPPABLE = {*BOTO3_CREDENTIALS, "profile", "anon", "client_kwargs", "config_kwargs"}
_S3_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def import_s3fs(fields: StoreFields = SPEC_FIELDS) -> Any:
    try:
        import s3fs
    except ImportError as e:
        raise StorageError(
            f"s3:// {fields.uri} needs the optional S3 packages, which are not installed "
            f"({e}); run: pip install 'spotline[s3]'"
        ) from e
    return s3fs


class S3Backend(Backend):
    """s3:// through s3fs (aiobotocore), with botocore's standard credential chain."""

    scheme = "s3"

    def locate(self, uri: str, rest: str, bare: bool) -> None:
        f = self.fields
        if not rest or rest.startswith("/"):
            raise bad_uri(uri, "no bucket name after 's3://'", f)
        if "?" in rest or "#" in rest:
            raise bad_uri(uri, "query strings and fragments are not supported", f)
        bucket, _, prefix = rest.partition("/")
        if "@" in bucket:
            fix = f.credentials_fix()
            raise bad_uri(uri, f"credentials in an s3:// URI are never read; {fix}", f)
        if not _S3_BUCKET_RE.match(bucket) or ".." in bucket:
            raise bad_uri(
                uri,
                f"{bucket!r} is not a valid S3 bucket name (3-63 lower-case letters, digits, "
                "'.' or '-', starting and ending with a letter or digit)",
                f,
            )
        parts = [p for p in prefix.split("/") if p]
        if any(p in (".", "..") for p in parts):
            raise bad_uri(uri, "the prefix must not contain '.' or '..' segments", f)
        self.bucket = bucket
        self.root = "/".join([bucket, *parts])
        self.uri = "s3://" + self.root
        self.multipart_chunksize: int | None = None
        try:
            check_s3_options(self.options, f.storage_options or "storage options")
        except StorageOptionsError as e:
            raise StorageError(str(e)) from None
        self._client: Any = False  # False: not built yet; None: use s3fs
        self._client_lock = threading.Lock()
        self._extra_args: dict = {}

    def make_fs(self, probe_timeout_s: float | None = None) -> Any:
        s3fs = import_s3fs(self.fields)
        opts = dict(self.options)
        client_kwargs = dict(opts.pop("client_kwargs", None) or {})
        if self.endpoint_url:
            client_kwargs["endpoint_url"] = self.endpoint_url
        config_kwargs = dict(opts.pop("config_kwargs", None) or {})
        if probe_timeout_s is not None:
            # A preflight must fail in seconds: short connect timeout, one retry.
            config_kwargs.update(
                connect_timeout=max(1.0, min(5.0, probe_timeout_s / 4)),
                read_timeout=max(1.0, probe_timeout_s),
                retries={"max_attempts": 2, "mode": "standard"},
            )
        # Listings must always be fresh: other processes commit and delete steps.
        opts.setdefault("use_listings_cache", False)
        try:
            fs = s3fs.S3FileSystem(
                client_kwargs=client_kwargs,
                config_kwargs=config_kwargs,
                skip_instance_cache=True,
                **opts,
            )
        except (TypeError, KeyError, ValueError) as e:
            raise StorageError(
                f"{self.fields.storage_options} ({', '.join(sorted(map(str, self.options)))}) "
                f"were refused by s3fs ({redact(str(e))}); fix or remove them"
            ) from e
        if probe_timeout_s is not None:
            fs.retries = 1  # s3fs's own retry loop, on top of botocore's
        return fs

    def put_file(self, fs: Any, local: str, remote: str) -> None:
        # boto3's managed transfer streams parts from 10 threads while it reads the file;
        # s3fs reads 10 parts, sends them from one event loop and waits for all before
        # reading on (0.6-0.8x the rate to the same server). Options boto3 cannot be
        # given the same way keep the s3fs path, so they are never silently dropped.
        client = self._upload_client()
        if client is None:
            chunk = self.multipart_chunksize
            fs.put_file(local, remote, **({"chunksize": chunk} if chunk else {}))
            return
        from boto3.s3.transfer import TransferConfig

        bucket, _, key = remote.partition("/")
        chunk = self.multipart_chunksize or DEFAULT_PART_BYTES
        config = TransferConfig(
            multipart_threshold=chunk, multipart_chunksize=chunk, max_concurrency=PART_THREADS
        )
        client.upload_file(
            local, bucket, key, ExtraArgs=dict(self._extra_args) or None, Config=config
        )

    def _upload_client(self) -> Any:
        """A boto3 client built from the same options as the s3fs filesystem, or None
        when boto3 is missing or an option has no boto3 equivalent."""
        with self._client_lock:
            if self._client is not False:
                return self._client
            self._client = None
            opts = dict(self.options)
            for name in FSSPEC_COMMON_OPTIONS:
                opts.pop(name, None)
            extra = dict(opts.pop("s3_additional_kwargs", None) or {})
            try:
                import boto3
                import botocore.config
                from boto3.s3.transfer import S3Transfer
            except ImportError:
                return None
            if set(extra) - set(S3Transfer.ALLOWED_UPLOAD_ARGS) or set(opts) - _BOTO3_MAPPABLE:
                return None
            client_kwargs = dict(opts.pop("client_kwargs", None) or {})
            config_kwargs = dict(opts.pop("config_kwargs", None) or {})
            config_kwargs.setdefault("max_pool_connections", TRANSFER_THREADS * PART_THREADS)
            if opts.pop("anon", False):
                import botocore

                config_kwargs["signature_version"] = botocore.UNSIGNED
            if self.endpoint_url:
                client_kwargs["endpoint_url"] = self.endpoint_url
            for ours, theirs in BOTO3_CREDENTIALS.items():
                if opts.get(ours) is not None:
                    client_kwargs.setdefault(theirs, opts[ours])
            session = boto3.session.Session(profile_name=opts.get("profile"))
            self._client = session.client(
                "s3", config=botocore.config.Config(**config_kwargs), **client_kwargs
            )
            self._extra_args = extra
            return self._client

    def write_atomic(self, fs: Any, path: str, data: bytes) -> None:
        # One PUT (s3fs uses a single put_object below 2 chunks = 100 MiB) is atomic
        # and strongly consistent on S3: readers see the whole object or none.
        fs.pipe_file(path, data)

    def where(self) -> str:
        return self.endpoint_url or "the default AWS S3 endpoint"

    def storage_errors(self) -> tuple[type[BaseException], ...]:
        try:
            import botocore.exceptions
        except ImportError:
            return (OSError,)
        errors = (OSError, botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)
        try:
            from boto3.exceptions import S3UploadFailedError
        except ImportError:
            return errors
        return (*errors, S3UploadFailedError)

    def explain(self, exc: BaseException) -> str:
        try:
            from botocore import exceptions as bx
        except ImportError:  # pragma: no cover - s3fs pulls botocore in
            bx = None
        for e in exception_chain(exc):
            if bx is not None and isinstance(e, bx.NoCredentialsError):
                fix = self.fields.credentials_fix()
                return f"no AWS credentials found for {self.uri}: {fix}"
            if bx is not None and isinstance(
                e, (bx.ConnectionError, bx.HTTPClientError)
            ):  # refused, DNS, TLS, connect/read timeouts
                return (
                    f"cannot reach the S3 endpoint {self.where()} ({e}); check "
                    f"{self.fields.endpoint_url}, that the service is running, and the "
                    "network/firewall between this node and it"
                )
            if isinstance(e, TimeoutError):
                return (
                    f"the S3 endpoint {self.where()} gave {e}; check {self.fields.endpoint_url} "
                    "and the network, or raise SPOTLINE_STORAGE_CHECK_TIMEOUT_S"
                )
            code = _client_error_code(e, bx)
            if isinstance(e, PermissionError) or code in ("AccessDenied", "403"):
                return (
                    f"access denied by {self.where()} ({e}); check that the credentials are "
                    "valid and allow s3:PutObject, s3:GetObject, s3:DeleteObject and "
                    f"s3:ListBucket on arn:aws:s3:::{self.bucket} and "
                    f"arn:aws:s3:::{self.root}/*"
                )
            if isinstance(e, FileNotFoundError) or code in ("NoSuchBucket", "404"):
                return (
                    f"bucket {self.bucket!r} does not exist at {self.where()} or is not "
                    f"visible to these credentials ({e}); create it (e.g. `aws s3 mb "
                    f"s3://{self.bucket}`) or fix {self.fields.uri} / {self.fields.endpoint_url}"
                )
        return f"{type(exc).__name__}: {exc}"


def _client_error_code(exc: BaseException, bx: Any) -> str | None:
    """The S3 error code of a botocore ClientError (boto3 uploads raise them raw)."""
    if bx is None or not isinstance(exc, bx.ClientError):
        return None
    return str(exc.response.get("Error", {}).get("Code", "")) or None
