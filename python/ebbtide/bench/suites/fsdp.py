"""Suite `fsdp`: the FSDP2 colocated loop (``ebbtide colocate --trainer fsdp``, ``ebbtide.bench.colocate``): a
transformers Qwen3 (Qwen3-1.7B's shape, 1.72 B parameters, random weights from a config; --quick 0.13 B) under
``fully_shard`` on one GPU, a rollout process on the same GPU taking its weights every step; each variant in fresh
processes of the same run: ebbtide's adapter with its CPU optimizer, verl's paths (``ebbtide.anchors.verl``),
AReaL's torch_memory_saver preload with CPU backup (``ebbtide.anchors.areal``), FSDP2's CPUOffloadPolicy with
torch's AdamW on the CPU (``bench.colocate.fvariants`` says what each runs).

Rows (medians of the measured steps; the same model, data and rollout in every variant; limits measured by the
trainer on its own device in the same run, ``setup["limits"]``): offload and onload of the training state against
verl's and AReaL's (onload: the pinned host-to-device copy of the bytes ebbtide uploads; ebbtide's offload copies
nothing, the host already holds what restores the shards); the trainer's GPU memory while the rollout generates,
above its CUDA context (NVML); the weight sync (GB/s of bf16 until the rollout holds the version) against verl's
per-tensor path and the HBM limit; the optimizer step against torch's CPU AdamW under CPUOffloadPolicy and the
host-memory floor; the train and generate phases (same work: ~1x); the RL step and everything but train and generate
against every anchor.
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


@suite(SUITE, needs="gpu", description="FSDP2 Qwen3 colocated loop on one GPU: ebbtide's adapter vs verl / AReaL / "
                                       "CPUOffloadPolicy")
def run(ctx):
    ctx.require_gpu()
    if importlib.util.find_spec("transformers") is None:
        raise Skip("transformers is not installed")
    from ._loop import run_colocated  # noqa: PLC0415

    over = {} if ctx.quick else {"steps": 4, "warmup": 1}
    res, out = run_colocated(ctx, "fsdp", timeout_s=600 if ctx.quick else 1200, **over)
    for v, info in res["variants"].items():
        if not info.get("summary"):
            ctx.note_skip(f"fsdp variant {v}", str(info.get("why", "no result"))[-400:])
    if not res["variants"].get("ebbtide", {}).get("summary"):
        raise Skip(f"the ebbtide variant did not run (logs in {out})")
    yield from rows(res, out)


def rows(res: dict, out: str = ""):
    """The suite's rows from ``run_loop(trainer="fsdp")`` results."""
    from ..colocate.measure import held_above_context  # noqa: PLC0415

    v = res["variants"]
    ours = v["ebbtide"]
    setup = ours["ranks"][0]["setup"]
    lim = setup.get("limits", {})
    n = setup["params"]
    label = f"Qwen3 {n / 1e9:.2f} B, 1 GPU"
    ck = ours.get("checks", {})
    params = {"params": n, "device": setup.get("device_name"), "variants": sorted(k for k in v if v[k].get("summary")),
              "steps": res.get("config", {}).get("steps"), "out": out}
    note = f"correct={ck.get('correct')} no_growth={ck.get('no_growth')}"

    def summary(name):
        return v.get(name, {}).get("summary")

    def ph(name, *keys):
        s = summary(name)
        vals = [s["phase_s"].get(k) for k in keys] if s else [None]
        return None if any(x is None for x in vals) else sum(vals)

    def overhead(name):
        s = summary(name)
        return sum(t for k, t in s["phase_s"].items() if k not in ("train", "generate")) if s else None

    def row(name, mine, anchor, value, unit="s", higher=False, rnote="", **kw):
        why = v.get(anchor, {}).get("why") or "not measured"
        return Row(SUITE, f"{name} (vs {anchor}), {label}", unit, mine, higher_is_better=higher, anchor=value,
                   anchor_name=ANCHORS[anchor] if value is not None else "",
                   anchor_note="" if value is not None else f"{anchor}: {why}", params=params,
                   note=f"{rnote}; {note}" if rnote else note, **kw)

    up = ours["summary"]["bytes"].get("onload", 0)
    h2d = lim.get("h2d_gbps")
    for anchor in ("verl", "tms"):
        yield row("offload of the training state", ph("ebbtide", "offload"), anchor, ph(anchor, "offload"),
                  rnote="nothing to copy: the shards are dropped, the host holds what restores them")
        yield row("onload of the training state", ph("ebbtide", "onload"), anchor, ph(anchor, "onload"),
                  limit=up / (h2d * GB) if up and h2d else None,
                  limit_name="pinned H2D of the bytes uploaded" if up and h2d else "", rnote="goal <= 1.2x the limit")
    held = {k: held_above_context(info) for k, info in v.items() if info.get("summary")}
    for anchor in ANCHORS:
        a = held.get(anchor)
        yield row("trainer GPU memory while the rollout generates, above its CUDA context",
                  None if held.get("ebbtide") is None else held["ebbtide"] / GB, anchor,
                  None if a is None else a / GB, unit="GB", rnote="goal <= 0.5 GB (NVML per process)")
    src, wire = setup["sync_bf16_bytes"], setup["sync_bytes"]
    sync_s, verl_sync = ph("ebbtide", "sync"), ph("verl", "sync")
    d2d = lim.get("d2d_gbps")
    yield row("weight sync (bf16, until the rollout holds it)", src / sync_s / GB if sync_s else None, "verl",
              src / verl_sync / GB if verl_sync else None, unit="GB/s", higher=True,
              limit=src / ((src + 3 * wire) / (d2d * GB)) / GB if d2d else None,
              limit_name="HBM: bf16 read + bucket write + the rollout's copy" if d2d else "",
              rnote="goals >= 60% of the limit, >= 4x verl's per-tensor path")
    yield row("optimizer step (ebbtide's CPU Adam)", ph("ebbtide", "optimizer"), "cpu-offload",
              ph("cpu-offload", "optimizer"), limit=setup.get("optimizer_floor_s"),
              limit_name="host memory: the step's bytes at the triad bandwidth" if setup.get("optimizer_floor_s")
              else "")
    yield row("train phase (fwd+bwd; same work)", ph("ebbtide", "train"), "verl", ph("verl", "train"),
              rnote="bf16 shards vs verl's fp32 shards cast per all-gather: ~1x expected")
    yield row("generate (same rollout)", ph("ebbtide", "generate"), "verl", ph("verl", "generate"),
              rnote="goal within 1%")
    for anchor in ANCHORS:
        a = summary(anchor)
        yield row("RL step", ours["summary"]["step_s"], anchor, a and a["step_s"], rnote="goal >= 2x verl")
        yield row("step overhead (all but train and generate)", overhead("ebbtide"), anchor, overhead(anchor),
                  rnote="goal >= 5x smaller than verl's")
