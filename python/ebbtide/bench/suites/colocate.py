"""Suite `colocate`: a short colocated RL loop (the harness ``ebbtide.bench.colocate``, ``ebbtide colocate``) beside the
same loop on today's tools (torch_memory_saver retain_cpu_backup, destroy + re-create process groups, torch fused AdamW
on CPU with plain copies, the torch quant formula), each variant in fresh processes of the same run.

Rows (1 GPU; with 2+ GPUs also the 2-GPU data-parallel loop): seconds per RL step (the headline), the weight
sync (pack + load), the trainer's pause + resume, the rollout's resume and pause, and the trainer's GPU memory during generation (NVML, above
its CUDA context). --quick: the 0.12 B-param model, 5 steps; otherwise the loop's default 0.39 B model, 10 steps.
"""
from __future__ import annotations

import os
import tempfile

from ... import settings
from ..registry import Row, Skip, suite


def _rows(res: dict, gpus: int, params: dict):
    v = res["variants"]
    ours = v.get("ebbtide", {})
    anchor = v.get("anchor", {})
    a_sum = anchor.get("summary")
    a_note = "" if a_sum else (anchor.get("why") or "n/a")
    a_name = "torch_memory_saver + destroy/re-create + fused AdamW on CPU + torch quant"
    ck = ours.get("checks", {})
    note = f"correct={ck.get('correct')} no_growth={ck.get('no_growth')}; results in {params['out']}"
    s = ours["summary"]
    label = f"{gpus} GPU{'s' if gpus > 1 else ''}"

    def row(name, ours_val, anchor_val, unit="s", rnote=""):
        return Row("colocate", f"{name}, {label}", unit, ours_val, higher_is_better=False, anchor=anchor_val,
                   anchor_name=a_name if anchor_val is not None else "",
                   anchor_note="" if anchor_val is not None else a_note, params=params, note=rnote or note)

    def phase_sum(summary, *names):
        if not summary:
            return None
        vals = [summary["phase_s"].get(n) for n in names]
        return sum(x for x in vals if x is not None) if any(x is not None for x in vals) else None

    yield row("RL step (train, sync, switch, generate, switch back)", s["step_s"], a_sum and a_sum["step_s"])
    yield row("weight sync: FP8 pack + load", phase_sum(s, "sync_pack", "sync_load"),
              phase_sum(a_sum, "sync_pack", "sync_load"))
    yield row("trainer pause + resume", phase_sum(s, "trainer_pause", "trainer_resume"),
              phase_sum(a_sum, "trainer_pause", "trainer_resume"))
    # the rollout's KV cache, decode graph and scratch: discarded at pause, mapped back at resume (many allocations)
    for ph, label_ in (("rollout_resume", "rollout resume"), ("rollout_pause", "rollout pause")):
        yield row(f"{label_} (KV cache, graph, scratch; discard)", phase_sum(s, ph), phase_sum(a_sum, ph),
                  rnote=f"{note}; the anchor keeps its decode graph's pool resident (torch_memory_saver's torch "
                        f"hook mode cannot pause it)")
    if gpus > 1:
        yield row("process groups release + reload", phase_sum(s, "comm_release", "comm_reload"),
                  phase_sum(a_sum, "comm_release", "comm_reload"))

    def held(vr):
        m = (vr.get("summary") or {}).get("memory", {}).get("generate", {}).get("trainer_nvml")
        c = ((vr.get("ranks") or [{}])[0].get("setup") or {}).get("context_bytes")
        return None if m is None or c is None else (m - c) / 1e9

    mine = held(ours)
    yield row("trainer GPU memory during generation, above its CUDA context", mine, held(anchor) if a_sum else None,
              unit="GB", rnote="goal <= 1 GB (NVML per process)" if mine is not None
              else "no NVML per-process reading (see setup.nvml in results.json)")


@suite("colocate", needs="gpu", description="end-to-end colocated RL step vs the same loop on today's tools")
def run(ctx):
    ctx.require_gpu()
    import torch  # noqa: PLC0415

    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # earlier in-process suites' cached blocks would crowd the two processes
    from ..colocate.launcher import run_loop  # noqa: PLC0415

    from ...testing.spawn import TEST_ARTIFACTS  # noqa: PLC0415

    runs = [1] + ([2] if ctx.gpus >= 2 else [])
    for gpus in runs:
        art = settings.get(TEST_ARTIFACTS)  # scripts/gpu-check packs this folder into logs.tgz
        if art:
            out = os.path.join(art, f"colocate-bench-{gpus}gpu")
            os.makedirs(out, exist_ok=True)
        else:
            out = tempfile.mkdtemp(prefix=f"ebbtide-colocate-{gpus}gpu-")
        ctx.progress(f"colocate: {gpus} GPU(s), {'quick' if ctx.quick else 'default'} size (out: {out})")
        res = run_loop(gpus=gpus, out=out, quick=ctx.quick, timeout_s=300 if ctx.quick else 1200, log=ctx.progress)
        cfg = res["config"]
        ours = res["variants"].get("ebbtide", {})
        if not ours.get("summary"):
            why = f"the ebbtide loop failed on {gpus} GPU(s): {ours.get('why', 'no result')} (logs in {out})"
            if gpus == 1:
                raise Skip(why)
            ctx.note_skip(f"colocate {gpus} GPUs", why)
            continue
        params = {"gpus": gpus, "steps": cfg["steps"], "warmup": cfg["warmup"], "model": cfg["model"], "out": out}
        yield from _rows(res, gpus, params)
