"""Suite `sync`: one weight update, from "optimizer done" to "the receiver holds the new version", in GB/s of bf16
weights published, on one GPU with the receiver in a second process.

Models (bf16 source on the GPU, synthetic values): shaped like Qwen3-8B (36 layers, hidden 4096, FFN 12288,
vocabulary 151,936) and a 4-layer slice of Qwen3-30B-A3B (128 experts of 768 x 2048 per layer, each its own
tensor, as the HF checkpoint names them); quick runs use small versions. Every linear is sent as FP8 128x128 block
(fp32 scales); embeddings, norms and routers raw bf16; 512 MiB buckets. The receiver holds the served form (FP8
weights and scales) in its own parameters.

Paths, each timed in the same run:
- ebbtide CUDA IPC: ``Sender`` + ``IpcSender`` -> ``IpcReceiver`` (one FP8 launch per bucket, written straight
  into the receiver's staging shared by CUDA IPC; one round trip per update; the receiver applies once).
- slime-style (the anchor), as slime runs colocated: per tensor one FP8 launch (ebbtide's block kernel, the fastest
  per-tensor launch available here), a ``torch.cat`` flattening copy per bucket, the bucket's CUDA IPC handle
  pickled and sent as one flattened-bucket request, a wait for the reply, ``ipc_collect`` and ``empty_cache``
  after every bucket, a new producer buffer each time; the receiver rebuilds views and copies into its params.
- ebbtide host buffer: ``HostSender`` -> ``HostReceiver`` through a pinned shared buffer.
- Into SGLang's loaders (where SGLang is installed; ``_sglang_loader_worker``): the same buckets applied inside
  the engine, from the tensors SGLang's weight updater rebuilt to the parameters holding them, into SGLang's own
  layers (FP8 served form): ebbtide's loader (``--custom-weight-loader``) against SGLang's ``load_weights`` for
  slime's flattened-bucket request; limit: the HBM copy of the bucket bytes. These rows count GB/s of the bytes
  applied (the buckets: FP8 weights, scales, raw tensors), not of bf16 published as the rows above do.

Limits from the same run: the IPC paths against the HBM time of the bytes that must move (read bf16, write FP8 +
scales, the receiver's read and write of them) at the measured device-copy bandwidth; the host path against the
pinned D2H + H2D time of the quantized bytes.
"""
from __future__ import annotations

import importlib.util
import os
import statistics
import time

from ...anchors.sync import slime_update
from ..registry import Row, suite
from ._process import run_json_worker

GB = 1e9
BUCKET = 512 << 20
WARMUP = 3  # untimed updates before the timed ones, every path


def specs(model: str, quick: bool) -> list:
    """(name, shape) of every bf16 tensor of a synthetic model (HF names)."""
    out = []
    if model == "dense":  # Qwen3-8B
        L, H, F, V, KV = (2, 1024, 3072, 8192, 256) if quick else (36, 4096, 12288, 151936, 1024)
        out.append(("model.embed_tokens.weight", (V, H)))
        for i in range(L):
            p = f"model.layers.{i}."
            out += [(p + "input_layernorm.weight", (H,)), (p + "self_attn.q_proj.weight", (H, H)),
                    (p + "self_attn.k_proj.weight", (KV, H)), (p + "self_attn.v_proj.weight", (KV, H)),
                    (p + "self_attn.o_proj.weight", (H, H)), (p + "post_attention_layernorm.weight", (H,)),
                    (p + "mlp.gate_proj.weight", (F, H)), (p + "mlp.up_proj.weight", (F, H)),
                    (p + "mlp.down_proj.weight", (H, F))]
        out += [("model.norm.weight", (H,)), ("lm_head.weight", (V, H))]
    else:  # a slice of Qwen3-30B-A3B
        L, H, E, F, Q, KV = (1, 1024, 16, 384, 2048, 256) if quick else (4, 2048, 128, 768, 4096, 512)
        for i in range(L):
            p = f"model.layers.{i}."
            out += [(p + "input_layernorm.weight", (H,)), (p + "self_attn.q_proj.weight", (Q, H)),
                    (p + "self_attn.k_proj.weight", (KV, H)), (p + "self_attn.v_proj.weight", (KV, H)),
                    (p + "self_attn.o_proj.weight", (H, Q)), (p + "post_attention_layernorm.weight", (H,)),
                    (p + "mlp.gate.weight", (E, H))]
            for e in range(E):
                q = f"{p}mlp.experts.{e}."
                out += [(q + "gate_proj.weight", (F, H)), (q + "up_proj.weight", (F, H)), (q + "down_proj.weight", (H, F))]
    return out


def make_plan(model: str, quick: bool):
    import torch

    from ...sync import Plan

    return Plan.build([(n, s, torch.bfloat16) for n, s in specs(model, quick)], bucket_bytes=BUCKET)


def _served_params(plan, device):
    import torch

    return {o.name: torch.empty(o.shape, dtype=getattr(torch, o.dtype), device=device)
            for it in plan.items for o in it.outputs}


# ---- the receiver process ------------------------------------------------------------------------------------
def consumer(conn, model: str, quick: bool, buf_path: str, buf_bytes: int) -> None:
    """Serves ("ipc", versions) / ("slime", updates) / ("host", versions) / ("exit",) on ``conn``. ``buf_path``
    names the trainer's host buffer (its memfd under /proc)."""
    import os

    import torch
    import torch.multiprocessing  # noqa: F401 (CUDA IPC reductions)

    from ...sync import HostReceiver, IpcReceiver, Receiver, SharedHostBuffer
    from ...sync.sglang import _dtype

    torch.cuda.set_device(0)
    plan = make_plan(model, quick)
    params = _served_params(plan, "cuda")
    receiver = Receiver(params, plan, form="served")
    host = SharedHostBuffer(os.open(buf_path, os.O_RDWR), buf_bytes, pin=True)
    ipc = IpcReceiver(conn)
    conn.send(("ready",))
    while True:
        cmd = conn.recv()
        if cmd[0] == "exit":
            conn.send(("bye",))
            return
        if cmd[0] == "ipc":
            for _ in range(cmd[1]):
                ipc.receive(receiver)
        elif cmd[0] == "host":
            for _ in range(cmd[1]):
                conn.recv()  # the sender says the buffer holds a new version
                HostReceiver(host).receive(receiver)
                conn.send(("loaded",))
        elif cmd[0] == "slime":
            for _ in range(cmd[1]):
                while True:
                    msg = conn.recv()  # (flattened uint8 CUDA tensor by IPC, [(name, dtype, shape, start, end)])
                    if msg[0] == "done":
                        torch.cuda.synchronize()
                        conn.send(("done",))
                        break
                    flat, meta = msg[1], msg[2]
                    for name, dt, shape, a, b in meta:  # rebuild views, load_weights ~ param.copy_
                        params[name].copy_(flat[a:b].view(_dtype(dt)).view(shape))
                    del flat, msg
                    conn.send(("ok",))  # SGLang answers after enqueuing its copies


# ---- the trainer side ----------------------------------------------------------------------------------------
def _source(plan, device):
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    return {it.source: (torch.randn(it.shape, generator=g, device=device, dtype=torch.float32) * 0.02)
            .to(torch.bfloat16) for it in plan.items}


def _timed(fn, reps: int) -> float:
    """Median seconds of ``reps`` calls after WARMUP untimed ones (the first IPC open, the allocator, the kept
    launch tables, the GPU's clocks after the process start: an RL run updates hundreds of times)."""
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _measure(model: str, quick: bool, ctx):
    import multiprocessing as mp
    import os

    import torch
    import torch.multiprocessing  # noqa: F401 (CUDA tensors travel as IPC handles through the pipe)

    from ...sync import HostSender, IpcSender, Sender, SharedHostBuffer

    plan = make_plan(model, quick)
    reps = 3 if quick else 8
    host = SharedHostBuffer.create(SharedHostBuffer.size_for(plan), pin=True)
    mpc = mp.get_context("spawn")
    a, b = mpc.Pipe()
    # a spawned child does not inherit the memfd: it opens it by its /proc path (same host, same user)
    proc = mpc.Process(target=consumer, args=(b, model, quick, f"/proc/{os.getpid()}/fd/{host.fd}", host.nbytes))
    proc.start()
    b.close()  # the consumer's end lives in the consumer: if it dies, the connection closes at once
    out = {}
    try:
        try:
            ready = a.poll(600) and a.recv()[0] == "ready"
        except EOFError:
            ready = False
        if not ready:
            raise RuntimeError(f"the consumer process did not start (exit code {proc.exitcode})")
        src = _source(plan, "cuda")
        torch.cuda.synchronize()
        version = [0]

        ipc = Sender(src, IpcSender(a), plan=plan)
        a.send(("ipc", reps + WARMUP))

        def ebb_ipc():
            version[0] += 1
            ipc.push(version[0])

        ctx.progress(f"sync {model}: ebbtide IPC")
        out["ipc"] = _timed(ebb_ipc, reps)

        a.send(("slime", reps + WARMUP))
        ctx.progress(f"sync {model}: slime-style")
        out["slime"] = _timed(lambda: slime_update(plan, src, a), reps)

        hs = Sender(src, HostSender(host), plan=plan)
        a.send(("host", reps + WARMUP))

        def ebb_host():
            version[0] += 1
            hs.push(version[0])
            a.send(("go",))
            a.recv()

        ctx.progress(f"sync {model}: ebbtide host buffer")
        out["host"] = _timed(ebb_host, reps)
        a.send(("exit",))
        a.recv()
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
        host.close()
    return plan, out


def _loader_rows(ctx, model: str, label: str, hbm: float):
    """The "into SGLang's loaders" row of ``model`` (nothing where SGLang is not installed: said as progress)."""
    if importlib.util.find_spec("sglang") is None:
        ctx.progress(f"sync {model}: SGLang not installed, no 'into SGLang's loaders' row")
        return
    ctx.progress(f"sync {model}: into SGLang's loaders (ebbtide's loader vs SGLang's load_weights)")
    r, why = run_json_worker("ebbtide.bench.suites._sglang_loader_worker",
                             [model, "1" if ctx.quick else "0", "3" if ctx.quick else "8", "cuda:0"],
                             dict(os.environ), timeout=900)
    if r is None:
        ctx.progress(f"sync {model}: into SGLang's loaders failed: {why}")
        yield Row("sync", f"{label}: into SGLang's loaders", "GB/s", None, anchor_note="worker failed",
                  note=why[-300:])
        return
    wire = r["wire_bytes"]
    yield Row("sync", f"{label}: into SGLang's loaders", "GB/s", wire / r["ebbtide_s"] / GB,
              anchor=wire / r["sglang_s"] / GB, anchor_name="SGLang load_weights (slime's flattened bucket)",
              limit=hbm / 2, limit_name="HBM copy of the bucket bytes",
              params={"ms": r["ebbtide_s"] * 1e3, "anchor_ms": r["sglang_s"] * 1e3,
                      "record_ms": r["ebbtide_record_s"] * 1e3, "wire_GB": round(wire / GB, 3),
                      "buckets": r["buckets"], "tensors": r["tensors"], "segments": r["segments"],
                      "bitwise_equal": r["bitwise_equal"], "fallback": r["fallback"], "stood_in": r["stood_in"]},
              note="" if r["bitwise_equal"] else "parameters differ from SGLang's placement")


@suite("sync", needs="gpu", description="weight update to a second process on one GPU: ebbtide IPC / host vs "
                                        "a slime-style path, GB/s of bf16 published")
def run(ctx):
    ctx.require_gpu()
    hbm = ctx.limits.d2d_gbps()
    h2d, d2h = ctx.limits.h2d_gbps(), ctx.limits.d2h_gbps()
    for model, label in (("dense", "Qwen3-8B-shaped"), ("moe", "Qwen3-30B-A3B 4-layer slice")):
        plan, t = _measure(model, ctx.quick, ctx)
        src, wire = plan.source_bytes, plan.nbytes
        params = {"source_GB": round(src / GB, 3), "wire_GB": round(wire / GB, 3), "buckets": len(plan.buckets),
                  "tensors": len(plan.items)}
        hbm_s = (src + 3 * wire) / (hbm * GB)  # read bf16, write the bucket, the receiver reads and writes it
        pcie_s = wire / (d2h * GB) + wire / (h2d * GB)
        yield Row("sync", f"{label}: CUDA IPC", "GB/s", src / t["ipc"] / GB, anchor=src / t["slime"] / GB,
                  anchor_name="slime-style (per-tensor FP8, cat, request per bucket)", limit=src / hbm_s / GB,
                  limit_name="HBM: bf16 read + FP8 write + receiver copy", params={**params, "ms": t["ipc"] * 1e3,
                                                                                   "anchor_ms": t["slime"] * 1e3})
        yield from _loader_rows(ctx, model, label, hbm)
        yield Row("sync", f"{label}: pinned host buffer", "GB/s", src / t["host"] / GB, anchor_note="n/a",
                  limit=src / pcie_s / GB, limit_name="pinned D2H + H2D of the FP8 bytes",
                  params={**params, "ms": t["host"] * 1e3})
