"""Spotline's pytest plugin is found by pytest on install (entry point `pytest11`): a
test suite that declares nothing gets `spot_cluster` and its configuration fixture, and
`-p no:spotline` leaves them out. In a pytest session inside this one; nothing started.
"""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

pytest_plugins = ["pytester"]

pytestmark = pytest.mark.unit

_TESTS = """
def test_the_fixture_is_there(spot_cluster_config):
    assert spot_cluster_config.nodes == 2
"""


def test_the_plugin_is_registered_as_an_entry_point() -> None:
    (ep,) = [e for e in entry_points(group="pytest11") if e.name == "spotline"]
    assert ep.value == "spotline.testing"


# Other plugins installed beside Spotline may start processes as they load.
_QUIET = ("-q", "-p", "no:cacheprovider", "-p", "no:benchmark")


def test_a_suite_that_declares_nothing_gets_the_spot_cluster_fixtures(pytester) -> None:
    pytester.makepyfile(test_user=_TESTS)
    pytester.runpytest_inprocess(*_QUIET).assert_outcomes(passed=1)
    out = pytester.runpytest_inprocess(*_QUIET, "-p", "no:spotline")
    out.assert_outcomes(errors=1)
    assert "fixture 'spot_cluster_config' not found" in out.stdout.str()
