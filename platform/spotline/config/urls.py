"""Syntax checks of the endpoints a spec names: pure string checks, no network.

The schema runs them when a spec loads, and the parts that use an endpoint (the
checkpoint store, the notice sources) run the same ones, so a bad endpoint reads the
same everywhere and is caught before anything starts.
"""

from __future__ import annotations

import re
import urllib.parse

ENDPOINT_CREDENTIALS = (
    "credentials go in the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
    "AWS_PROFILE) or the section's storage_options, never in a URL"
)


def refuse_credentials(value: str, field: str | None, fix: str) -> None:
    """ValueError naming `field` (None: the validator's own location names it) when the
    URL `value` holds a user or password: a URL is shown, logged and recorded, so no URL
    of a spec may carry credentials (`fix` says where they go). The value is never
    echoed."""
    try:
        parts = urllib.parse.urlsplit(value)
    except ValueError:
        return  # not a URL: the caller's own check says what is wrong with it
    if parts.username is not None or parts.password is not None:
        where = f"{field}: " if field else ""
        raise ValueError(f"{where}must not hold a user or password; {fix}")


def check_http_url(
    value: str, field: str, example: str, credentials_fix: str = ENDPOINT_CREDENTIALS
) -> str:
    """`value` if it is an http(s) base URL with a host and no user or password;
    ValueError naming `field` otherwise."""
    refuse_credentials(value, field, credentials_fix)
    try:
        parts = urllib.parse.urlsplit(value)
        port_ok = parts.port is None or parts.port > 0
    except ValueError as e:
        raise ValueError(
            f"{field}: {value!r} is not a valid URL ({e}); use e.g. {example}"
        ) from None
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise ValueError(
            f"{field}: {value!r} must be an http(s) base URL with a host, e.g. {example}"
        )
    if parts.query or parts.fragment:
        raise ValueError(f"{field}: {value!r} must be a base URL without '?query' or '#fragment'")
    return value


def check_host_port(value: str, field: str, example: str) -> str:
    """`value` if it is `host:port`; ValueError naming `field`."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or "/" in value or not port.isdigit() or int(port) == 0:
        raise ValueError(f"{field}: {value!r} must be {example}")
    return value


CHECKPOINT_SCHEMES = ("file", "s3")
"""Where checkpoints live: the checkpoint store's backends."""
READ_SCHEMES = ("file", "s3", "gs", "http", "https")
"""Where a job reads a corpus, prepared data, a tokenizer or Hugging Face weights from
(through fsspec; gs:// needs gcsfs installed)."""
WRITE_SCHEMES = ("file", "s3")
"""Where `spotline prepare` and `spotline export` write."""

_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def check_scheme(value: str, field: str, schemes: tuple[str, ...]) -> str:
    """`value` if it is a plain path or a URI of one of `schemes`; ValueError naming
    `field`, the scheme and the supported ones otherwise. The value is not echoed: a
    URI may carry credentials."""
    m = _SCHEME_RE.match(value)
    if m is None or m.group(1).lower() in schemes:
        return value
    listed = ", ".join(f"{s}://" for s in schemes)
    raise ValueError(
        f"{field}: the scheme {m.group(1) + '://'!r} is not supported; use {listed} or a "
        "plain local path"
    )
