"""The fsdp suite's rows from its workers' results (the GPU run is the suite's own): which figure each row compares,
against which anchor and limit, and where the bytes come from."""
import pytest

pytest.importorskip("torch")

from ebbtide.bench.suites import fsdp  # noqa: E402


class Limits:
    def d2h_gbps(self):
        return 50.0

    def h2d_gbps(self):
        return 40.0

    def d2d_gbps(self):
        return 4000.0

    def host_triad_gbps(self):
        return 100.0


def _result(variant, moved, **phases):
    n = 10**9
    base = dict(train=1.0, optimizer=0.5, sync=0.1, offload=0.2, onload=0.3)
    base.update(phases)
    return {"variant": variant, "params": n, "device": "H200", "bytes_moved_each_way": moved,
            "phases": {k: {"median_s": v, "all_s": [v]} for k, v in base.items()},
            "held_while_offloaded": 0.3e9, "reserved_outside": 0.05e9, "source_bytes": 2 * n, "wire_bytes": 2 * n}


def test_rows_compare_each_phase_with_its_anchor_and_limit():
    n = 10**9
    res = {"ebbtide": _result("ebbtide", 2 * n, offload=0.01, onload=0.06, sync=0.004),
           "ebbtide-gpu-adam": _result("ebbtide-gpu-adam", 12 * n, offload=0.25, onload=0.32),
           "verl": _result("verl", 12 * n, offload=5.0, onload=1.5, sync=1.0),
           "tms": _result("tms", 12 * n, offload=4.0, onload=1.2, sync=1.0),
           "cpu-offload": _result("cpu-offload", 0, optimizer=2.5)}
    rows = {r.name.split(", Qwen3")[0]: r for r in fsdp.rows(res, Limits())}
    off = rows["offload (ebbtide-gpu-adam: verl's fp32 shards and GPU AdamW: 12 B/param, as verl moves; vs verl)"]
    assert off.limit == pytest.approx(12 * n / 50e9) and off.vs_anchor() == pytest.approx(5.0 / 0.25)
    on = rows["onload (ebbtide; vs verl)"]
    assert on.limit == pytest.approx(2 * n / 40e9) and on.anchor == 1.5
    assert rows["onload (ebbtide; vs tms)"].anchor == 1.2
    assert rows["offload (ebbtide: CPU optimizer: shards dropped, rebuilt from its bf16 host mirror; vs verl)"] \
        .limit is None
    sync = rows["weight sync (bf16, rollout holds it)"]
    assert sync.ours == pytest.approx(2 * n / 0.004 / 1e9) and sync.vs_anchor() == pytest.approx(250.0)
    assert sync.limit == pytest.approx(2 * n / ((2 * n + 6 * n) / 4000e9) / 1e9)
    opt = rows["optimizer step (ebbtide's CPU Adam)"]
    assert opt.anchor == 2.5 and opt.limit == pytest.approx(28 * n / 100e9)
    steps = {k: r for k, r in rows.items() if k.startswith("step:")}
    assert len(steps) == 3 and steps["step: train + optimizer + sync + offload + onload (vs verl)"].vs_anchor() == \
        pytest.approx((1 + 0.5 + 1 + 5 + 1.5) / (1 + 0.5 + 0.004 + 0.01 + 0.06))
    mem = rows["trainer GPU memory while offloaded, above its CUDA context (ebbtide; vs verl)"]
    assert mem.ours == pytest.approx(0.3) and mem.unit == "GB"


def test_a_missing_anchor_leaves_its_rows_unmeasured_not_wrong():
    res = {"ebbtide": _result("ebbtide", 2 * 10**9)}
    rows = list(fsdp.rows(res, Limits()))
    assert rows and all(r.anchor is None and "not measured" in r.anchor_note for r in rows)
