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

Then the colocated RL loop on the same kind of model (``ebbtide colocate --trainer megatron``: a rollout
process on the same GPU, weights pushed every step; the same ~1.3 B shape, --quick ~0.12 B), each variant in fresh
processes of the same run: "ebbtide" (the adapter + ebbtide.sync over CUDA IPC + ebbtide.memory in the rollout),
"slime" (HDO, torch_memory_saver for trainer and rollout, groups destroyed and re-created, the slime-style FP8
update) and "gpu-tms" (GPU DistributedOptimizer under torch_memory_saver). Rows: the RL step and its overhead
(everything but train and generate) against both anchors, each phase against slime, and the trainer's GPU memory
while the rollout generates (NVML, above its CUDA context) against both.
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
    from ...testing import spawn  # noqa: PLC0415

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
            res[v] = spawn.call("bench", v, size=size, steps=steps, warmup=warmup, timeout=1800, teardown=False,
                                module="ebbtide.bench.suites._megatron_worker")
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

    yield from _colocated(ctx)


LOOP_ANCHORS = {"slime": "slime's configuration: HDO (offload 1.0, overlap) + torch_memory_saver + groups destroyed "
                         "and re-created lazily (NCCL_CUMEM_ENABLE=0) + slime-style FP8 update by IPC",
                "slime-ebbtide": "slime's configuration with ebbtide.compat.torch_memory_saver swapped in for "
                                 "torch_memory_saver (ebbtide as a plain drop-in)",
                "gpu-tms": "Megatron GPU DistributedOptimizer + torch_memory_saver (CPU backup), same groups and sync"}
LOOP_PHASES = (("optimizer", "optimizer step"), ("sync", "weight sync (trainer -> rollout holds it)"),
               ("offload", "trainer offload"), ("onload", "trainer onload"),
               (("comm_release", "comm_reload"), "process groups release + reload"),
               ("rollout_resume", "rollout resume"), ("rollout_pause", "rollout pause"),
               ("train", "train phase (fwd+bwd; same work)"), ("generate", "generate (same work)"))


def _colocated(ctx):
    from ._loop import run_colocated  # noqa: PLC0415

    over = {} if ctx.quick else {"steps": 6, "warmup": 2}
    res, out = run_colocated(ctx, "megatron", timeout_s=400 if ctx.quick else 900, **over)
    if not res["variants"].get("ebbtide", {}).get("summary"):
        ctx.note_skip("megatron colocated loop", f"the ebbtide loop failed: "
                      f"{res['variants'].get('ebbtide', {}).get('why', 'no result')} (logs in {out})")
        return
    yield from colocated_rows(res, out)


def _held_above_context(vr: dict):
    from ..colocate.measure import held_above_context  # noqa: PLC0415

    held = held_above_context(vr)
    return None if held is None else held / GB


def colocated_rows(res: dict, out: str = ""):
    """The colocated loop's rows from ``run_loop(trainer="megatron")`` results."""
    v = res["variants"]
    ours = v["ebbtide"]
    s = ours["summary"]
    setup = ours["ranks"][0].get("setup", {})
    ck = ours.get("checks", {})
    cfg = res.get("config", {})
    params = {"params": setup.get("params"), "steps": cfg.get("steps"), "warmup": cfg.get("warmup"),
              "model": cfg.get("model"), "device": setup.get("device_name"), "out": out}
    label = f"Megatron GPT {setup.get('params', 0) / 1e9:.2f} B, 1 GPU"
    note = f"correct={ck.get('correct')} no_growth={ck.get('no_growth')}"

    def phase(summary, key):
        if not summary:
            return None
        keys = key if isinstance(key, tuple) else (key,)
        vals = [summary["phase_s"].get(k) for k in keys]
        return None if any(x is None for x in vals) else sum(vals)

    def overhead(summary):
        return sum(t for k, t in summary["phase_s"].items() if k not in ("train", "generate")) if summary else None

    def row(name, mine, anchor, value, unit="s", rnote=""):
        a = v.get(anchor, {})
        return Row(SUITE, f"colocated loop: {name} (vs {anchor}), {label}", unit, mine, higher_is_better=False,
                   anchor=value, anchor_name=LOOP_ANCHORS[anchor] if value is not None else "",
                   anchor_note="" if value is not None else (a.get("why") or "not measured"), params=params,
                   note=rnote or note)

    for anchor in LOOP_ANCHORS:
        a = v.get(anchor, {}).get("summary")
        yield row("RL step", s["step_s"], anchor, a and a["step_s"])
        yield row("step overhead (all but train and generate)", overhead(s), anchor, overhead(a))
    a = v.get("slime", {}).get("summary")
    for key, name in LOOP_PHASES:
        yield row(name, phase(s, key), "slime", phase(a, key))
    for anchor in LOOP_ANCHORS:
        yield row("trainer GPU memory while the rollout generates, above its CUDA context", _held_above_context(ours),
                  anchor, _held_above_context(v.get(anchor, {})) if v.get(anchor, {}).get("summary") else None,
                  unit="GB", rnote="goal <= 1 GB (NVML per process)")
