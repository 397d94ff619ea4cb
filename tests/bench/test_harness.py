"""The benchmark harness on a CPU-only machine: table, JSON, chart, clear messages for bad input."""
import json
import subprocess
import sys

from ebbtide.bench.registry import Row
from ebbtide.bench import report


def bench(*args, env=None):
    import os

    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "ebbtide", "bench", *args], capture_output=True, text=True,
                          env=e, timeout=300)


def test_quick_run_writes_table_json_and_png(tmp_path):
    j, png = tmp_path / "b.json", tmp_path / "b.png"
    p = bench("limits", "--quick", "--json", str(j), "--plot", str(png))
    assert p.returncode == 0, p.stderr
    assert "host in-place triad" in p.stdout and "of limit" in p.stdout
    doc = json.loads(j.read_text())
    assert doc["quick"] is True and doc["rows"], doc
    row = doc["rows"][0]
    assert row["ours"] > 0 and row["limit"] > 0 and row["unit"] == "GB/s"
    assert "environment" in doc and doc["environment"]["ebbtide"]
    assert any(k.startswith("host_triad_gbps") for k in doc["limits"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_gpu_the_gpu_parts_are_reported_as_skipped():
    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("this machine has a GPU")
    p = bench("--quick")
    assert p.returncode == 0, p.stderr
    assert "skipped limits: device copy, pinned H2D/D2H: no CUDA GPU" in p.stdout


def test_unknown_suite_is_a_clear_error():
    p = bench("nosuch")
    assert p.returncode == 2
    assert "unknown suite(s) nosuch" in p.stderr and "available:" in p.stderr
    assert "Traceback" not in p.stderr


def test_missing_matplotlib_is_a_clear_error(tmp_path):
    # Hide matplotlib from the child: a None entry in sys.modules makes its import fail.
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['matplotlib'] = None\n")
    import os

    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    p = bench("limits", "--quick", "--plot", str(tmp_path / "x.png"), env=env)
    assert p.returncode == 2
    assert "matplotlib is not installed" in p.stderr and "Traceback" not in p.stderr


def test_list_names_every_suite():
    p = bench("--list")
    assert p.returncode == 0 and "limits" in p.stdout


def test_row_ratios_respect_the_direction_of_the_unit():
    fast = Row("s", "bw", "GB/s", 50.0, anchor=25.0, limit=55.0)
    assert fast.vs_anchor() == 2.0 and abs(fast.of_limit() - 50 / 55) < 1e-12
    lat = Row("s", "latency", "ms", 10.0, higher_is_better=False, anchor=40.0, limit=5.0)
    assert lat.vs_anchor() == 4.0 and lat.of_limit() == 0.5
    none = Row("s", "x", "ms", None)
    assert none.vs_anchor() is None and none.of_limit() is None
    text = report.table([fast, Row("s", "y", "GB/s", 3.0, anchor_note="not installed")])
    assert "2.00x" in text and "not installed" in text and "91%" in text


def test_every_suite_module_registers_a_callable_taking_ctx():
    import importlib
    import inspect
    from ebbtide.bench.registry import SUITE_MODULES, registered
    for name, module in SUITE_MODULES.items():
        importlib.import_module(module)  # the registry rejects a suite function with the wrong signature
        fn = registered()[name].fn
        assert list(inspect.signature(fn).parameters) == ["ctx"], (name, fn.__qualname__)


def test_the_registry_rejects_a_suite_function_that_cannot_take_ctx():
    import pytest
    from ebbtide.bench.registry import suite
    with pytest.raises(TypeError, match="exactly one argument"):
        suite("bogus")(lambda ours, label, op, n: "")
