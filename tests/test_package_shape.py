"""The package's shape, as ../shared/ARCHITECTURE.md's target layout draws it: every
import points down the layers or stays within its own, no module imports another that
imports it back (type-only imports and imports inside functions included), and no
module outgrows what one reader holds in mind. Read from the source with `ast`: nothing
is imported."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parent.parent / "platform" / "spotline"

# Layers from the foundation up: a module imports only from its own layer or below.
FOUNDATION, DOMAIN, TRAIN, RUNTIME, BACKFILL, CONTROLLER, FRONT = range(7)
LAYERS = {
    "config": FOUNDATION,
    "storage": FOUNDATION,
    "compat": FOUNDATION,
    "registry": FOUNDATION,
    "constants": FOUNDATION,
    "units": FOUNDATION,  # figures as messages print them
    "heap": FOUNDATION,  # garbage collection held back over a burst
    "planning": DOMAIN,
    "metrics": DOMAIN,
    "models": DOMAIN,
    "data": DOMAIN,
    "checkpoint": DOMAIN,
    "preemption": DOMAIN,
    "bubbles": DOMAIN,
    "train": TRAIN,
    "runtime": RUNTIME,
    "backfill": BACKFILL,
    "controller": CONTROLLER,
    # The front: the SDK, the CLI, Ray Tune, and the driver-side parts beside them.
    "job": FRONT,
    "job_outcome": FRONT,
    "job_index": FRONT,
    "interrupts": FRONT,
    "preflight": FRONT,
    "locate": FRONT,
    "report": FRONT,
    "hf_export": FRONT,
    "cli": FRONT,
    "cli_args": FRONT,
    "tune": FRONT,
    "chaos": FRONT,
    "testing": FRONT,
}
MAX_LINES = 600
MAX_CONTROLLER_LINES = 500  # controller/controller.py: the loop alone


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts).removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """The package's modules `path` imports anywhere in it (a name imported from a
    module counts as that module, or as the submodule it names)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name.startswith("spotline."):
                found.add(name)
    return found


GRAPH = {name: _imports(path) - {name} for name, path in MODULES.items()}


def _layer(module: str) -> int:
    return LAYERS[module.split(".")[1]]


def test_every_module_of_the_package_has_a_layer() -> None:
    homes = {m.split(".")[1] for m in MODULES if m != "spotline"}
    assert sorted(homes - set(LAYERS)) == [], "give each new part of the package a layer here"
    assert sorted(set(LAYERS) - homes) == [], "a layer names a part the package no longer has"


def test_no_import_runs_up_the_layers() -> None:
    upward = [
        f"{m} imports {t}"
        for m, targets in GRAPH.items()
        if m != "spotline"
        for t in sorted(targets)
        if _layer(t) > _layer(m)
    ]
    assert upward == []


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` (its modules in import order, the first again at the end), or
    None when there is none."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        return list(e.args[1])
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert sorted(set(_cycle(graph) or [])) == ["a", "b", "c"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_imports_one_that_imports_it_back() -> None:
    assert _cycle(GRAPH) is None


def test_no_module_outgrows_one_reader() -> None:
    too_long = {
        str(path.relative_to(PACKAGE)): n
        for path in MODULES.values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert too_long == {}
    loop = PACKAGE / "controller" / "controller.py"
    assert len(loop.read_text().splitlines()) <= MAX_CONTROLLER_LINES
