"""Helpers the package has once and several parts use: PyTorch's allocator settings read for expandable segments
(ebbtide.memory refuses preload regions under them; a rollout started under the shim drops them), and NVML
(``ebbtide._nvml``: never raises, says why it could not look)."""
import sys

import pytest

from ebbtide.memory import without_expandable_segments
from ebbtide.memory._common import expandable_segments_requested


@pytest.mark.parametrize("env, on", [
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
    ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128, expandable_segments : true"}, True),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, False),
    ({"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6,max_split_size_mb:64"}, False),
    ({"PYTORCH_CUDA_ALLOC_CONF": "not_expandable_segments:True"}, False),  # another key (read as a word, not text)
    ({}, False),
])
def test_expandable_segments_are_read_from_either_variable(env, on):
    assert expandable_segments_requested(env) is on
    assert expandable_segments_requested(without_expandable_segments(env)) is False


def test_without_expandable_segments_keeps_the_rest_as_written():
    # the colocated rollout starts under the preload shim with this (em.preload_env(em.without_expandable_segments(
    # env))): under expandable segments the shim sees no cudaMalloc and ebbtide.memory refuses its regions
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:128", "X": "1",
           "PYTORCH_ALLOC_CONF": "expandable_segments: true"}
    out = without_expandable_segments(env)
    assert out == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128", "X": "1"}
    assert env["PYTORCH_ALLOC_CONF"] == "expandable_segments: true"  # the input is not modified


def test_expandable_segments_default_to_this_process_environment(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert expandable_segments_requested() is True
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert expandable_segments_requested() is False


def test_nvml_never_raises_and_says_why(monkeypatch):
    from ebbtide import _nvml

    monkeypatch.setitem(sys.modules, "pynvml", None)  # as where nvidia-ml-py is not installed
    dev = _nvml.Device(uuid="GPU-0", index=0)
    assert not dev.ok and dev.why == _nvml.NOT_INSTALLED
    assert dev.processes() is None and dev.memory_used() is None and dev.sm_clock_mhz() is None
    dev.close()
    assert _nvml.compute_pids() == [] and _nvml.gpus() == ([], _nvml.NOT_INSTALLED)


def test_nvml_device_falls_back_to_the_index_and_counts_its_init(monkeypatch):
    from ebbtide import _nvml

    calls = []

    class Proc:
        def __init__(self, pid, used):
            self.pid, self.usedGpuMemory = pid, used

    class FakeNvml:
        NVML_CLOCK_SM = 1

        def nvmlInit(self):
            calls.append("init")

        def nvmlShutdown(self):
            calls.append("shutdown")

        def nvmlDeviceGetHandleByUUID(self, uuid):
            raise RuntimeError(f"no {uuid}")  # a MIG UUID, say

        def nvmlDeviceGetHandleByIndex(self, i):
            return ("h", i)

        def nvmlDeviceGetComputeRunningProcesses(self, h):
            return [Proc(11, 5 << 20), Proc(12, None)]

        def nvmlDeviceGetMemoryInfo(self, h):
            return type("M", (), {"used": 7, "total": 9})()

        def nvmlDeviceGetClockInfo(self, h, kind):
            return 1980

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    dev = _nvml.Device(uuid="abc", index=3)
    assert dev.ok and dev._h == ("h", 3)
    assert dev.processes() == {11: 5 << 20, 12: None} and dev.memory_used() == 7 and dev.sm_clock_mhz() == 1980
    dev.close()
    assert calls == ["init", "shutdown"] and not dev.ok
    assert not _nvml.Device(uuid="abc").ok  # no index to fall back to: says which device it could not find
