"""Suite `limits`: the physical limits every other suite compares against, each beside what the common tool
reaches on the same operation (torch's in-place add_ for the triad; torch copies for the GPU links are the probes
themselves)."""
from __future__ import annotations

import time

from ..registry import Row, Skip, suite

GB = 1e9


def _torch_add_gbps(quick: bool) -> tuple[float | None, str]:
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return None, "not installed"
    n = ((256 if quick else 1024) << 20) // 4
    a = torch.ones(n)
    b = torch.full((n,), 0.5)
    times = []
    for i in range(6 if quick else 10):
        t0 = time.perf_counter()
        a.add_(b, alpha=1e-6)
        if i:  # first pass warms up
            times.append(time.perf_counter() - t0)
    return 3 * n * 4 / min(times) / GB, ""


@suite("limits", needs="cpu", description="host memory, device copy and PCIe bandwidth measured in this run")
def run(ctx):
    triad = ctx.limits.host_triad_gbps()
    anchor, note = _torch_add_gbps(ctx.quick)
    yield Row("limits", "host in-place triad (all threads)", "GB/s", triad, anchor=anchor,
              anchor_name="torch add_", anchor_note=note, limit=triad, limit_name="host triad",
              note="3 streams: read a, read b, write a")
    if not ctx.has_gpu:
        ctx.note_skip("limits: device copy, pinned H2D/D2H", "no CUDA GPU")
        return
    probes = [("device-to-device copy", ctx.limits.d2d_gbps, "read + written"),
              ("pinned H2D copy", ctx.limits.h2d_gbps, "PCIe"),
              ("pinned D2H copy", ctx.limits.d2h_gbps, "PCIe"),
              ("pinned H2D + D2H at once", ctx.limits.bidir_gbps, "aggregate of both directions")]
    for name, probe, note in probes:
        try:
            value = probe()
        except Skip as e:
            yield Row("limits", name, "GB/s", None, note=f"skipped: {e}")
            continue
        yield Row("limits", name, "GB/s", value, anchor_note="n/a (limit probe)", limit=value, limit_name=name,
                  note=note)
