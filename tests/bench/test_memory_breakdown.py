"""The memory suite's per-row breakdown (where a discard pause/resume spent its time) from an engine report."""
from __future__ import annotations

import pytest

from ebbtide.bench.suites.memory import breakdown


def test_pause_breakdown_names_driver_time_per_mapping_and_the_rest():
    ph = {"prepare_s": 0.0001, "sync_s": 0.0002, "meminfo_s": 0.0003, "copy_s": 0.0, "unmap_s": 0.004,
          "total_s": 0.0050, "unmap_calls": 1, "mappings": 8, "allocations": 8}
    note = breakdown("pause", 0.0060, ph)
    assert "unmap 4.00 (1 calls over 8 mappings, 500.0 us/mapping)" in note, note
    assert "drain 0.20" in note and "meminfo 0.30" in note, note
    assert "bookkeeping 0.60" in note, note  # 5.0 - (0.2 + 0.3 + 4.0) + 0.1 selection
    assert "outside the engine 0.90" in note, note  # 6.0 - 5.0 - 0.1
    assert "copy" not in note, note  # discard: no copy phase


def test_resume_breakdown_splits_the_map_phase():
    ph = {"prepare_s": 0.0, "meminfo_s": 0.0001, "create_s": 0.002, "map_call_s": 0.001, "access_s": 0.003,
          "map_s": 0.0062, "copy_s": 0.0, "total_s": 0.0065, "mappings": 4, "allocations": 1024}
    note = breakdown("resume", 0.0070, ph)
    assert "create 2.00 (4 mappings, 500.0 us each)" in note, note
    assert "map+release 1.00" in note and "setaccess 3.00" in note, note
    assert "bookkeeping 0.20" in note and "outside the engine 0.50" in note, note


def test_missing_report_gives_no_breakdown():
    assert breakdown("pause", 0.001, {}) == ""
    assert breakdown("resume", 0.001, {"total_s": None}) == ""


def test_the_breakdown_comes_from_the_median_cycle_not_the_last():
    pytest.importorskip("torch")
    from ebbtide.bench.suites._memory_worker import median_index
    assert median_index([5.0, 62.0, 2.0]) == 0      # the last cycle (2.0) is not the one the row reports
    assert median_index([3.0, 1.0, 2.0, 9.0, 4.0]) == 0
    assert median_index([1.0]) == 0
