"""One rank's training, with no Ray in it: the step loop, save and load of its state.

`trainer` is the rank's loop (engine, step, eval); `process` is the rank's process
(DeepSpeed imported, its device, its process group); `comms` aborts the rank's
communicators when its group is over (gloo link cut, NCCL abort); `ds_config` derives
DeepSpeed's config from the spec; `engine` is the engine adapter, the only code that
touches DeepSpeed's private optimizer attributes; `state` snapshots and loads a rank's
share of a sharded, topology-free checkpoint, whose files are
`spotline.checkpoint.layout`'s and whose reads are `spotline.checkpoint.reshard`'s
(re-exported here for callers of this package).

Never here: Ray, storage backends, the controller. Training never waits for storage.
"""

from spotline.checkpoint.layout import FORMAT, RankSnapshot, rank_dir
from spotline.checkpoint.reshard import (
    combine_meta,
    directory_reader,
    full_params,
    read_index,
    store_reader,
)
from spotline.train.state import load, snapshot, write

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
