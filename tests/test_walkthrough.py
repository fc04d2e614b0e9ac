"""What a new user meets following the README, checked without Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from spotline.runtime import cluster

pytestmark = pytest.mark.unit


def test_auto_looks_at_every_local_cluster_when_there_are_several(monkeypatch):
    from spotline.compat import ray as seam

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(seam, "local_gcs_addresses", lambda: {"127.0.0.1:7", "127.0.0.1:5"})
    assert cluster.cluster_candidates("auto") == ["127.0.0.1:5", "127.0.0.1:7"]
    # One cluster, or an address given (the flag or RAY_ADDRESS): Ray's own choice.
    assert cluster.cluster_candidates("10.0.0.1:6379") == ["10.0.0.1:6379"]
    monkeypatch.setattr(seam, "local_gcs_addresses", lambda: {"127.0.0.1:5"})
    assert cluster.cluster_candidates("auto") == ["auto"]
    monkeypatch.setattr(seam, "local_gcs_addresses", lambda: {"127.0.0.1:7", "127.0.0.1:5"})
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:7")
    assert cluster.cluster_candidates("auto") == ["auto"]


def test_the_readme_and_the_manual_install_transformers_before_using_it():
    import re

    import tomllib

    root = Path(__file__).resolve().parent.parent
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(r.startswith("transformers") for r in extras["hf"])
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    text = "\n".join(page.read_text() for page in pages)
    assert "from transformers" in text
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        if "from transformers" in block:
            before = block[: block.index("from transformers")]
            assert re.search(r"pip install .*\[[^]]*\bhf\b", before), block
