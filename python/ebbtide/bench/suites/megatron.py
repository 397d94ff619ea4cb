"""Suite `megatron`: a Megatron-core GPT (local layer spec, bf16, DDP; ~1.3 B params, --quick ~0.12 B) trained on
one GPU by ebbtide's adapter (``get_optimizer`` + ``TrainingState``) beside the configurations Megatron users run,
each in a fresh process of the same run:
- "hdo": Megatron's DistributedOptimizer + HybridDeviceOptimizer (offload fraction 1.0, D2H/H2D overlap, CPU torch
  AdamW) -- slime's optimizer -- with Megatron's own offload (``offload_grad_buffers`` + the buffers'
  ``offload_to_cpu``: grads freed, params to a pinned copy);
- "hdo_tms": the same optimizer, model and optimizer built in one torch_memory_saver region with CPU backup
  (pause/resume; 0.0.10 where importable). Slime's Megatron patch keeps the grad buffers out of the backup; this
  run does not reproduce it, so its pause also copies the bf16 grad buffer (2 B/param);
- "gpu_tms": the GPU-resident DistributedOptimizer, in the same torch_memory_saver region.
Rows (seconds, median of the measured steps; lower is better): optimizer step, offload, restore, the train phase
(fwd+bwd, same model: should read ~1x), the whole step (train + optimizer + offload + restore) against each anchor,
and the device memory in use while offloaded (driver view, GB). The optimizer row's limit is the larger of the CPU
floor (28 B/param at the host triad bandwidth) and the PCIe floor (bf16 grads down, bf16 params up).
"""
from __future__ import annotations

import importlib.util

from ..registry import Row, Skip, suite

SUITE = "megatron"
GB = 1e9


def _anchor_names():
    return {"hdo": "Megatron HDO (offload 1.0, overlap) + offload_grad_buffers/offload_to_cpu",
            "hdo_tms": "Megatron HDO (offload 1.0, overlap) + torch_memory_saver (CPU backup)",
            "gpu_tms": "Megatron GPU DistributedOptimizer + torch_memory_saver (CPU backup)"}


@suite(SUITE, needs="gpu", description="Megatron-core GPT on one GPU: ebbtide adapter vs HDO / torch_memory_saver")
def run(ctx):
    ctx.require_gpu()
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        raise Skip("megatron-core is not installed (pip install megatron-core==0.16.1)")
    from . import _megatron_worker as w  # noqa: PLC0415

    size = "quick" if ctx.quick else "default"
    steps, warmup = (3, 1) if ctx.quick else (5, 2)
    variants = ["ebbtide", "hdo"]
    if importlib.util.find_spec("torch_memory_saver") is not None:
        variants += ["hdo_tms", "gpu_tms"]
    else:
        ctx.note_skip("torch_memory_saver anchors", "torch_memory_saver is not installed")
    res = {}
    for v in variants:
        ctx.progress(f"megatron: {v}, model {size}, {warmup}+{steps} steps")
        try:
            res[v] = w.run("bench", {"variant": v, "size": size, "steps": steps, "warmup": warmup}, timeout=1800)
        except Exception as e:  # noqa: BLE001 (an anchor that fails loses its rows, not the suite)
            if v == "ebbtide":
                raise
            ctx.note_skip(f"megatron anchor {v}", str(e)[-300:])
    ours = res["ebbtide"]
    n = ours["params"]
    params = {"size": size, "params": n, "steps": steps, "device": ours["device"]}
    names = _anchor_names()

    def ph(r, k):
        return r["phases"][k]["median_s"] if r else None

    def total(r):
        return sum(ph(r, k) for k in ("train", "optimizer_step", "offload", "restore")) if r else None

    def row(name, ours_v, anchor, anchor_v, unit="s", **kw):
        return Row(SUITE, name, unit, ours_v, higher_is_better=False, anchor=anchor_v,
                   anchor_name=names.get(anchor, "") if anchor_v is not None else "",
                   anchor_note="" if anchor_v is not None else "not measured (see notes)", params=params, **kw)

    hdo = res.get("hdo")
    cpu_floor = 28.0 * n / (ctx.limits.host_triad_gbps() * GB)
    pcie_floor = max(2.0 * n / (ctx.limits.d2h_gbps() * GB), 2.0 * n / (ctx.limits.h2d_gbps() * GB))
    yield row(f"optimizer step, {n / 1e9:.2f} B params", ph(ours, "optimizer_step"), "hdo", ph(hdo, "optimizer_step"),
              limit=max(cpu_floor, pcie_floor), limit_name="max(CPU 28 B/param at triad, PCIe 2+2 B/param)")
    yield row("train phase (fwd+bwd, grad sync)", ph(ours, "train"), "hdo", ph(hdo, "train"),
              note="same model and data: ~1x expected")
    for anchor in ("hdo", "hdo_tms"):
        r = res.get(anchor)
        if r is None:
            continue
        yield row(f"offload (vs {anchor})", ph(ours, "offload"), anchor, ph(r, "offload"))
        yield row(f"restore (vs {anchor})", ph(ours, "restore"), anchor, ph(r, "restore"))
    for anchor in ("hdo", "hdo_tms", "gpu_tms"):
        r = res.get(anchor)
        if r is None:
            continue
        yield row(f"step: train + optimizer + offload + restore (vs {anchor})", total(ours), anchor, total(r),
                  note=f"anchor optimizer step {ph(r, 'optimizer_step') * 1e3:.0f} ms, offload "
                       f"{ph(r, 'offload') * 1e3:.0f} ms, restore {ph(r, 'restore') * 1e3:.0f} ms")
        yield row(f"device memory used while offloaded (vs {anchor})", ours["device_used_offloaded"] / GB, anchor,
                  r["device_used_offloaded"] / GB, unit="GB", note="driver view: CUDA context and NCCL included")
