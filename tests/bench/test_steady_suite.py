"""The `steady` suite's arithmetic and rows, from synthetic worker results (the measurements themselves need a GPU:
scripts/gpu-check runs them)."""
import pytest

from ebbtide.bench.registry import Context, Skip
from ebbtide.bench.suites import steady


def _worker(gen_ms: float, fwd_ms: float, cold_us: float = 100.0, offloaded: bool = False) -> dict:
    g = gen_ms / 1e3
    decode = {"generate_s": [g, g * 1.02], "first_after_cycle_s": [g * 1.01], "step_us": [1000.0],
              "step_after_cycle_us": [1010.0], "decode_gpu_s": [g * 0.9]}
    out = {"decode": {"graph": decode, "eager": dict(decode, generate_s=[g * 4])},
           "train": {"fwd_bwd_s": [fwd_ms / 1e3] * 3},
           "alloc": {f"{w}/{s}": {"cold_us": cold_us, "warm_us": 10.0} for w in ("default", "region")
                     for s in steady.ALLOC_SIZES}}
    if offloaded:
        out["train"]["fwd_bwd_offloaded_overlap_s"] = [fwd_ms * 1.1 / 1e3]
        out["train"]["fwd_bwd_offloaded_plain_s"] = [fwd_ms / 1e3]
    return out


def test_summary_median_and_round_spread():
    runs = [{"x": [1.0, 3.0]}, {"x": [2.0]}, {"y": 5}]
    s = steady.summary(runs, ("x",), 1e3)
    assert s == {"median": 2000.0, "lo": 2000.0, "hi": 2000.0, "n": 3}  # round medians 2.0 and 2.0
    assert steady.summary(runs, ("z",)) is None


def test_rows_put_each_ebbtide_setup_beside_the_plain_process():
    runs = {"plain": [_worker(100, 30, 50)] * 2, "ebbtide-preload": [_worker(101, 30.3, 60)] * 2,
            "ebbtide-torch": [_worker(99, 30, 70, offloaded=True)] * 2, "compat-torch": [_worker(100, 31)],
            "tms-torch": [_worker(98, 30, 80)] * 2}
    rows = list(steady.decode_rows(runs, {})) + list(steady.train_rows(runs, {})) + list(steady.alloc_rows(runs))
    by = {r.name: r for r in rows}
    r = by["CUDA-graph decode, steady (ebbtide LD_PRELOAD shim, default tag)"]
    assert r.ours == pytest.approx(101 * 1.01) and r.anchor == pytest.approx(101.0)  # medians of g, 1.02 g
    assert r.anchor_name == steady.ANCHOR and not r.higher_is_better
    assert "torch_memory_saver torch mode" in r.note and "device time" in r.note
    assert by["training forward + backward (ebbtide.compat.torch_memory_saver)"].ours == pytest.approx(31)
    ov = by["training forward + backward with OffloadedAdam, gradient download overlapped with the backward"]
    assert ov.ours == pytest.approx(33) and ov.anchor == pytest.approx(30)
    step = by["decode step replayed right after a pause/resume cycle (ebbtide LD_PRELOAD shim, default tag)"]
    assert step.ours == pytest.approx(1010) and step.anchor == pytest.approx(1000)
    a = by["torch.empty 2 MiB reaching the allocator (shim default tag vs cudaMalloc)"]
    assert a.ours == pytest.approx(60) and a.anchor == pytest.approx(50)
    t = by["torch.empty 2 MiB reaching the allocator in a region (ebbtide vs torch_memory_saver)"]
    assert t.ours == pytest.approx(70) and t.anchor == pytest.approx(80)
    # a setup that did not measure something has no row for it
    del runs["compat-torch"][0]["decode"]["eager"]
    names = [r.name for r in steady.decode_rows(runs, {})]
    assert not any("eager" in n and "compat" in n for n in names) and any("eager" in n for n in names)


def test_suite_skips_without_a_gpu():
    ctx = Context(quick=True, gpus=0, limits=None, log=lambda m: None)
    with pytest.raises(Skip, match="CUDA GPU"):
        list(steady.run(ctx))


def test_worker_parts_follow_the_setup():
    assert set(steady.PARTS) == set(__import__("ebbtide.bench.suites._steady_worker",
                                               fromlist=["MODES"]).MODES)
    assert steady.sizes(True)["rounds"] >= 2 and steady.sizes(False)["rounds"] >= 2  # interleaved rounds


def test_update_row_puts_the_receive_beside_the_anchors_load():
    def part(gen_ms, dev_ms, load_ms):
        return {"generate_s": [gen_ms / 1e3] * 3, "decode_gpu_s": [dev_ms / 1e3] * 3, "load_s": [load_ms / 1e3] * 3}

    plain = [{"update": {"ebbtide": part(163, 151.6, 13.4), "torch": part(164, 151.5, 13.1)}}] * 2
    (row,) = steady.update_rows(plain, {"batch": 16})
    assert row.ours == pytest.approx(163) and row.anchor == pytest.approx(164) and not row.higher_is_better
    assert "151.6 vs 151.5" in row.note and "13.4 ms" in row.note and "anchor's load" in row.anchor_name
    assert list(steady.update_rows([{"decode": {}}], {})) == []  # a worker without the part: no row


def _hf(wall_ms: float, cpu_ms: float) -> dict:
    w, c = wall_ms / 1e3, cpu_ms / 1e3
    return {"hf": {"generate_s": [w, w], "cpu_s": [c, c], "after_cycle_s": [w * 1.1] * 2,
                   "after_cycle_cpu_s": [c * 1.1] * 2}}


def test_hf_rows_put_the_fsdp2_rollouts_decode_beside_the_plain_process():
    runs = {"plain": [_hf(2900, 2880)] * 2, "ebbtide-preload": [_hf(3100, 3090)] * 2,
            "ebbtide-torch": [{"decode": {}}], "tms-torch": [_hf(2950, 2940)] * 2}
    rows = {r.name: r for r in steady.hf_rows(runs, {"hf_batch": 16})}
    assert set(rows) == {
        "transformers Qwen3 eager decode, steady (the FSDP2 loop's rollout; ebbtide LD_PRELOAD shim, default tag)",
        "transformers Qwen3 eager decode, first generate after a pause/resume cycle (the FSDP2 loop's rollout; "
        "ebbtide LD_PRELOAD shim, default tag)"}  # a setup without the part has no row
    r = rows["transformers Qwen3 eager decode, steady (the FSDP2 loop's rollout; ebbtide LD_PRELOAD shim, default tag)"]
    assert r.ours == pytest.approx(3100) and r.anchor == pytest.approx(2900) and not r.higher_is_better
    assert "CPU time 3090.0 vs 2880.0 ms" in r.note and "torch_memory_saver torch mode 2950.0 ms" in r.note


def test_workers_leave_out_the_parts_asked(monkeypatch):
    seen = {}

    def call(fn, wspec, **kw):
        seen.update(wspec)
        return {}

    monkeypatch.setattr(steady.spawn, "call", call)
    steady.run_worker("plain", {"x": 1}, skip=("hf",))
    assert seen["parts"] == ["decode", "train", "alloc", "update"] and seen["decodes"] == ["graph", "eager"]
    steady.run_worker("tms-torch", {"x": 1})
    assert seen["parts"] == ["decode", "train", "alloc", "hf"]


def test_the_hf_part_decodes_on_the_cpu():
    # the worker's part itself, plain setup, a tiny Qwen3 on the CPU (no cycle there: nothing to pause)
    pytest.importorskip("transformers")
    from ebbtide.bench.suites import _steady_worker as w

    spec = {"hf_model": {"vocab": 512, "d_model": 128, "n_layers": 2, "n_heads": 4, "d_ff": 256, "max_seq": 128},
            "hf_batch": 2, "hf_prompt_len": 8, "hf_new_tokens": 4, "hf_reps": 2, "device": "cpu"}
    out = w.hf_decode_rows(w._Memory("plain"), spec)
    assert len(out["generate_s"]) == len(out["after_cycle_s"]) == 2 and out["distinct_checksums"] == 1
    assert all(0 < c <= t * 1.05 + 0.01 for c, t in zip(out["cpu_s"], out["generate_s"]))


def test_the_progress_line_carries_the_hf_decode_figures():
    from ebbtide.bench.suites.steady import brief

    line = brief({"hf": {"generate_s": [0.5, 0.6], "cpu_s": [0.49, 0.58], "after_cycle_s": [0.55]},
                  "train": {"fwd_bwd_s": [0.01]}})
    assert line == "fwd+bwd 10.0, hf decode 550.0, its CPU 535.0, hf after a cycle 550.0 ms", line
