"""Hypothesis profiles for the property tests. Every profile is derandomized (the same examples on every run, so a
failure reproduces) and keeps no example database. "ci" (the default when CI is set) keeps the whole directory
under ~45 s on two cores; "dev" (the default otherwise) tries more examples; "deep" many more, for a soak run:
HYPOTHESIS_PROFILE=deep python -m pytest tests/property."""
from __future__ import annotations

import os

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, settings  # noqa: E402

_COMMON = dict(derandomize=True, database=None, deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=15, **_COMMON)
settings.register_profile("dev", max_examples=40, **_COMMON)
settings.register_profile("deep", max_examples=400, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))
