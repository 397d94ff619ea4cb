"""tests/comm: put this folder on sys.path (comm_workers, the rank bodies) and, where the pytest-timeout plugin is
installed (the GPU image has it; CI need not), give each test with a ``DEADLINE_S`` entry in its module a pytest-level
timeout a little above its spawn deadline, as a backstop should the spawn helper itself get stuck. The signal
method raises inside the test, so the spawn helper's cleanup still kills the ranks and the next test runs."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_BACKSTOP_S = 20


def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("timeout"):
        return
    import pytest

    for item in items:
        deadlines = getattr(item.module, "DEADLINE_S", None) or {}
        if item.originalname in deadlines and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(deadlines[item.originalname] + _BACKSTOP_S, method="signal"))
