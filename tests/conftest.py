"""Shared test setup: GPU markers skip loudly (with the reason) where the hardware is missing; fixtures every
component's tests use. Reusable test logic (fresh processes, ports, bit comparison, scenarios) is ebbtide.testing."""
from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=None)
def gpu_count() -> tuple[int, str]:
    try:
        import torch
    except ImportError:
        return 0, "torch is not installed"
    if not torch.cuda.is_available():
        return 0, "no CUDA GPU visible to torch"
    return torch.cuda.device_count(), ""


def pytest_collection_modifyitems(config, items):
    n, why = gpu_count()
    for item in items:
        if "multigpu" in item.keywords and n < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2+ CUDA GPUs: {why or f'found {n}'}"))
        elif "gpu" in item.keywords and n < 1:
            item.add_marker(pytest.mark.skip(reason=f"needs a CUDA GPU: {why}"))


def pytest_report_header(config):
    n, why = gpu_count()
    return f"ebbtide: {n} CUDA GPU(s){' (' + why + ')' if why else ''}"


@pytest.fixture(scope="session")
def native():
    """The native extension module, or a skip saying why it is not built here."""
    from ebbtide import _native  # noqa: PLC0415

    try:
        return _native.load()
    except ImportError as e:
        pytest.skip(f"native extension not built here: {e}")
