"""Phase records, summaries (median, slowest rank, warm-up), the growth check, the report and the timeline."""
import pytest

from ebbtide.bench.colocate.measure import (GROWTH_TOLERANCE, PHASES, NvmlProbe, Recorder, format_report, growth_check,
                                      plot_timeline, steady_check, summarize)


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _rank(times: dict, steps: int, used=lambda s: 10 << 30):
    """A rank whose phase p of step s takes times[p] * (s + 1) seconds."""
    clock = _Clock()
    rec = Recorder(clock=clock)
    for s in range(steps):
        for p, dt in times.items():
            with rec.phase(s, p) as info:
                clock.t += dt * (s + 1)
                info["bytes"] = 1000
            rec.sample(s, p, {"nvml": {"trainer": 1 << 30, "rollout": 2 << 30}, "device_used": used(s),
                              "self": {"rollout": 5}})
    return {"phases": rec.phases, "memory": rec.memory}


def test_recorder_times_phases_and_refuses_unknown_names():
    r = _rank({"train": 1.0, "generate": 0.5}, 2)
    assert [(p["step"], p["phase"], p["s"]) for p in r["phases"]] == [
        (0, "train", 1.0), (0, "generate", 0.5), (1, "train", 2.0), (1, "generate", 1.0)]
    assert r["phases"][1]["t0"] == r["phases"][0]["t1"]
    with pytest.raises(ValueError, match="unknown phase"):
        Recorder().phase(0, "nap")


def test_a_failing_phase_is_not_recorded():
    rec = Recorder()
    with pytest.raises(RuntimeError), rec.phase(0, "train"):
        raise RuntimeError("boom")
    assert rec.phases == []


def test_summary_takes_medians_after_warmup_and_the_slowest_rank():
    fast = _rank({"train": 1.0, "generate": 0.5}, 4)
    slow = _rank({"train": 3.0, "generate": 0.1}, 4)
    s = summarize([fast, slow], warmup=1)  # steps 1..3: factors 2, 3, 4 -> median 3
    assert s["steps"] == 3
    assert s["phase_s"]["train"] == pytest.approx(9.0)  # slow rank
    assert s["phase_s"]["generate"] == pytest.approx(1.5)  # fast rank
    assert s["step_s"] == pytest.approx(3 * 3.1)  # the slow rank's whole step
    assert s["bytes"] == {"train": 1000, "generate": 1000}
    assert s["memory"]["generate"] == {"trainer_nvml": 1 << 30, "rollout_nvml": 2 << 30, "rollout_self": 5,
                                       "device_used": 10 << 30}
    with pytest.raises(ValueError):
        summarize([], warmup=0)


def test_growth_check():
    steady = _rank({"comm_reload": 0.1}, 5)["memory"]
    g = growth_check(steady, warmup=1)
    assert g["ok"] is True and g["growth_bytes"] == 0 and g["phase"] == "comm_reload"
    leaking = _rank({"trainer_resume": 0.1}, 5, used=lambda s: (10 << 30) + s * (64 << 20))["memory"]
    g = growth_check(leaking, warmup=1)
    assert g["ok"] is False and g["growth_bytes"] == 3 * (64 << 20) and g["phase"] == "trainer_resume"
    small = _rank({"trainer_resume": 0.1}, 5, used=lambda s: (10 << 30) + s * (GROWTH_TOLERANCE // 8))["memory"]
    assert growth_check(small, warmup=1)["ok"] is True
    assert growth_check(steady, warmup=4)["ok"] is None  # one step left: cannot tell


def test_report_and_timeline(tmp_path):
    ours = _rank({p: 0.01 for p in PHASES}, 3)
    anchor = _rank({p: 0.03 for p in PHASES}, 3)
    res = {"config": {"warmup": 1}, "variants": {
        "ebbtide": {"ranks": [ours], "summary": summarize([ours], 1), "checks": {"correct": True, "verify": []}},
        "anchor": {"ranks": [anchor], "summary": summarize([anchor], 1)}}}
    text = format_report(res)
    assert "speed-up" in text and "3.00x" in text and "comm_reload" in text
    assert "check correctness (rollout after sync == trainer's weights dequantized): True" in text
    res["variants"]["anchor"] = {"why": "not installed (torch_memory_saver)"}
    assert "anchor: not measured (not installed (torch_memory_saver))" in format_report(res)
    pytest.importorskip("matplotlib")
    png = tmp_path / "t.png"
    assert plot_timeline(res, str(png)) == ""
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_says_which_decode_ran_and_what_the_anchor_holds():
    ours = dict(_rank({p: 0.01 for p in PHASES}, 2), setup={"rollout": {
        "decode_used": "cuda-graph", "graph_bytes": 48 << 20, "graph_pausable": True}})
    anchor = dict(_rank({p: 0.03 for p in PHASES}, 2), setup={"rollout": {
        "decode_used": "cuda-graph", "graph_bytes": 50 << 20, "graph_pausable": False}})
    res = {"config": {"warmup": 1, "decode": "cuda-graph"}, "variants": {
        "ebbtide": {"ranks": [ours], "summary": summarize([ours], 1)},
        "anchor": {"ranks": [anchor], "summary": summarize([anchor], 1)}}}
    text = format_report(res)
    assert "slowest rank; rollout decode: cuda-graph)" in text
    assert "ebbtide rollout decode: cuda-graph, graph memory 0.050 GB, released by its pause" in text
    assert "anchor rollout decode: cuda-graph, graph memory 0.052 GB, HELD while paused" in text
    for v in res["variants"].values():
        v["ranks"][0]["setup"]["rollout"] = {"decode_used": "eager"}
    res["config"]["decode"] = "eager"
    text = format_report(res)
    assert "rollout decode: eager)" in text and "graph memory" not in text


def test_unavailable_nvml_probe_reports_why():
    p = NvmlProbe.unavailable("device is cpu")
    assert not p.ok and p.why == "device is cpu"
    assert p.processes() == {} and p.sample() == {"nvml": {}, "device_used": None}


def _steady_results(ours_times: dict, anchor_times: dict, detail=None):
    ours, anchor = _rank(ours_times, 3), _rank(anchor_times, 3)
    for r, d in zip((ours, anchor), detail or ()):
        for p in r["phases"]:
            if p["phase"] == "generate":
                p["decode_gpu_s"] = d
    return {"config": {"warmup": 1}, "variants": {
        "ebbtide": {"ranks": [ours], "summary": summarize([ours], 1)},
        "anchor": {"ranks": [anchor], "summary": summarize([anchor], 1)},
        "missing": {"why": "not installed"}}}


def test_steady_check_compares_the_steady_phases_only():
    res = _steady_results({"train": 0.10, "optimizer": 0.05, "generate": 0.2},
                          {"train": 0.10, "optimizer": 0.50, "generate": 0.19}, detail=(0.15, 0.14))
    checks = {c["phase"]: c for c in steady_check(res, tolerance=0.03)}
    assert set(checks) == {"train", "generate"}  # the optimizer is not the same code in both
    assert checks["train"]["ok"] and checks["train"]["ratio"] == pytest.approx(1.0)
    g = checks["generate"]
    assert g["anchor"] == "anchor" and g["ratio"] == pytest.approx(0.2 / 0.19) and not g["ok"]
    assert g["ours_device_s"] == pytest.approx(0.15) and g["anchor_device_s"] == pytest.approx(0.14)
    assert all(c["ok"] for c in steady_check(res, tolerance=0.06))  # 5.3% slower: within 6%
    text = format_report(res)
    assert "== steady phases" in text and "SLOWER" in text and "decode on the device 150.0 vs 140.0 ms" in text
    res["variants"].pop("anchor")
    assert steady_check(res) == []  # nothing to compare with


def test_steady_check_says_when_the_medians_are_within_the_step_to_step_spread():
    # generate read 2.28 vs 2.97 s in one H200 run and 3.88 vs 2.48 s in the one before, same code: each step's
    # time is kept, and overlapping ranges wider than the tolerance are reported beside the verdict
    res = _steady_results({"train": 0.10, "generate": 0.2}, {"train": 0.10, "generate": 0.19})
    for name, vals in (("ebbtide", [2.7, 3.7]), ("anchor", [2.2, 2.8])):
        summary = res["variants"][name]["summary"]
        summary["phase_s_all"].update(generate=vals, train=[0.1, 0.1])
        summary["phase_s"].update(generate=sum(vals) / 2, train=0.1)
    checks = {c["phase"]: c for c in steady_check(res, tolerance=0.03)}
    g = checks["generate"]
    assert not g["ok"] and g["within_spread"] and g["ours_range_s"] == [2.7, 3.7] and g["anchor_range_s"] == [2.2, 2.8]
    assert checks["train"]["within_spread"] is False  # equal steps: nothing wide
    text = format_report(res)
    assert "steps ranged 2700.0-3700.0 vs 2200.0-2800.0 ms: within the step-to-step spread" in text
    res["variants"]["anchor"]["summary"]["phase_s_all"]["generate"] = [1.0, 1.1]  # apart: a real difference
    assert {c["phase"]: c for c in steady_check(res, tolerance=0.03)}["generate"]["within_spread"] is False
