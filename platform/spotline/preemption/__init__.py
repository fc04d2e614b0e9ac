"""Preemption notices: sources that ask whether this node is about to go (cloud metadata,
Ray's node drain, SIGTERM) and a watcher that reports each notice once."""

from spotline.preemption.sources import (
    Notice,
    NoticeSource,
    make_source,
    register,
    source_class,
    source_names,
)
from spotline.preemption.watcher import NoticeWatcher

__all__ = [
    "Notice",
    "NoticeSource",
    "NoticeWatcher",
    "make_source",
    "register",
    "source_class",
    "source_names",
]
