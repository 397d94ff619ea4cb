"""The bench's first outputs tell the truth: a limit measured with the kernel's own stream mix, a figure past its
limit marked with why, only ebbtide's figures in the ebbtide column, an anchor that is not installed said once with
how to install it, a chart readable alone, and arguments checked before the run."""
from __future__ import annotations

import sys

import pytest

from ebbtide.bench import report
from ebbtide.bench.registry import Context, Row
from ebbtide.errors import InvalidArgumentError, UnsupportedError


def test_the_stream_mix_probe_runs_the_adam_mixes_and_refuses_others():
    from ebbtide import _native
    from ebbtide.bench.limits import MIXES

    C = _native.load()
    for counts, per_element, _ in MIXES.values():
        assert C.host_stream_bandwidth(*counts, 1 << 16, 1, 1) > 0
        f32r, f32u, bf16r, bf16u, bf16w = counts
        assert 4 * f32r + 8 * f32u + 2 * bf16r + 4 * bf16u + 2 * bf16w == per_element  # the bytes the row counts
    with pytest.raises(UnsupportedError, match=r"no compiled probe for the mix \(2, 1, 0, 0, 0\).*the mixes: "):
        C.host_stream_bandwidth(2, 1, 0, 0, 0, 1 << 16)
    with pytest.raises(InvalidArgumentError, match="writes nothing"):
        C.host_stream_bandwidth(1, 0, 0, 0, 0, 1 << 16)


def test_a_figure_past_its_limit_is_marked_with_why():
    rows = [Row("optim", "fast", "GB/s", 104.0, limit=100.0, limit_name="Adam stream mix (2 threads)"),
            Row("optim", "ok", "GB/s", 50.0, limit=100.0),
            Row("sync", "peak", "GiB", 0.9, higher_is_better=False, limit=1.0, over_limit_why="under the ceiling")]
    text = report.table(rows)
    assert "104% !" in text and "50%" in text and "50% !" not in text
    assert "! optim: fast: 104% of Adam stream mix (2 threads): past the limit measured in this run" in text
    assert "! sync: peak: 111% of its limit: under the ceiling" in text


def test_an_anchor_that_is_not_installed_is_said_once():
    rows = [Row("memory", f"pause {n}", "ms", 1.0, higher_is_better=False, anchor_name="torch_memory_saver",
                anchor_note="not installed (pip install torch_memory_saver)") for n in range(3)]
    text = report.table(rows)
    assert text.count("pip install torch_memory_saver") == 1
    assert text.count("- (torch_memory_saver not installed)") == 3


class _FixedLimits:
    def host_stream_gbps(self, mix, threads=0):
        return 1e6

    def host_stream_name(self, mix, threads):
        return f"{mix} ({threads} threads)"


def test_optim_rows_hold_only_ebbtides_figures_and_deepspeed_once(monkeypatch):
    torch = pytest.importorskip("torch")
    from ebbtide.bench.suites import optim

    monkeypatch.setattr(optim.os, "sched_getaffinity", lambda pid: {0, 1})  # thread counts 1 and 2
    have_ds = True
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        have_ds = False
    ctx = Context(quick=True, gpus=0, limits=_FixedLimits(), log=lambda s: None)
    rows = list(optim._cpu_rows(ctx, torch))
    assert rows and not any(r.name.lower().startswith("torch") for r in rows)  # torch is an anchor, never "ours"
    loop = [r for r in rows if r.anchor_name == "torch for-loop AdamW (foreach=False)"]
    assert len(loop) == 1 and loop[0].ours > 0 and loop[0].anchor > 0 and "(fast)" in loop[0].name
    assert all(r.limit == 1e6 and r.limit_name for r in rows)
    assert {r.limit_name.split(" (")[0] for r in rows} == {"adam_fp32_grads", "adam_bf16_grads", "adam_bf16_moments"}
    ds_rows = [r for r in rows if "DeepSpeed" in r.name]
    if not have_ds:
        assert ds_rows == [] and [w for what, w in ctx.skipped if "DeepSpeed" in what] == [
            "not installed (pip install deepspeed; its CPUAdam op builds on first use)"]


def test_the_chart_is_readable_alone(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure
    import matplotlib.text

    drawn = []
    real = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: (
        drawn.extend(t.get_text() for t in fig.findobj(matplotlib.text.Text)), real(fig, *a, **k))[1])
    rows = [Row("optim", "AdamW step (fast)", "GB/s", 87.0, anchor=29.0, anchor_name="torch fused AdamW", limit=100.0),
            Row("optim", "over", "GB/s", 104.0, limit=100.0),
            Row("memory", "pause", "ms", 3.0, higher_is_better=False, anchor_name="torch_memory_saver",
                anchor_note="not installed (pip install torch_memory_saver)")]
    env = {"ebbtide": "0.1.0", "time": "2026-05-01T12:34:56Z", "cpu": {"model": "AMD EPYC", "affinity_threads": 2},
           "gpus": [], "torch": {"version": "2.13.0"}}
    path = tmp_path / "bench.png"
    report.plot(rows, str(path), env=env, skipped=[("limits: device copy", "no CUDA GPU")])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = "\n".join(drawn)
    for needle in ("87%", "104% !", "3.00x vs torch fused AdamW", "torch_memory_saver not installed",
                   "2026-05-01 12:34 UTC", "AMD EPYC, 2 threads, no GPU, torch 2.13.0",
                   "skipped limits: device copy: no CUDA GPU", "! optim: over: 104% of its limit",
                   "anchor torch_memory_saver: not installed (pip install torch_memory_saver)", "no limit"):
        assert needle in text, (needle, text)


def test_a_chart_that_is_not_a_png_is_refused_before_running(tmp_path):
    from ebbtide.testing import spawn

    p = spawn.command([sys.executable, "-m", "ebbtide", "bench", "limits", "--quick", "--plot", str(tmp_path / "x.txt")],
                      timeout=120, check=False)
    assert p.returncode == 2 and "--plot" in p.stderr and "name a file ending in .png" in p.stderr, p.stderr
    assert "nothing was run" in p.stderr and "== suite" not in p.stderr and "Traceback" not in p.stderr
