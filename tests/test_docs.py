"""The manual in docs/: it builds with MkDocs in strict mode (no broken link, anchor or
page left out of the navigation), its spec and command-line references are what the
code generates, and the README stays the short front door that links into it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent


def test_the_spec_reference_is_what_the_models_generate():
    from spotline.config import reference

    committed = (ROOT / "docs" / "reference" / "spec.md").read_text()
    assert committed == reference.render(), (
        "docs/reference/spec.md differs from the job spec's models; regenerate it with "
        f"`{reference.COMMAND}`"
    )


def test_the_spec_reference_has_every_field_with_its_default_and_doc():
    from spotline.config import JobSpec, ParallelSpec
    from spotline.config.reference import attribute_docs, render

    page = render()
    for name in JobSpec.model_fields:
        assert f"| `{name}` |" in page
    row = next(line for line in page.splitlines() if line.startswith("| `zero_stage` |"))
    assert "`1`" in row and "ZeRO stage" in row
    assert attribute_docs(ParallelSpec)["pipeline_stages"].startswith("Pipeline stages (p)")
    assert "{#backfill-tasks-kind-speculative}" in page and "{#sweep-scheduler-kind-pbt}" in page


def test_the_manual_builds_in_strict_mode(tmp_path):
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    config = load_config(str(ROOT / "mkdocs.yml"), strict=True, site_dir=str(tmp_path / "site"))
    build(config)  # raises on any warning: a broken link or anchor, a page not in the nav
    assert (tmp_path / "site" / "reference" / "spec" / "index.html").is_file()


def test_the_readme_is_a_short_front_door_into_the_manual():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    assert "pip install -e . && spotline run configs/quickstart.yaml" in readme
    assert 'pip install -e ".[test]" && python -m pytest' in readme
    # No spec table written by hand: the reference is generated.
    assert not re.search(r"^\| `(model|parallel|elastic|checkpoint)` \|", readme, re.M)
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert links, "the README links into docs/"
    for link in links:
        assert (ROOT / link).is_file(), link
    # What has run only under fakes is said on the front door.
    assert "gpu_check.py" in readme and "NCCL" in readme


def test_benchmark_figures_live_in_the_benchmarks_readme_with_dates_and_commands():
    text = (ROOT / "benchmarks" / "README.md").read_text()
    results = text[text.index("## Results") :]
    for block in re.split(r"\n### ", results)[1:]:
        title = block.splitlines()[0]
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", block), f"{title}: no date"
        assert re.search(r"^    (python benchmarks/|spotline )", block, re.M), (
            f"{title}: no command"
        )
