"""The comm suite's row building (ebbtide.bench.suites.comm._rows) from synthetic per-rank results shaped like
cycle_scenario's, so the GPU-only suite's arithmetic and labels are checked on every CI run."""
import pytest

from ebbtide import comm
from ebbtide.bench.suites.comm import _rows

GB = 1e9


def _rank(rank: int, slow: float) -> dict:
    cyc = lambda rel, rl: {"free_released": 80 * GB, "release_s": rel * slow, "reload_first_s": rl * slow,  # noqa: E731
                           "strategies": {"destroy": 8}}
    others = [{"how": how, "concurrent": conc, **cyc(1.0 if how == "abort" else 0.6, 1.2)}
              for how in comm.TEARDOWNS for conc in (True, False)
              if (how, conc) != (comm.DEFAULT_TEARDOWN, True)]
    return {"rank": rank, "world": 2, "kind": "flat", "torch": "2.x", "nccl": "2.28.9", "env": {},
            "comm_bytes": 5 * GB, "comm_bytes_ctx": 5.3 * GB, "free_ctx": 85.3 * GB, "free_nccl": 85 * GB,
            "free_loaded": 80 * GB - 4.75 * GB, "anchor_free_loaded": 80 * GB, "anchor_free_destroyed": 83.85 * GB,
            "op_s": 26e-6, "anchor_op_s": 29e-6, "anchor_destroy_s": 1.5, "anchor_recreate_first_s": 1.2,
            "cycles_world": [cyc(1.3, 1.5)] * 3, "cycles_subgroups": [cyc(0.5, 1.2)] * 3,
            "teardown": {"how": comm.DEFAULT_TEARDOWN, "concurrent": True}, "other_teardowns": others,
            "soak": [[85 * GB, 9, 1.3, 1.5]] * 10}


def test_rows_name_our_teardown_and_each_other_one_once():
    rows = {r.name: r for r in _rows([_rank(0, 1.0), _rank(1, 1.1)], "2 GPUs flat", 10)}
    assert comm.DEFAULT_TEARDOWN == "shutdown" and comm.TEARDOWNS == ("shutdown", "abort")
    ours = "shutdown (ncclCommFinalize + destroy), concurrent"
    rel = rows[f"2 GPUs flat: release, WORLD kept (teardown: {ours})"]
    assert rel.ours == pytest.approx(0.55) and rel.anchor == 1.5  # the slowest rank
    for what in ("abort, concurrent", "abort, one at a time", "shutdown (ncclCommFinalize + destroy), one at a time"):
        assert f"2 GPUs flat: release, WORLD kept (teardown: {what})" in rows, sorted(rows)
    assert sum("(teardown:" in n for n in rows) == 4
    assert rows["2 GPUs flat: freed by release(include_world=True)"].ours == pytest.approx(95.0)
    assert rows["2 GPUs flat: free-memory drift after reload over 10 cycles (WORLD included)"].ours == 0


def test_deepep_rows_take_the_slowest_rank_and_the_median_cycle():
    from ebbtide.bench.suites.comm import _deepep_rows

    def rank(slow):
        cyc = [{"freed_bytes": 0.8 * GB, "rebuild_s": r * slow, "connect_s": 0.1 * slow} for r in (0.03, 0.02, 0.04)]
        return {"world": 2, "nvl_bytes": 2**30, "shape": [4096, 4096, 16, 4], "ctor_s": 0.024 * slow,
                "ctor_bytes": 0.1 * GB, "cycles": cyc, "before_s": 0.000668 * slow, "after_s": 0.000664 * slow}

    rows = {r.name: r for r in _deepep_rows([rank(1.0), rank(1.5)])}
    rebuild = rows["2 GPUs DeepEP: rebuild in reload (allocation + IPC exchange)"]
    assert rebuild.ours == pytest.approx(0.045) and rebuild.anchor == pytest.approx(0.036)
    after = rows["2 GPUs DeepEP: dispatch + combine after release/reload cycles"]
    assert after.ours == pytest.approx(0.996) and after.anchor == pytest.approx(1.002)
    assert len(rows) == 4
