"""torch_memory_saver scenarios, one per process: ``python compat_scenarios.py <scenario> <preload|torch>``.

The same code runs against ebbtide's implementation (ebbtide.compat.shim_path() first on PYTHONPATH) and the real
package (its unpacked wheel on PYTHONPATH): it only ever does ``import torch_memory_saver``. test_compat_gpu.py sets
the environment (LD_PRELOAD of the implementation's preload library, TMS_INIT_ENABLE for process-wide scenarios).
Each step prints the device memory in use, so one run's log explains a failure. A scenario the implementation does
not offer in that mode raises Skip; on failure, ebbtide's stats and release report.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import torch

import torch_memory_saver as tms_module
from torch_memory_saver import torch_memory_saver as tms

import _scenario_runner
from _scenario_runner import GiB, MiB, Skip, main

IMPL = "ebbtide" if type(tms).__module__.startswith("ebbtide") else "tms"
MODE = sys.argv[2] if len(sys.argv) > 2 else "?"


def say(label: str) -> int:
    return _scenario_runner.say(label, f"[{IMPL}/{MODE}]")


def drop(before: int, after: int, at_least: int, what: str) -> None:
    assert before - after >= at_least, (f"{what}: device memory fell by {(before - after) / MiB:.1f} MiB, expected "
                                        f">= {at_least / MiB:.1f} MiB")


def set_mode(mode: str) -> None:
    tms.hook_mode = mode


# ---- scenarios (both hook modes unless they raise Skip) ---------------------------------------------------------

def simple(mode: str):
    set_mode(mode)
    with tms.region(tag="kv"):
        x = torch.full((GiB // 4,), 7.0, device="cuda")
    ptr = x.data_ptr()
    u0 = say("after 1 GiB in region 'kv'")
    tms.pause("kv")
    u1 = say("after pause('kv')")
    drop(u0, u1, int(0.9 * GiB), "pause")
    tms.resume("kv")
    u2 = say("after resume('kv')")
    drop(u2, u1, int(0.9 * GiB), "resume (memory back in use)")
    assert x.data_ptr() == ptr, "address changed"
    x.fill_(3.0)
    assert torch.all(x == 3.0).item()


def cpu_backup(mode: str):
    set_mode(mode)
    with tms.region(tag="w", enable_cpu_backup=True):
        x = torch.arange(64 * MiB, dtype=torch.int32, device="cuda")
        y = torch.full((3, 1000), 5.5, device="cuda")
    ref, ref_y = x.cpu(), y.cpu()
    u0 = say("after 256 MiB + small in CPU-backed region 'w'")
    tms.pause("w")
    u1 = say("after pause('w')")
    drop(u0, u1, int(0.9 * 256 * MiB), "pause")
    b = tms.get_cpu_backup(x)
    assert b is not None and b.device.type == "cpu" and b.dtype == x.dtype and b.shape == x.shape, b
    assert torch.equal(b, ref), "CPU backup differs from the content at pause"
    bz = tms.get_cpu_backup(y, zero_copy=True)
    assert bz is not None and torch.equal(bz, ref_y), "zero-copy backup of a small tensor differs"
    tms.resume("w")
    assert torch.equal(x.cpu(), ref) and torch.equal(y.cpu(), ref_y), "content not restored"
    x.add_(1)
    tms.pause("w")
    tms.resume("w")
    assert torch.equal(x.cpu(), ref + 1), "second cycle lost the update made after the first resume"


def multiple_tags(mode: str):
    set_mode(mode)
    ts = {}
    for tag in ("a", "b"):
        with tms.region(tag=tag, enable_cpu_backup=True):
            ts[tag] = torch.full((512 * MiB // 4,), float(ord(tag)), device="cuda")
    u0 = say("after 512 MiB in 'a' and 'b'")
    tms.pause("a")
    u1 = say("after pause('a')")
    drop(u0, u1, int(0.45 * GiB), "pause('a')")
    assert torch.all(ts["b"] == ord("b")).item(), "tag 'b' was touched by pause('a')"
    tms.resume("a")
    # Measure again: the checks above loaded kernels and cached small blocks (about 130 MiB on H200, both
    # implementations alike), which no pause gives back.
    u0 = say("after resume('a')")
    tms.pause()
    u2 = say("after pause() of all")
    drop(u0, u2, int(0.9 * GiB), "pause()")
    tms.resume()
    for tag, t in ts.items():
        assert torch.all(t == ord(tag)).item(), f"tag {tag} content"


def cuda_graph(mode: str):
    if IMPL == "tms" and mode == "torch":
        raise Skip("torch_memory_saver supports pausable CUDA graphs only in preload mode")
    set_mode(mode)
    n = 16 * MiB // 4
    with tms.region(tag="weights", enable_cpu_backup=True):
        static_x = torch.zeros(n, device="cuda")
        w = torch.full((n,), 2.0, device="cuda")
    # A first cycle sets up the runtime's copy streams, which take a few MiB of device memory of their own
    # (else the measured pause of the graph below comes out short by that much).
    tms.pause("weights")
    tms.resume("weights")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture, as torch.cuda.graph asks
        for _ in range(2):
            (static_x * w + 1).repeat(8).view(8, -1).sum(0)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    # torch.cuda.graph() empties the cache on entry: measure after that, or the warm-up's ~160 MiB of cached
    # blocks given back there hide the capture's growth.
    torch.cuda.empty_cache()
    u_before = say("before capture")
    with tms.cuda_graph(cuda_graph=g, tag="graph"):
        big = (static_x * w + 1).repeat(8)  # 128 MiB of graph-private memory
        static_y = big.view(8, -1).sum(0)
    u0 = say("after capture into tag 'graph'")
    assert u0 - u_before >= 128 * MiB, "the capture allocated less than its buffers"
    static_x.copy_(torch.arange(n, device="cuda", dtype=torch.float32) % 1000)
    g.replay()
    ref = static_y.clone()
    u0 = say("before pause('graph')")  # after the input fill's own temporaries were cached
    tms.pause("graph")
    u1 = say("after pause('graph')")
    drop(u0, u1, 128 * MiB, "pause('graph')")
    tms.pause("weights")
    tms.resume("weights")
    tms.resume("graph")
    say("after resume")
    g.replay()
    assert torch.equal(static_y, ref), "replay after resume gave a different result"
    static_x.fill_(1.0)
    g.replay()
    assert torch.all(static_y == 24.0).item(), "replay with new input"


def training_engine(mode: str):
    """Everything the process allocates is pausable (TMS_INIT_ENABLE=1, CPU backup); disable() runs other work;
    the caching allocator evicts its cache when a large allocation needs the room."""
    if mode != "preload":
        raise Skip("process-wide capture (TMS_INIT_ENABLE) is a preload-mode feature")
    assert os.environ.get("TMS_INIT_ENABLE") == "1" and os.environ.get("TMS_INIT_ENABLE_CPU_BACKUP") == "1"
    set_mode(mode)
    initial = torch.full((1_000_000,), 42, dtype=torch.uint8, device="cuda")
    m_init = say("init")
    weights = [torch.full((n,), 42, dtype=torch.uint8, device="cuda") for n in (GiB, MiB, 1024, 42)]

    def forward():
        ones = torch.ones((GiB,), dtype=torch.float32, device="cuda")  # 4 GiB of "activations"
        avg = sum(w.float().mean() for w in weights) / len(weights)
        out = (ones * avg).mean().item()
        assert out == 42, out

    forward()
    m_fwd = say("after forward")
    assert m_fwd > m_init + 5 * GiB, "weights and cached activations should hold > 5 GiB"
    tms.pause()
    m_pause = say("after pause()")
    assert m_pause < m_init + 200 * MiB, "pause() left more than 200 MiB above the initial level"
    with tms.disable():
        m_dis = say("in disable()")
        assert abs(m_dis - m_pause) <= 2 * MiB
        t = torch.full((GiB,), 53, dtype=torch.uint8, device="cuda")
        assert t.float().mean().item() == 53
        assert say("after work in disable()") > m_dis + 4 * GiB
        del t
    m_exit = say("after leaving disable()")
    assert m_exit <= m_pause + 10 * MiB, "disable()'s memory was not given back on exit"
    tms.resume()
    m_res = say("after resume()")
    expect = m_fwd - m_pause
    assert abs((m_res - m_exit) - expect) < 50 * MiB, (m_res - m_exit, expect)
    forward()
    assert abs(say("after second forward") - m_res) < 2 * MiB, "the second forward should reuse the cache"
    total = torch.cuda.mem_get_info()[1]
    a = torch.full((int(total * 0.3),), 42, dtype=torch.uint8, device="cuda")
    b = torch.full((int(total * 0.3),), 42, dtype=torch.uint8, device="cuda")
    say("cache eviction: after a, b")
    del a, b
    c = torch.full((int(total * 0.6),), 42, dtype=torch.uint8, device="cuda")  # needs the cached a, b evicted
    say("cache eviction: after c")
    initial += 1
    assert torch.all(initial == 43).item()
    del c


def unaligned_free_while_paused(mode: str):
    """A raw 6912-byte cudaMalloc (not a multiple of the VMM granularity) in the process-wide tag, freed while
    paused, then the cycle once more with a fresh one."""
    if mode != "preload":
        raise Skip("raw cudaMalloc capture is a preload-mode feature")
    set_mode(mode)
    torch.zeros(1, device="cuda")  # context up
    api = ctypes.CDLL(None)
    cuda_malloc, cuda_free = api.cudaMalloc, api.cudaFree
    cuda_malloc.argtypes, cuda_malloc.restype = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t], ctypes.c_int
    cuda_free.argtypes, cuda_free.restype = [ctypes.c_void_p], ctypes.c_int
    ptr = ctypes.c_void_p()
    assert cuda_malloc(ctypes.byref(ptr), 6912) == 0 and ptr.value
    if IMPL == "ebbtide":
        from ebbtide import _native  # noqa: PLC0415

        assert _native.load().memory.lookup(ptr.value)[2] == "default", "the raw cudaMalloc was not captured"
    tms.pause()
    assert cuda_free(ptr) == 0, "cudaFree of a paused allocation failed"
    tms.resume()
    assert cuda_malloc(ctypes.byref(ptr), 6912) == 0
    tms.pause()
    tms.resume()
    assert cuda_free(ptr) == 0


def nested_region(mode: str):
    """A region inside the process-wide default (TMS_INIT_ENABLE=1, CPU backup): the inner tag is discarded on
    pause, the outer content survives, and the default applies again after the region."""
    if mode != "preload":
        raise Skip("process-wide capture (TMS_INIT_ENABLE) is a preload-mode feature")
    set_mode(mode)
    size = 10_000_000
    weight = torch.full((size,), 42.0, device="cuda")
    with tms.region(tag="grad_buffer", enable_cpu_backup=False):
        grad = torch.full((size,), 99.0, device="cuda")
    m0 = say("before pause")
    tms.pause()
    m1 = say("after pause")
    assert m1 < m0 - size * 4 * 0.5 * 2, "pause should release both weight and grad buffer"
    tms.resume()
    assert torch.all(weight == 42.0).item(), "CPU-backed default content lost"
    grad.fill_(0.0)
    assert torch.all(grad == 0.0).item()
    extra = torch.full((size,), 7.0, device="cuda")
    tms.pause()
    tms.resume()
    assert torch.all(extra == 7.0).item(), "allocation after the region should be CPU-backed again"
    if IMPL == "ebbtide":
        from ebbtide import _native  # noqa: PLC0415

        look = _native.load().memory.lookup
        assert look(grad.data_ptr())[2] == "grad_buffer" and look(extra.data_ptr())[2] == "default"


def subprocess_configuration(mode: str):
    """configure_subprocess() makes a child start in preload mode (the parent is not preloaded)."""
    if mode != "preload":
        raise Skip("configure_subprocess configures preload-mode children")
    assert "LD_PRELOAD" not in os.environ or "torch_memory_saver" not in os.environ["LD_PRELOAD"]
    with tms_module.configure_subprocess():
        env = dict(os.environ)
    p = subprocess.run([sys.executable, __file__, "_preloaded_child", "preload"], capture_output=True, text=True,
                       env=env, timeout=240)
    print(p.stdout[-3000:], p.stderr[-3000:], sep="\n")
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), f"child failed ({p.returncode})"


def _preloaded_child(mode: str):
    set_mode("preload")
    with tms.region(tag="c", enable_cpu_backup=True):
        x = torch.full((512 * MiB // 4,), 9.0, device="cuda")
    u0 = say("child: after 512 MiB")
    tms.pause("c")
    drop(u0, say("child: after pause"), int(0.45 * GiB), "child pause")
    tms.resume("c")
    assert torch.all(x == 9.0).item()


# before every scenario: this module is imported only in a scenario's own process
print(f"[{IMPL}/{MODE}] torch_memory_saver from {tms_module.__file__}; LD_PRELOAD={os.environ.get('LD_PRELOAD')}",
      flush=True)
torch.cuda.init()

if __name__ == "__main__":
    main(globals())
