"""What goes wrong with storage, in words the user can act on: `StorageError` (the
storage cannot be used), and `StoreFields`, what a store's settings are called in its
messages.

Pure data: it never touches storage. A message built here never holds a secret.
"""

from __future__ import annotations

from typing import NamedTuple

from spotline.config.redact import redact


class StoreFields(NamedTuple):
    """What a store's settings are called in its messages: the spec's fields by default,
    or the command-line arguments that gave them (`argument`), so that a message names
    what the user actually typed."""

    uri: str = "checkpoint.uri"
    endpoint_url: str = "checkpoint.endpoint_url"
    storage_options: str | None = "checkpoint.storage_options"

    @classmethod
    def argument(cls, name: str) -> StoreFields:
        """A store named by the command-line argument `name` (no storage options)."""
        return cls(uri=f"the {name} argument", endpoint_url="--endpoint-url", storage_options=None)

    def credentials_fix(self) -> str:
        fix = "set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an instance role"
        if self.storage_options:
            fix += f", or put key/secret (or profile) in {self.storage_options}"
        return fix


SPEC_FIELDS = StoreFields()


class StorageError(RuntimeError):
    """The checkpoint storage cannot be used: bad URI, unreachable, no credentials, no access.

    Worth retrying when it is an outage (unreachable, timed out); not when it is a bad
    URI, missing credentials or refused access. The message never holds a secret.
    """

    def __init__(self, message: str) -> None:
        super().__init__(redact(message))
