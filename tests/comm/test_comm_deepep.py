"""DeepEP buffers released and reloaded with the process groups: the tracking, guard and refusals on Gloo with a CPU
stand-in of ``deep_ep`` (CI), and the real DeepEP through Megatron's fused_a2a buffer on 2 GPUs (``multigpu``;
needs the wheel scripts/build-deepep makes). Scenarios in deepep_workers.py."""
from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("torch.distributed")

import torch  # noqa: E402

from ebbtide.testing import spawn  # noqa: E402

DEADLINE_S = {"test_standin_cycles": 90, "test_standin_disagreement": 90, "test_deepep_megatron_buffer_cycles": 240}


def test_standin_cycles():
    res = spawn.ranks("standin", 2, module="deepep_workers", timeout=DEADLINE_S["test_standin_cycles"])
    assert all(len(r["cycles"]) == 3 for r in res)


def test_standin_disagreement():
    res = spawn.ranks("standin_disagreement", 2, module="deepep_workers",
                     timeout=DEADLINE_S["test_standin_disagreement"])
    assert all("different DeepEP buffers" in r["msg"] for r in res)


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs of one host (DeepEP's NVLink buffers)")
@pytest.mark.skipif(importlib.util.find_spec("deep_ep") is None,
                    reason="deep_ep is not installed (scripts/build-deepep builds it on the GPU machine)")
def test_deepep_megatron_buffer_cycles():
    pytest.importorskip("megatron.core")
    res = spawn.ranks("real", 2, module="deepep_workers", timeout=DEADLINE_S["test_deepep_megatron_buffer_cycles"])
    for r in res:
        print(f"DeepEP: {r['nvl_bytes'] / 2**20:.0f} MiB NVLink buffer; Megatron get_buffer "
              f"{r['ctor_s'] * 1e3:.1f} ms; dispatch+combine {r['before_s'] * 1e3:.3f} ms before, "
              f"{r['after_s'] * 1e3:.3f} ms after; cycles {r['cycles']}")
        for c in r["cycles"]:
            assert c["freed_bytes"] >= r["ctor_bytes"], (c, r["ctor_bytes"])  # all DeepEP took came back
        assert r["after_s"] <= 1.10 * r["before_s"], (r["before_s"], r["after_s"])


def test_build_script_refuses_bad_input_with_a_reason(tmp_path):
    """scripts/build-deepep (run on GPU machines) names what is wrong before building anything."""
    import os
    import subprocess

    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "build-deepep")
    r = subprocess.run(["bash", script, "--bogus"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown option --bogus" in r.stderr
    r = subprocess.run(["bash", script, "--src", str(tmp_path / "missing.tar.gz")], capture_output=True, text=True)
    assert r.returncode == 1 and "does not exist" in r.stderr
    (tmp_path / "notdeepep").mkdir()
    r = subprocess.run(["bash", script, "--src", str(tmp_path / "notdeepep")], capture_output=True, text=True,
                       env={**os.environ, "PATH": os.environ.get("PATH", "") + ":/usr/local/cuda/bin"})
    assert r.returncode == 1, r.stderr
    assert ("not a DeepEP source tree" in r.stderr or "nvcc not found" in r.stderr
            or "has no CUDA build" in r.stderr), r.stderr
