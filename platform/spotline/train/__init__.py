"""One rank's training state (no Ray here): sharded, topology-free checkpoints.

See `spotline.train.state`.
"""

from spotline.train.state import (
    FORMAT,
    RankSnapshot,
    combine_meta,
    directory_reader,
    full_params,
    load,
    rank_dir,
    read_index,
    snapshot,
    store_reader,
    write,
)

__all__ = [
    "FORMAT",
    "RankSnapshot",
    "combine_meta",
    "directory_reader",
    "full_params",
    "load",
    "rank_dir",
    "read_index",
    "snapshot",
    "store_reader",
    "write",
]
