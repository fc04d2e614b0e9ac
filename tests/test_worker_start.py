"""What a new rank's process pays before its first step: DeepSpeed loads without the
MLflow import of its autotuner (about a second of every restart), and MLflow stays
importable afterwards; building an engine does not load torch's inductor compiler for
DeepSpeed's Muon optimizer (about another second). The controller's plan builds the
layers on the meta device without loading torch._dynamo (a second more). A state
keeper's process (its memory and start-up CPU are its copies') and a command that runs
no job load neither torch nor the planner."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _fresh(code: str) -> str:
    """What a fresh interpreter prints last: a new rank's process, as it starts."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.procs
def test_deepspeed_loads_without_mlflow_and_mlflow_still_imports() -> None:
    pytest.importorskip("mlflow")  # what makes DeepSpeed's import slow is its presence
    got = _fresh(
        "import sys\n"
        "from spotline.train.process import import_deepspeed\n"
        "ds = import_deepspeed()\n"
        "loaded = 'mlflow' in sys.modules\n"
        "import mlflow\n"
        "from deepspeed.autotuning import autotuner\n"
        "print(loaded, autotuner.has_mlflow, hasattr(mlflow, 'start_run'), ds.__name__)\n"
    )
    assert got == "False False True deepspeed"


_PLAN_VIEW = (
    "import sys\n"
    "from spotline.config import load_spec\n"
    "from spotline.controller.snapshot import PlanView\n"
    "spec = load_spec('configs/quickstart.yaml', {overrides!r})\n"
    "view = PlanView(spec)\n"
    "assert view._ready.wait(240)\n"
    "print('deepspeed' in sys.modules, 'mlflow' in sys.modules, 'torch._dynamo' in sys.modules)\n"
)


@pytest.mark.procs
@pytest.mark.parametrize(
    ("overrides", "mlflow_loaded"),
    [
        ([], False),
        (["tracking=[{kind: mlflow, tracking_uri: 'file:///tmp/x', experiment: e}]"], True),
    ],
    ids=["no MLflow tracker", "an MLflow tracker"],
)
def test_the_controllers_plan_loads_deepspeed_without_mlflow_unless_a_tracker_needs_it(
    overrides: list[str], mlflow_loaded: bool
) -> None:
    """The controller loads DeepSpeed for the plan's schedule on a thread, while its
    loop may open an MLflow tracker: MLflow is hidden from DeepSpeed only where nothing
    else in the process imports it. Building the model's layers on the meta device for
    the plan does not load torch's compiler front end (torch._dynamo, about a second)."""
    pytest.importorskip("mlflow")
    assert _fresh(_PLAN_VIEW.format(overrides=overrides)) == f"True {mlflow_loaded} False"


@pytest.mark.procs
def test_a_plain_import_of_deepspeed_does_load_mlflow() -> None:
    """The cost the helper avoids is real in this environment (else the test above
    would pass on its own)."""
    pytest.importorskip("mlflow")
    got = _fresh("import sys\nimport deepspeed\nprint('mlflow' in sys.modules)\n")
    assert got == "True"


_ENGINE_CHECK = (
    "import sys, torch\n"
    "{imp}\n"
    "from deepspeed.runtime.zero.muon import muon_optimizer, original_muon\n"
    "print('torch._inductor.compile_fx' in sys.modules,"
    " hasattr(original_muon.muon_update, '__wrapped__'))\n"
)


@pytest.mark.procs
def test_the_engine_check_of_muon_does_not_load_the_compiler() -> None:
    """`is_zero_supported_optimizer`, run by every engine build, imports Muon's module;
    after `import_deepspeed` its compiled functions wait for their first call."""
    imp = "from spotline.train.process import import_deepspeed; import_deepspeed()"
    assert _fresh(_ENGINE_CHECK.format(imp=imp)) == "False True"


@pytest.mark.procs
def test_a_plain_import_of_muon_does_load_the_compiler() -> None:
    assert _fresh(_ENGINE_CHECK.format(imp="import deepspeed")) == "True True"


@pytest.mark.procs
def test_a_state_keepers_process_loads_neither_torch_nor_the_planner() -> None:
    got = _fresh(
        "import sys\n"
        "from spotline.runtime.keeper import StateKeeper\n"
        "StateKeeper(budget=None, steps=2)\n"
        "print(sorted(m for m in ('torch', 'deepspeed', 'spotline.planning', 'spotline.models',"
        " 'spotline.job') if m in sys.modules))\n"
    )
    assert got == "[]"


@pytest.mark.procs
def test_a_command_that_runs_no_job_loads_neither_torch_nor_the_planner() -> None:
    """`spotline status`, `report` and `--help` answer without torch's second of
    imports; the errors a job's run raises are still the ones the command explains."""
    got = _fresh(
        "import sys\n"
        "from spotline import cli\n"
        "loaded = sorted(m for m in ('torch', 'deepspeed', 'spotline.planning', 'spotline.job')"
        " if m in sys.modules)\n"
        "import spotline, types\n"
        "result = types.SimpleNamespace(summary=lambda: 'what the job did')\n"
        "print(loaded, cli._explain(spotline.JobFailed('boom', result))[1])\n"
    )
    assert got == "[] job failed: boom"


@pytest.mark.procs
def test_the_packages_names_still_load_on_first_use() -> None:
    got = _fresh(
        "import sys, spotline\n"
        "before = 'spotline.job' in sys.modules\n"
        "print(before, spotline.Job.__module__, spotline.load_spec.__module__,"
        " 'Job' in dir(spotline))\n"
    )
    assert got == "False spotline.job spotline.config.loader True"


@pytest.mark.unit
def test_a_deferred_compile_compiles_once_at_the_first_call_with_its_options() -> None:
    from spotline.train.process import compile_on_first_call

    compiled: list[tuple[str, dict]] = []

    def fake_compile(fn, **options):
        compiled.append((fn.__name__, options))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    lazy = compile_on_first_call(fake_compile)

    @lazy
    def square(x):
        return x * x

    @lazy(fullgraph=True)
    def add(x, y=1):
        return x + y

    assert compiled == [] and square.__name__ == "square"
    assert square(3) == ("compiled", 9) and square(4) == ("compiled", 16)
    assert add(1, y=2) == ("compiled", 3)
    assert compiled == [("square", {}), ("add", {"fullgraph": True})]
