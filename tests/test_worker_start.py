"""What a new rank's process pays before its first step: DeepSpeed loads without the
MLflow import of its autotuner (about a second of every restart), and MLflow stays
importable afterwards."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit


def _fresh(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    return out.stdout.strip().splitlines()[-1]


def test_deepspeed_loads_without_mlflow_and_mlflow_still_imports() -> None:
    pytest.importorskip("mlflow")  # what makes DeepSpeed's import slow is its presence
    got = _fresh(
        "import sys\n"
        "from spotline.train.trainer import import_deepspeed\n"
        "ds = import_deepspeed()\n"
        "loaded = 'mlflow' in sys.modules\n"
        "import mlflow\n"
        "from deepspeed.autotuning import autotuner\n"
        "print(loaded, autotuner.has_mlflow, hasattr(mlflow, 'start_run'), ds.__name__)\n"
    )
    assert got == "False False True deepspeed"


def test_a_plain_import_of_deepspeed_does_load_mlflow() -> None:
    """The cost the helper avoids is real in this environment (else the test above
    would pass on its own)."""
    pytest.importorskip("mlflow")
    got = _fresh("import sys\nimport deepspeed\nprint('mlflow' in sys.modules)\n")
    assert got == "True"
