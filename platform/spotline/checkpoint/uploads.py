"""How a rank's step files reach storage: one file (hashed once, from the local copy),
a whole staging directory in parallel or paced to a rate, and the rank's signed upload
receipt, read back by the commit coordinator.

Every storage call here is retried through `StepStorage.retrying` (tenacity), only for
errors the backend calls transient. Nothing here commits a step, and nothing here
raises past a file's upload with another file of it still being written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
import time
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from spotline.checkpoint.layout import FileDigest
from spotline.checkpoint.manifest import FileEntry, ManifestError, Receipt, check_relpath
from spotline.storage.backends import READ_THREADS, TRANSFER_THREADS
from spotline.storage.checkpoint_root import RECEIPTS_DIR, StepStorage
from spotline.storage.fs import hash_file

NODE_PREFIX = "node_"
NODE_FORMAT = "spotline-node-receipts/1"


class RatePacer:
    """Holds a sequence of transfers to an average rate: after each one, waits until the
    bytes sent so far are no longer ahead of `bytes_per_s` since the pacer was made."""

    def __init__(
        self,
        bytes_per_s: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.bytes_per_s = bytes_per_s
        self._clock = clock
        self._sleep = sleep
        self._sent = 0
        self._t0 = clock()

    def sent(self, nbytes: int) -> None:
        """`nbytes` more went out: wait as long as the average rate asks."""
        self._sent += nbytes
        self._sleep(max(0.0, self._sent / self.bytes_per_s - (self._clock() - self._t0)))


def upload_file(
    storage: StepStorage,
    local_path: str | os.PathLike[str],
    step: int,
    relpath: str,
    known: FileDigest | None = None,
) -> FileEntry:
    """Upload one local file to ``<root>/step_xxx/<relpath>``; return its manifest entry.

    The sha256 is of the local file, so the manifest describes what was meant to be
    stored and a damaged upload is caught on restore. `known`: the size and sha256 its
    writer computed from the bytes on disk (`checkpoint.layout`), used when the size
    still matches, so the same bytes are not hashed twice.
    """
    relpath = check_relpath(relpath)
    local = Path(local_path)
    size = local.stat().st_size
    digest = known.sha256 if known is not None and known.size == size else hash_file(local)
    remote = f"{storage.step_path(step)}/{relpath}"
    with storage.io(f"uploading {local} as {relpath} of step {step}"):
        storage.retrying(lambda: storage.backend.put_file(storage.fs, str(local), remote))
    return FileEntry(path=relpath, size=size, sha256=digest)


def upload_dir(
    storage: StepStorage,
    local_dir: str | os.PathLike[str],
    step: int,
    prefix: str = "",
    max_bytes_per_s: float | None = None,
    known: Mapping[str, FileDigest] | None = None,
) -> list[FileEntry]:
    """Upload every file under ``local_dir``; entries are sorted by path.

    Each file's relpath is ``prefix`` + its path relative to ``local_dir``
    (a '/' is added after a non-empty prefix that lacks one). With
    ``max_bytes_per_s``, files go one at a time, paced to that average rate. `known`:
    the digests the writer computed, by path relative to ``local_dir``.
    """
    known = known or {}
    root = Path(local_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint staging directory {root} does not exist")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    files = sorted(p for p in root.rglob("*") if p.is_file())
    jobs = [(p, p.relative_to(root).as_posix()) for p in files]
    if max_bytes_per_s is None:
        return parallel(
            [
                lambda p=p, r=r: upload_file(storage, p, step, prefix + r, known.get(r))
                for p, r in jobs
            ]
        )
    out, pacer = [], RatePacer(max_bytes_per_s)
    for p, r in jobs:
        out.append(upload_file(storage, p, step, prefix + r, known.get(r)))
        pacer.sent(out[-1].size)
    return sorted(out, key=lambda e: e.path)


def parallel(tasks: list[Callable[[], Any]], threads: int = TRANSFER_THREADS) -> list[Any]:
    """Run tasks on at most `threads` threads; results in task order; the first error
    is raised after the tasks already running have finished (none is left writing
    behind us)."""
    if len(tasks) <= 1:
        return [t() for t in tasks]
    with ThreadPoolExecutor(
        max_workers=min(threads, len(tasks)), thread_name_prefix="spotline-ckpt"
    ) as pool:
        futures = [pool.submit(t) for t in tasks]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for f in pending:
            f.cancel()
    for f in futures:
        if not f.cancelled() and f.exception() is not None:
            raise f.exception()  # type: ignore[misc]
    return [f.result() for f in futures]


# --- receipts -------------------------------------------------------------------------


@dataclasses.dataclass
class ReceiptScan:
    """The upload receipts found under one step."""

    receipts: dict[str, list[Receipt]] = dataclasses.field(default_factory=dict)
    """Those that parsed and verified, by the attempt (group) that wrote them."""
    refused: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """(path under the step, why) of each one that can never complete a commit."""
    attempts: set[str] = dataclasses.field(default_factory=set)
    """Every attempt with a receipt there, refused ones included."""
    bypassed: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """(path under the step, why) of each node's object, or receipt in one, that was not
    used: the ranks' own receipts were read in its place."""

    def refusals(self) -> list[str]:
        """One line per reason a receipt was refused, not one per rank."""
        by_why: dict[str, list[str]] = {}
        for rel, why in self.refused:
            by_why.setdefault(why, []).append(rel)
        return [f"receipt {_some(rels)} refused: {why}" for why, rels in by_why.items()]

    def bypassed_line(self) -> str:
        rel, why = self.bypassed[0]
        return (
            f"the node's upload receipts {_some([r for r, _ in self.bypassed])} not used "
            f"({rel}: {why}); each of their ranks' own receipts was read instead"
        )


def _some(rels: list[str]) -> str:
    return rels[0] + (f" and {len(rels) - 1} more" if len(rels) > 1 else "")


def write_receipt(storage: StepStorage, receipt: Receipt) -> bytes:
    """Record that a rank of group `receipt.attempt` finished uploading its files of
    `receipt.step` (signed when checkpoint.signing_key_env is set); the bytes written.

    Receipts let a restarted controller commit a step whose uploads all finished
    but whose completion reports were lost with the workers that sent them. They
    live under the attempt that wrote them, so two groups' receipts never mix.
    """
    step, rank = receipt.step, receipt.rank
    body = receipt.to_json(storage.signing_key()).encode()
    path = f"{_receipts_of(storage, step, receipt.attempt)}/rank_{rank:05d}.json"
    with storage.io(f"writing the upload receipt of rank {rank}, step {step}"):
        storage.retrying(lambda: storage.write_atomic(path, body))
    return body


def write_node_receipts(
    storage: StepStorage, step: int, attempt: str, leader: int, bodies: list[bytes]
) -> None:
    """Write the receipts of a node's ranks (`bodies`, each as its rank wrote it) as one
    object beside theirs (`spotline.checkpoint.node_receipts`)."""
    doc = {"format": NODE_FORMAT, "receipts": [b.decode() for b in bodies]}
    path = f"{_receipts_of(storage, step, attempt)}/{NODE_PREFIX}{leader:05d}.json"
    with storage.io(f"writing the upload receipts of rank {leader}'s node, step {step}"):
        storage.retrying(lambda: storage.write_atomic(path, json.dumps(doc).encode()))


def _receipts_of(storage: StepStorage, step: int, attempt: str) -> str:
    return f"{storage.step_path(step)}/{RECEIPTS_DIR}/{attempt}"


def read_receipts(storage: StepStorage, step: int) -> ReceiptScan:
    """Upload receipts of a step, by the attempt (group) that wrote them. A receipt
    that does not parse, is not signed with the key (when one is set) or names
    another step is refused: it can never complete a commit.

    A few requests a step of any size: the groups' folders; then, in each, its nodes'
    objects, listed and read at once through a bounded pool (READ_THREADS). Only where
    they lack a rank of the group is the group's folder listed in full and the
    receipts of the ranks they lack read, the same way."""
    scan = ReceiptScan()
    scan.attempts = receipt_attempts(storage, step)
    key = storage.signing_key()
    with storage.io(f"reading upload receipts of step {step}"):
        for attempt in sorted(scan.attempts):
            _read_group(storage, step, attempt, key, scan)
    return scan


def _read_group(
    storage: StepStorage, step: int, attempt: str, key: bytes | None, scan: ReceiptScan
) -> None:
    step_path = storage.step_path(step)
    folder = _receipts_of(storage, step, attempt)
    got: list[Receipt] = []
    covered: set[int] = set()
    nodes = _listed(storage, folder, NODE_PREFIX)
    for name, raw in zip(nodes, read_many(storage, nodes), strict=True):
        rel = posixpath.relpath(name, step_path)
        for i, body in enumerate(_node_bodies(raw, rel, scan)):
            receipt = _check(scan.bypassed, f"{rel}#{i}", attempt, step, body, key)
            if receipt is not None and receipt.rank not in covered:
                covered.add(receipt.rank)
                got.append(receipt)
    worlds = {r.world_size for r in got}
    if len(worlds) != 1 or covered != set(range(worlds.pop())):
        ranks = [
            n
            for n in _listed(storage, folder, "")
            if n.endswith(".json")
            and not posixpath.basename(n).startswith(NODE_PREFIX)
            and _rank_of(n) not in covered
        ]
        for name, raw in zip(ranks, read_many(storage, ranks), strict=True):
            if raw is not None:  # else gone since it was listed
                rel = posixpath.relpath(name, step_path)
                receipt = _check(scan.refused, rel, attempt, step, raw, key)
                if receipt is not None:
                    got.append(receipt)
    if got:
        scan.receipts[attempt] = got


def _listed(storage: StepStorage, folder: str, prefix: str) -> list[str]:
    """The objects under `folder` whose names start with `prefix` (listed by the store
    itself where it can, as S3 does), sorted."""
    try:
        found = storage.fs.find(folder, prefix=prefix)
    except FileNotFoundError:
        return []
    return sorted(str(n) for n in found if posixpath.basename(str(n)).startswith(prefix))


def _check(
    refused: list[tuple[str, str]],
    rel: str,
    attempt: str,
    step: int,
    raw: bytes | str,
    key: bytes | None,
) -> Receipt | None:
    """The receipt in `raw`, or None with (rel, why) added to `refused`."""
    try:
        receipt = Receipt.from_json(raw, key)
    except ManifestError as e:
        refused.append((rel, str(e)))
        return None
    if receipt.step != step or receipt.attempt != attempt:
        refused.append((rel, f"it is for step {receipt.step}, group {receipt.attempt!r}"))
        return None
    return receipt


def _node_bodies(raw: bytes | None, rel: str, scan: ReceiptScan) -> list[str]:
    """The receipts a node's object holds; none (and why, in the scan) when it is not
    one."""
    if raw is None:
        return []
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    held = doc.get("receipts") if isinstance(doc, dict) else None
    if (
        not isinstance(doc, dict)
        or doc.get("format") != NODE_FORMAT
        or not (isinstance(held, list) and all(isinstance(b, str) for b in held))
    ):
        scan.bypassed.append((rel, f"it is not a {NODE_FORMAT} document"))
        return []
    return held


def _rank_of(path: str) -> int | None:
    name = posixpath.basename(path).removesuffix(".json")
    return int(name[5:]) if name.startswith("rank_") and name[5:].isdigit() else None


def receipt_attempts(storage: StepStorage, step: int) -> set[str]:
    """The attempts (groups) with a receipt folder under a step: one listing of the
    receipts' folder, no receipt read."""
    base = f"{storage.step_path(step)}/{RECEIPTS_DIR}"
    with storage.io(f"listing the upload receipts of step {step}"):
        try:
            names = storage.fs.ls(base, detail=False)
        except FileNotFoundError:
            return set()
    return {posixpath.basename(str(n).rstrip("/")) for n in names}


def read_many(storage: StepStorage, paths: list[str]) -> list[bytes | None]:
    """The bytes of each of `paths` (None for one that is gone), read at once through
    a bounded pool, each read retried as the retry policy says; the first other error
    is raised once the reads already running have finished."""

    def read(path: str) -> bytes | None:
        try:
            return storage.retrying(lambda: storage.fs.cat_file(path))
        except FileNotFoundError:
            return None

    return parallel([lambda p=p: read(p) for p in paths], READ_THREADS)
