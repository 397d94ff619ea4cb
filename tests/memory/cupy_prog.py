"""A CuPy program (no PyTorch) run entirely under the shim in process-wide mode: started with
ebbtide.memory.preload_env(default_tag="cupy", default_backup="cpu"), every CuPy allocation lands in tag "cupy";
the program pauses and resumes itself through ebbtide (Python over the C API, no torch) and checks its data and
the driver's free memory. CuPy links cudart statically (its cudaMalloc never reaches the shim: measured on H200,
0 calls forwarded), so the program installs ebbtide.memory.cupy_allocator(), which follows the same default-tag
routing. ``main`` skips without CuPy (Skip), or fails with diagnostics."""
from __future__ import annotations

import sys

from _scenario_runner import Skip

try:
    import cupy
except ImportError as e:
    cupy, NO_CUPY = None, f"cupy not importable: {e}"

import ebbtide.memory as em

MiB = 1 << 20


def free_bytes() -> int:
    cupy.cuda.Device().synchronize()
    return cupy.cuda.runtime.memGetInfo()[0]


def main() -> None:
    if cupy is None:
        raise Skip(NO_CUPY)
    assert "torch" not in sys.modules, "this program must not use PyTorch"
    assert em.hook_mode() == "preload", "run it with LD_PRELOAD (ebbtide.memory.preload_env)"
    cupy.cuda.set_allocator(em.cupy_allocator())
    x = cupy.arange(128 * MiB, dtype=cupy.int32)  # 512 MiB
    y = cupy.random.default_rng(0).standard_normal(32 * MiB, dtype=cupy.float32)  # 128 MiB
    ref_x, ref_y = x.get(), y.get()
    rows = [r for r in em.stats()["tags"] if r["tag"] == "cupy"]
    g = em.stats()["global"]
    print(f"tag rows {rows}\nglobal {g}", flush=True)
    assert sum(r["bytes_active"] for r in rows) >= 640 * MiB, (
        "CuPy's allocations did not reach the engine through ebbtide.memory.cupy_allocator(): "
        f"forwarded cudaMalloc calls {g['forwarded_allocs']} / {g['forwarded_bytes']} bytes")
    em.pause("cupy")  # a first cycle sets up the runtime's streams
    em.resume("cupy")
    f0 = free_bytes()
    rep = em.pause("cupy")
    f1 = free_bytes()
    print(f"pause: {rep}\nfree before {f0 / MiB:.1f} MiB, after {f1 / MiB:.1f} MiB", flush=True)
    assert f1 - f0 >= 0.99 * rep.bytes and rep.bytes >= 640 * MiB, "the driver did not get the memory back"
    em.resume("cupy")
    assert (x.get() == ref_x).all() and (y.get() == ref_y).all(), "CuPy data changed across pause/resume"
    assert int((x * 2)[-1].get()) == 2 * (128 * MiB - 1)  # kernels on resumed memory


if __name__ == "__main__":
    main()
    print("OK")
