"""Preemption notices: sources that ask whether this node is about to go (Ray's node
drain and SIGTERM in `sources`, cloud metadata in `cloud`) and a watcher that reports
each notice once.

It only reports: it never stops a worker, saves a checkpoint or talks to training
itself (the controller decides what a notice means).
"""

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
