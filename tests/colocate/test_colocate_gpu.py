"""The colocated loop on real GPUs (short --quick runs): correctness, no growth, memory handed over, the anchor.
Run by the lead on an H100/H200: ``pytest -m gpu tests/colocate`` (1 GPU) and ``pytest -m multigpu
tests/colocate`` (2 GPUs)."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest


def _run(tmp_path, gpus: int):
    # results.json, timeline.png and the logs go where scripts/gpu-check collects artifacts, if it does
    art = os.environ.get("EBBTIDE_TEST_ARTIFACTS")
    if art:
        tmp_path = pathlib.Path(art) / f"colocate-{gpus}gpu"
        tmp_path.mkdir(parents=True, exist_ok=True)
    # 3 steps (2 measured): both variants fit gpu-check's 240 s per-test deadline with room to spare
    cmd = [sys.executable, "-m", "ebbtide.colocate", "--quick", "--steps", "3", "--warmup", "1", "--gpus",
           str(gpus), "--out", str(tmp_path), "--timeout", "180"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    logs = "".join(f"\n--- {f.name}\n{f.read_text()[-6000:]}" for f in sorted(tmp_path.glob("*.log")))
    print(p.stdout)  # the table, shown with -s or on failure
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}{logs}"
    return json.loads((tmp_path / "results.json").read_text()), f"{p.stdout}{logs}"


def _used(summary: dict, phase: str, role: str):
    m = summary["memory"].get(phase, {})
    return m.get(f"{role}_nvml", m.get("device_used"))


def _check_variant(res: dict, name: str, gpus: int, diag: str):
    v = res["variants"][name]
    assert v.get("summary"), f"{name}: {v.get('why')}\n{diag}"
    ck = v["checks"]
    assert ck["correct"] is True, f"{name}: {ck['verify']}\n{diag}"
    assert ck["no_growth"] is True, f"{name}: {ck['growth']}\n{diag}"
    if gpus > 1:
        assert ck["ranks_in_sync"] is True, f"{name}: {ck['verify']}"
    s = v["summary"]
    # the memory really changes hands: the trainer holds less after its pause than after training, the rollout
    # less after its pause than while generating (per process with NVML, else the device total)
    assert _used(s, "trainer_pause", "trainer") < _used(s, "train", "trainer"), (name, s["memory"])
    assert _used(s, "rollout_pause", "rollout") < _used(s, "generate", "rollout"), (name, s["memory"])


@pytest.mark.gpu
def test_quick_loop_one_gpu(tmp_path):
    res, diag = _run(tmp_path, 1)
    _check_variant(res, "ebbtide", 1, diag)
    if importlib.util.find_spec("torch_memory_saver") is not None:
        _check_variant(res, "anchor", 1, diag)
    else:
        assert res["variants"]["anchor"]["why"].startswith("not installed")


@pytest.mark.multigpu
def test_quick_loop_two_gpus(tmp_path):
    res, diag = _run(tmp_path, 2)
    _check_variant(res, "ebbtide", 2, diag)
    if importlib.util.find_spec("torch_memory_saver") is not None:
        _check_variant(res, "anchor", 2, diag)
