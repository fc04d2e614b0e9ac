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

from spotline.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
