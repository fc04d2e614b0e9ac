"""The one redaction function: every message, log line, status, summary, trace,
manifest and tracker entry that may hold spec values passes through `redact`.

What is secret:
- every value under a key that names a secret (key, secret, token, password,
  credential, ...), at any depth;
- everything under `storage_options` (endpoint credentials, session tokens, profile
  names: the options are passed to a client and never needed in a message);
- the userinfo of any URI (`s3://KEY:SECRET@bucket`, `https://user:pass@host`),
  wherever the URI appears: a spec field, a command-line argument, a library's error;
- in free text, every such value a spec of this process carried, and the values of
  environment variables whose names say they hold a secret.

A spec loaded to run registers its secret values (`config.loader.register_spec_secrets`:
`load_spec`, `validate_dict`, `spotline.Job`, and every actor opening its spec), in the
driver, the controller and every worker alike, so text that echoes one, such as a
client library's error that repeats its arguments, is masked too. Validating a spec
registers nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

MASK = "***"
SECRET_KEY_RE = re.compile(
    r"(^|_|-)(key|secret|token|password|passwd|passphrase|credentials?|auth|"
    r"api[_-]?key|access[_-]?key|session[_-]?token|private[_-]?key|signature)s?($|_|-)",
    re.IGNORECASE,
)
"""Key names whose values are secret: `key`, `secret`, `aws_secret_access_key`,
`api_key`, `password`, `token`, ... (not `keep_last` or `monkey`)."""
_ENV_SECRET_RE = re.compile(r"(SECRET|TOKEN|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|SIGNING_KEY)")
_MASKED_SECTIONS = ("storage_options",)
_MIN_SECRET_LEN = 8  # shorter values would mask ordinary words and numbers in free text

_known: set[str] = set()
_known_lock = threading.Lock()

# `scheme://userinfo@`: the userinfo runs to the last '@' before the host's end ('/',
# '?', '#', whitespace or a quote), so a password holding an unencoded '@' is masked
# whole. Masking a little more than the userinfo of a malformed URI is the safe error.
_URI_USERINFO_RE = re.compile(r"""([A-Za-z][A-Za-z0-9+.-]*://)([^\s/?#"<>\\]+)@""")


def is_secret_key(key: object) -> bool:
    return isinstance(key, str) and bool(SECRET_KEY_RE.search(key))


def is_secret_path(parts: list[Any]) -> bool:
    """True when a value at this location (e.g. ('checkpoint', 'storage_options', 'key'))
    is secret."""
    return any(is_secret_key(p) or p in _MASKED_SECTIONS for p in parts)


def uri_userinfo(text: str) -> set[str]:
    """The credentials in the URIs of `text`: each whole userinfo and its user and
    password parts, percent-decoded too (long enough to be masked in free text)."""
    from urllib.parse import unquote

    out: set[str] = set()
    for m in _URI_USERINFO_RE.finditer(text):
        info = m.group(2)
        for part in (info, *info.split(":", 1)):
            out |= {part, unquote(part)}
    return {v for v in out if len(v) >= _MIN_SECRET_LEN}


def mask_uri_userinfo(text: str) -> str:
    """`text` with the userinfo of every URI in it replaced by the mask."""
    return _URI_USERINFO_RE.sub(rf"\1{MASK}@", text)


def secret_values(value: Any, _masked: bool = False) -> set[str]:
    """Every secret leaf value in a nested dict/list (as strings), and the userinfo of
    every URI in its strings."""
    out: set[str] = set()
    if isinstance(value, dict):
        for k, v in value.items():
            inner = _masked or is_secret_key(k) or k in _MASKED_SECTIONS
            out |= secret_values(v, inner)
    elif isinstance(value, (list, tuple)):
        for v in value:
            out |= secret_values(v, _masked)
    elif _masked and value is not None and not isinstance(value, bool):
        text = str(value)
        if len(text) >= _MIN_SECRET_LEN:
            out.add(text)
    elif isinstance(value, str):
        out |= uri_userinfo(value)
    return out


def register_secrets(value: Any) -> None:
    """Remember the secret leaves of `value` (a spec dump, command-line arguments) for
    masking free text."""
    found = secret_values(value)
    if found:
        with _known_lock:
            _known.update(found)


def _env_secrets() -> set[str]:
    return {
        v
        for k, v in os.environ.items()
        if _ENV_SECRET_RE.search(k.upper()) and len(v) >= 8 and not v.isdigit()
    }


def redact(value: Any) -> Any:
    """A copy of `value` with every secret masked: dicts by key, text by known value."""
    return _redact(value, False, _known | _env_secrets())


def _redact(value: Any, masked: bool, known: set[str]) -> Any:
    if isinstance(value, dict):
        return {
            k: _redact(v, masked or is_secret_key(k) or k in _MASKED_SECTIONS, known)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return type(value)(_redact(v, masked, known) for v in value)
    if masked and value is not None and not isinstance(value, bool):
        return MASK
    if isinstance(value, str):
        found = uri_userinfo(value)
        if found:
            # Echoes of the same credentials without their URI (a client library's
            # "invalid bucket 'KEY:SECRET@bucket'") are masked too, here and later.
            with _known_lock:
                _known.update(found)
            known = known | found
            value = mask_uri_userinfo(value)
        # Longest first, so a secret that contains another is masked whole.
        for secret in sorted(known, key=len, reverse=True):
            if secret in value:
                value = value.replace(secret, MASK)
    return value


_installed = False


def install_log_redaction() -> None:
    """Make every log record of this process (Spotline's, Ray's, DeepSpeed's, botocore's)
    pass through `redact` before any handler sees it. Idempotent."""
    global _installed
    if _installed:
        return
    make_record = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string is logging's to report
            return record
        record.msg, record.args = redact(text), ()
        return record

    logging.setLogRecordFactory(factory)
    _installed = True


SECRETS_FILE = "secrets.json"
SECRETS_PACKAGE_PREFIX = "spotline_secrets_"
"""A submitted job's secrets travel in a package named this plus a random suffix."""


def split_secrets(raw: dict[str, Any]) -> tuple[dict[str, Any], list[list[Any]]]:
    """(a copy of a spec dict with every secret leaf masked, [[path, value], ...]).

    `spotline submit` puts the first on the entrypoint's command line and hands the
    second to the job in a one-use package (`write_secrets_package`), so no secret is
    ever part of a command line or of a runtime_env that Ray logs.
    """
    secrets: list[list[Any]] = []

    def walk(value: Any, path: list[Any], masked: bool) -> Any:
        if isinstance(value, dict):
            return {
                k: walk(v, [*path, k], masked or is_secret_key(k) or k in _MASKED_SECTIONS)
                for k, v in value.items()
            }
        if isinstance(value, list):
            return [walk(v, [*path, i], masked) for i, v in enumerate(value)]
        if masked and value is not None and not isinstance(value, (bool, dict, list)):
            secrets.append([path, value])
            return MASK
        if isinstance(value, str) and mask_uri_userinfo(value) != value:
            secrets.append([path, value])  # a URI with credentials in it
            return mask_uri_userinfo(value)
        return value

    return walk(raw, [], False), secrets


def join_secrets(public: dict[str, Any], secrets: list[list[Any]]) -> dict[str, Any]:
    """Put the values `split_secrets` took out back into the spec dict."""
    for path, value in secrets:
        node: Any = public
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value
    return public


def masked_paths(raw: Any, path: str = "") -> list[str]:
    """Dotted paths of values that are still the mask, or URIs whose userinfo is (secrets
    that did not arrive)."""
    if isinstance(raw, dict):
        return [p for k, v in raw.items() for p in masked_paths(v, f"{path}.{k}" if path else k)]
    if isinstance(raw, list):
        return [p for i, v in enumerate(raw) for p in masked_paths(v, f"{path}[{i}]")]
    masked = raw == MASK or (isinstance(raw, str) and f"://{MASK}@" in raw)
    return [path] if masked else []


def write_secrets_package(root: Path, secrets: list[list[Any]]) -> str:
    """Write `secrets` as an importable one-use package under `root`; its module name."""
    import uuid

    name = f"{SECRETS_PACKAGE_PREFIX}{uuid.uuid4().hex}"
    pkg = root / name
    pkg.mkdir(mode=0o700)
    (pkg / "__init__.py").write_text("")
    path = pkg / SECRETS_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(secrets, f)
    return name


def read_secrets_package(module: str) -> list[list[Any]]:
    """The secrets a submitted job was given; the file is deleted once read."""
    import importlib.util

    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        raise ValueError(
            f"--secrets-module {module}: the package with this job's secrets did not reach "
            "it; submit with `spotline submit` or Job.submit (they upload it)"
        )
    path = Path(next(iter(found.submodule_search_locations))) / SECRETS_FILE
    secrets = json.loads(path.read_text())
    with contextlib.suppress(OSError):
        path.unlink()
    return secrets


def forget_secrets_packages() -> int:
    """Remove this node's copy of a submitted job's secrets: Ray unpacks the job's
    py_modules, the secrets package among them, on every node that starts a process of
    the job, while only the driver reads it (`read_secrets_package`). Every actor of
    the job calls this as it opens its job (`SealedJob`), so no node keeps the file
    once the job runs there. Looks only where this process imports from (the job's
    own packages); returns how many files it removed."""
    import sys

    removed = 0
    for entry in dict.fromkeys(sys.path):
        try:
            found = list(Path(entry or ".").glob(f"{SECRETS_PACKAGE_PREFIX}*/{SECRETS_FILE}"))
        except OSError:
            continue
        for path in found:
            with contextlib.suppress(OSError):
                path.unlink()
                removed += 1
    return removed
