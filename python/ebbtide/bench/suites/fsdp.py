"""Suite `fsdp`: a transformers Qwen3 (Qwen3-1.7B's shape, 1.72 B parameters, random weights from a config; --quick
~0.2 B) under ``fully_shard`` on one GPU, a rollout process on the same GPU taking its weights every step; each
variant in a fresh process of the same run (``_fsdp_worker``: ebbtide's adapter with its CPU optimizer, ebbtide's
adapter over verl's model and GPU AdamW, verl's own functions, AReaL's torch_memory_saver preload, FSDP2's
CPUOffloadPolicy).

Rows (medians of the measured steps; the same model, data and rollout in every variant): offload and onload of the
training state against verl's and AReaL's, each with the pinned-copy limit of the bytes that variant moves; the
trainer's GPU memory while offloaded (the rollout's time), above its CUDA context; the weight sync (GB/s of bf16
published, until the rollout holds the version) against verl's per-tensor path and the HBM limit; the optimizer step
against torch's CPU AdamW under CPUOffloadPolicy and the host-memory floor; the train phase (same work: ~1x); the
whole step (train + optimizer + sync + offload + onload) against verl and CPUOffloadPolicy.
"""
from __future__ import annotations

import importlib.util

from ..registry import Row, Skip, suite

SUITE = "fsdp"
GB = 1e9
ANCHORS = {"verl": "verl (volcengine/verl b178a3cd): model.cpu()/to(), optimizer state .to() per tensor, "
                   "full_tensor() per tensor into a 2 GiB CUDA IPC buffer",
           "tms": "AReaL (inclusionAI/AReaL 4aef98d8): torch_memory_saver preload hook, CPU backup of every "
                  "allocation, pause()/resume(); verl's model, optimizer and weight update",
           "cpu-offload": "FSDP2 CPUOffloadPolicy(pin_memory=True) + torch AdamW on the CPU, verl's weight update"}


@suite(SUITE, needs="gpu", description="FSDP2 Qwen3 on one GPU: ebbtide's adapter vs verl / AReaL / CPUOffloadPolicy")
def run(ctx):
    ctx.require_gpu()
    for pkg in ("transformers",):
        if importlib.util.find_spec(pkg) is None:
            raise Skip(f"{pkg} is not installed")
    from . import _fsdp_worker as w  # noqa: PLC0415

    size = "quick" if ctx.quick else "default"
    steps, warmup = (2, 1) if ctx.quick else (3, 1)
    base = {"size": size, "steps": steps, "warmup": warmup, "batch": 4 if ctx.quick else 2,
            "seq": 512 if ctx.quick else 2048}
    res = {}
    for v in w.VARIANTS:
        env = None
        if v == "tms":
            if importlib.util.find_spec("torch_memory_saver") is None:
                ctx.note_skip("fsdp variant tms", "torch_memory_saver is not installed (scripts/fetch-anchor-wheels)")
                continue
            from ...anchors import areal  # noqa: PLC0415

            env = areal.tms_env()
        ctx.progress(f"fsdp: {v}, model {size}, {warmup}+{steps} steps")
        try:
            res[v] = w.run({**base, "variant": v}, timeout=900 if ctx.quick else 1800, env=env)
        except Exception as e:  # noqa: BLE001 (a variant that fails loses its rows, not the suite)
            ctx.note_skip(f"fsdp variant {v}", str(e)[-400:])
    if not res:
        raise Skip("no variant ran (see the notes)")
    yield from rows(res, ctx.limits)


def rows(res: dict, limits):
    """The suite's rows from the workers' results (``limits``: the run's ``ebbtide.bench.limits`` probes)."""
    any_r = next(iter(res.values()))
    n = any_r["params"]
    label = f"Qwen3 {n / 1e9:.2f} B, 1 GPU"
    params = {"params": n, "device": any_r["device"], "variants": sorted(res)}

    def ph(v, k):
        r = res.get(v)
        return r["phases"][k]["median_s"] if r else None

    def step(v):
        r = res.get(v)
        return sum(p["median_s"] for p in r["phases"].values()) if r else None

    def row(name, ours_v, anchor, anchor_v, unit="s", **kw):
        return Row(SUITE, f"{name}, {label}", unit, ours_v, higher_is_better=kw.pop("higher", False),
                   anchor=anchor_v, anchor_name=ANCHORS[anchor] if anchor_v is not None else "",
                   anchor_note="" if anchor_v is not None else f"{anchor}: not measured (see notes)",
                   params=params, **kw)

    d2h, h2d = limits.d2h_gbps(), limits.h2d_gbps()
    for v, what in (("ebbtide", "CPU optimizer: shards dropped, rebuilt from its bf16 host mirror"),
                    ("ebbtide-gpu-adam", "verl's fp32 shards and GPU AdamW: 12 B/param, as verl moves")):
        if v not in res:
            continue
        moved = res[v]["bytes_moved_each_way"]
        off_limit = moved / (d2h * GB) if moved and v != "ebbtide" else None
        for anchor in ("verl", "tms"):
            yield row(f"offload ({v}: {what}; vs {anchor})", ph(v, "offload"), anchor, ph(anchor, "offload"),
                      limit=off_limit, limit_name="pinned D2H of the bytes moved" if off_limit else "",
                      note="goal <= 1.2x the limit" if off_limit else "nothing to copy: the host holds the shards")
            yield row(f"onload ({v}; vs {anchor})", ph(v, "onload"), anchor, ph(anchor, "onload"),
                      limit=moved / (h2d * GB), limit_name="pinned H2D of the bytes moved",
                      note="goal <= 1.2x the limit")
    for v in ("ebbtide", "ebbtide-gpu-adam"):
        for anchor in ("verl", "tms") if v in res else ():
            yield row(f"trainer GPU memory while offloaded, above its CUDA context ({v}; vs {anchor})",
                      res[v]["held_while_offloaded"] / GB, anchor,
                      res[anchor]["held_while_offloaded"] / GB if anchor in res else None, unit="GB",
                      note=f"goal <= 0.5 GB; torch reserved outside the tags "
                           f"{res[v]['reserved_outside'] / GB:.3f} GB")
    if "ebbtide" in res:
        r = res["ebbtide"]
        src, wire = r["source_bytes"], r["wire_bytes"]
        hbm_s = (src + 3 * wire) / (limits.d2d_gbps() * GB)
        yield row("weight sync (bf16, rollout holds it)", src / ph("ebbtide", "sync") / GB, "verl",
                  src / ph("verl", "sync") / GB if "verl" in res else None, unit="GB/s", higher=True,
                  limit=src / hbm_s / GB, limit_name="HBM: bf16 read + bucket write + the rollout's copy",
                  note="goals >= 60% of the limit, >= 4x verl's per-tensor path")
        cpu_floor = 28.0 * n / (limits.host_triad_gbps() * GB)
        yield row("optimizer step (ebbtide's CPU Adam)", ph("ebbtide", "optimizer"), "cpu-offload",
                  ph("cpu-offload", "optimizer"), limit=cpu_floor,
                  limit_name="host memory: 28 B/param at the triad bandwidth")
        yield row("train phase (fwd+bwd; same work)", ph("ebbtide", "train"), "verl", ph("verl", "train"),
                  note="bf16 shards vs verl's fp32 shards cast per all-gather: ~1x expected")
        for anchor in ANCHORS:
            yield row(f"step: train + optimizer + sync + offload + onload (vs {anchor})", step("ebbtide"), anchor,
                      step(anchor), note="goal >= 2x verl")
