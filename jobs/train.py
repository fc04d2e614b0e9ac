"""Entrypoint for `ray job submit`:

    ray job submit --working-dir . -- python jobs/train.py --config configs/quickstart.yaml

Connects to the cluster the job runs on (RAY_ADDRESS, set by Ray), runs the
job to completion and prints its summary. Exit code 1 if the job failed.
"""

import sys
from pathlib import Path

# With a working-dir upload of the repository, import Spotline from it when the
# cluster does not have it installed.
_src = Path(__file__).resolve().parent.parent / "platform"
if (_src / "spotline").is_dir() and str(_src) not in sys.path:
    sys.path.insert(0, str(_src))

# The driver's handler of SIGTERM (`ray job stop`) and Ctrl-C is in place before the
# slow imports: a signal during them ends the driver with a line saying that nothing was
# committed, not silently. `main` puts its own in place next.
from spotline.interrupts import Interrupts  # noqa: E402

_early = Interrupts()
_early.install()
_early.for_job = True
try:
    from spotline.cli import main
except KeyboardInterrupt:
    print(f"spotline: {_early.ended_at_once()}", file=sys.stderr)
    sys.exit(_early.code)

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
