"""The fsdp suite's rows from the FSDP2 colocated loop's results (the GPU run is the suite's own): which figure each
row compares, against which anchor and limit, and where the bytes come from."""
import pytest

pytest.importorskip("torch")

from ebbtide.bench.suites import fsdp  # noqa: E402

N = 10**9
CONTEXT = 0.5e9


def _variant(held=0.3e9, onload_bytes=0, **phases):
    base = dict(train=1.0, optimizer=0.5, rollout_resume=0.01, sync=0.1, comm_release=0.01, offload=0.2,
                generate=2.0, rollout_pause=0.01, onload=0.3, comm_reload=0.01)
    base.update(phases)
    setup = {"params": N, "device_name": "H200", "context_bytes": CONTEXT, "sync_bytes": 2 * N,
             "sync_bf16_bytes": 2 * N, "optimizer_floor_s": 0.28,
             "limits": {"h2d_gbps": 40.0, "d2h_gbps": 50.0, "d2d_gbps": 4000.0}}
    return {"summary": {"phase_s": base, "step_s": sum(base.values()), "bytes": {"onload": onload_bytes},
                        "memory": {"generate": {"trainer_nvml": CONTEXT + held}}},
            "ranks": [{"setup": setup}], "checks": {"correct": True, "no_growth": True}}


def test_rows_compare_each_phase_with_its_anchor_and_limit():
    res = {"config": {"steps": 5}, "variants": {
        "ebbtide": _variant(onload_bytes=2 * N, offload=0.01, onload=0.06, sync=0.004),
        "verl": _variant(held=2.84e9, offload=5.0, onload=1.5, sync=1.0),
        "tms": _variant(offload=4.0, onload=1.2, sync=1.0),
        "cpu-offload": _variant(optimizer=2.5)}}
    rows = {r.name.split(", Qwen3")[0]: r for r in fsdp.rows(res)}
    on = rows["onload of the training state (vs verl)"]
    assert on.limit == pytest.approx(2 * N / 40e9) and on.anchor == 1.5 and on.ours == 0.06
    assert rows["onload of the training state (vs tms)"].anchor == 1.2
    off = rows["offload of the training state (vs verl)"]
    assert off.limit is None and off.vs_anchor() == pytest.approx(5.0 / 0.01)
    sync = rows["weight sync (bf16, until the rollout holds it) (vs verl)"]
    assert sync.ours == pytest.approx(2 * N / 0.004 / 1e9) and sync.vs_anchor() == pytest.approx(250.0)
    assert sync.limit == pytest.approx(2 * N / ((2 * N + 6 * N) / 4000e9) / 1e9)
    opt = rows["optimizer step (ebbtide's CPU Adam) (vs cpu-offload)"]
    assert opt.anchor == 2.5 and opt.limit == 0.28
    mem = rows["trainer GPU memory while the rollout generates, above its CUDA context (vs verl)"]
    assert mem.ours == pytest.approx(0.3) and mem.anchor == pytest.approx(2.84) and mem.unit == "GB"
    over = rows["step overhead (all but train and generate) (vs verl)"]
    assert over.anchor == pytest.approx(0.5 + 0.01 + 1.0 + 0.01 + 5.0 + 0.01 + 1.5 + 0.01)
    steps = [r for k, r in rows.items() if k.startswith("RL step")]
    assert len(steps) == 3 and all(r.anchor is not None for r in steps)


def test_a_missing_anchor_leaves_its_rows_unmeasured_not_wrong():
    res = {"variants": {"ebbtide": _variant(), "tms": {"why": "not installed (torch_memory_saver)"}}}
    rows = list(fsdp.rows(res))
    assert rows and all(r.anchor is None and ("not measured" in r.anchor_note or "not installed" in r.anchor_note)
                        for r in rows)
    assert any("tms: not installed" in r.anchor_note for r in rows)
