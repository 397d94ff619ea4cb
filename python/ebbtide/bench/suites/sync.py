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
- ebbtide SGLang tensor request: ``Sender`` + ``integrations.sglang.SGLangTensorSender`` (flattened-bucket form, one
  ``update_weights_from_tensor`` request per bucket inside ``begin_weight_update`` / ``end_weight_update``; bucket
  k is posted once k+1 is queued) -> the same receiver process answering as SGLang's handlers do (``serve_sglang``:
  the bucket rebuilt by torch's unpickler, views copied into its params, the rebuilt tensors dropped before the
  reply). Beside its speed, the trainer's peak extra GPU memory during one update
  (``torch.cuda.max_memory_allocated`` over what was allocated before it; a block shared by CUDA IPC stays counted
  until the receiver released it and ``ipc_collect`` ran), against the slime-style path's, with two buckets as
  the limit (the one posted, the one queued behind it). Goals: at most two buckets, at least 1.5x the slime-style
  path's speed.
- ebbtide host buffer: ``HostSender`` -> ``HostReceiver`` through a pinned shared buffer.
- Into SGLang's loaders (where SGLang is installed; ``_sglang_loader_worker``): the same buckets applied inside
  the engine, from the tensors SGLang's weight updater rebuilt to the parameters holding them, into SGLang's own
  layers (FP8 served form): ebbtide's loader (``--custom-weight-loader``) against SGLang's ``load_weights`` for
  slime's flattened-bucket request; limit: the HBM copy of the bucket bytes. These rows count GB/s of the bytes
  applied (the buckets: FP8 weights, scales, raw tensors), not of bf16 published as the rows above do.

Limits from the same run: the IPC paths (CUDA IPC, SGLang tensor request) against the HBM time of the bytes that
must move (read bf16, write FP8 + scales, the receiver's read and write of them) at the measured device-copy
bandwidth; the host path against the pinned D2H + H2D time of the quantized bytes. The SGLang sender's memory row
against two buckets (a ceiling, not a floor).
"""
from __future__ import annotations

import importlib.util
import statistics
import time

from ...anchors.sync import slime_update
from ...testing import spawn
from ..registry import Row, suite

GB = 1e9
GiB = 1 << 30
BUCKET = 512 << 20
WARMUP = 3  # untimed updates before the timed ones, every path
SLIME = "slime-style (per-tensor FP8, cat, request per bucket)"
HBM_LIMIT = "HBM: bf16 read + FP8 write + receiver copy"


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
                out += [(q + "gate_proj.weight", (F, H)), (q + "up_proj.weight", (F, H)),
                        (q + "down_proj.weight", (H, F))]
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
SGLANG_OK = {"success": True, "message": ""}


def load_flattened_request(req: dict, params: dict) -> None:
    """``update_weights_from_tensor`` as SGLang handles a flattened-bucket request: the payload of TP rank 0
    rebuilt by torch's unpickler (a CUDA bucket opens as an IPC handle), each piece a view of the flat bucket
    copied into ``params`` (SGLang's ``load_weights`` of the rebuilt tensors ~ ``param.copy_``). The rebuilt
    tensors are locals, dropped on return, as SGLang's handler drops them before it answers: releasing the last
    one first waits for this process's stream (torch's consumer-side deleter), then lets the sender reuse the
    block."""
    import io
    import pickle

    import torch
    import torch.multiprocessing  # noqa: F401 (registers torch's CUDA IPC reductions)

    from ...errors import InvalidArgumentError

    if req.get("load_format") != "flattened_bucket":
        raise InvalidArgumentError(f"this receiver takes the flattened-bucket form, got load_format "
                                   f"{req.get('load_format')!r}")
    payload = pickle.load(io.BytesIO(req["serialized_named_tensors"][0]))
    flat = payload["flattened_tensor"]
    for m in payload["metadata"]:  # dtype: a torch.dtype as ``sglang.flattened_payload`` writes it, or its name
        dt = m.dtype if isinstance(m.dtype, torch.dtype) else getattr(torch, str(m.dtype).removeprefix("torch."))
        params[m.name].copy_(flat[m.start_idx:m.end_idx].view(dt).view(m.shape))
    del payload, flat


def serve_sglang(conn, params: dict, updates: int) -> None:
    """Answers SGLang's weight-update endpoints on ``conn`` as its HTTP handlers do, ``(endpoint, request)`` ->
    ``{"success", "message"}``, until ``updates`` updates ended (``end_weight_update``, answered once this
    process's copies completed). Every request gets exactly one reply, a failure as ``success: False`` (the
    sender raises on it), so the sender's strict post-then-wait cannot hang on a request this side refused."""
    import torch

    from ...errors import InvalidArgumentError

    ended = 0
    while ended < updates:
        endpoint, req = conn.recv()
        try:
            if endpoint == "update_weights_from_tensor":
                load_flattened_request(req, params)
            elif endpoint == "end_weight_update":
                if torch.cuda.is_initialized():
                    torch.cuda.synchronize()
                ended += 1
            elif endpoint != "begin_weight_update":
                raise InvalidArgumentError(f"unknown endpoint {endpoint!r}")
            reply = SGLANG_OK
        except Exception as e:  # noqa: BLE001 (answered as SGLang answers a failed request)
            reply = {"success": False, "message": f"{type(e).__name__}: {e}"}
        del req  # pickled bytes only: the rebuilt tensors died with load_flattened_request's frame (and ``e``)
        conn.send(reply)


def consumer(conn, model: str, quick: bool, buf_path: str, buf_bytes: int) -> None:
    """Serves ("ipc", versions) / ("slime", updates) / ("sglang", updates) / ("host", versions) / ("exit",) on
    ``conn``. ``buf_path`` names the trainer's host buffer (its memfd under /proc). Returns when the trainer's end
    closes (EOFError: the trainer gave up on a failure)."""
    import os

    import torch
    import torch.multiprocessing  # noqa: F401 (CUDA IPC reductions)

    from ...sync import HostReceiver, IpcReceiver, Receiver, SharedHostBuffer

    torch.cuda.set_device(0)
    plan = make_plan(model, quick)
    params = _served_params(plan, "cuda")
    receiver = Receiver(params, plan, form="served")
    host = SharedHostBuffer(os.open(buf_path, os.O_RDWR), buf_bytes, pin=True)
    ipc = IpcReceiver(conn)
    conn.send(("ready",))
    try:
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
            elif cmd[0] == "sglang":
                serve_sglang(conn, params, cmd[1])
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
                            params[name].copy_(flat[a:b].view(getattr(torch, dt)).view(shape))
                        del flat, msg
                        conn.send(("ok",))  # SGLang answers after enqueuing its copies
    except EOFError:
        return


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


def _timed_peak(fn, reps: int) -> tuple[float, int]:
    """``_timed``'s median seconds, and the largest peak of GPU memory this process allocated during one timed
    call above what it held right before it (bytes; ``torch.cuda.max_memory_allocated`` counts a block shared by
    CUDA IPC until the receiver released it and ``ipc_collect`` gave it back, so this is what the sending end
    keeps alive). The bookkeeping (a synchronize either side) stays outside the timed interval."""
    import torch

    for _ in range(WARMUP):
        fn()
    times, peaks = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
    return statistics.median(times), max(peaks)


def sglang_post(conn, timeout: float = 600.0):
    """``post(endpoint, request) -> reply`` for ``SGLangTensorSender`` over the receiver's connection: one
    message out, its one reply back (``serve_sglang`` answers every request), so neither side can wait on the
    other's turn; a receiver that died closes the connection (EOFError), one that hangs runs past ``timeout``."""
    from ...errors import WaitTimeoutError

    def post(endpoint: str, req: dict):
        conn.send((endpoint, req))
        if not conn.poll(timeout):
            raise WaitTimeoutError(f"the receiver did not answer {endpoint} within {timeout} s")
        return conn.recv()

    return post


def _measure(model: str, quick: bool, ctx):
    import multiprocessing as mp
    import os

    import torch
    import torch.multiprocessing  # noqa: F401 (CUDA tensors travel as IPC handles through the pipe)

    from ...sync import HostSender, IpcSender, Sender, SharedHostBuffer
    from ...integrations.sglang import SGLangTensorSender

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
        out["slime"], out["slime_peak"] = _timed_peak(lambda: slime_update(plan, src, a), reps)

        # as a trainer feeds a colocated SGLang engine: the receiver answers each request as SGLang's handler does
        sg = Sender(src, SGLangTensorSender(sglang_post(a)), plan=plan)
        a.send(("sglang", reps + WARMUP))

        def ebb_sglang():
            version[0] += 1
            sg.push(version[0])

        ctx.progress(f"sync {model}: ebbtide SGLang tensor request")
        try:
            out["sglang"], out["sglang_peak"] = _timed_peak(ebb_sglang, reps)
        finally:
            sg.close()
            torch.cuda.ipc_collect()  # the blocks the receiver released go back to this process's allocator

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
        a.close()  # a consumer still waiting for a message (this side failed mid-protocol) sees EOF and returns
        proc.join(60)
        if proc.is_alive():
            proc.kill()
        host.close()
    return plan, out


def sglang_rows(label: str, plan, t: dict, limit_gbps: float, params: dict):
    """The two "SGLang tensor request" rows of one model from ``_measure``'s results (``t``: seconds "sglang" and
    "slime", peak extra bytes "sglang_peak" and "slime_peak"): speed in GB/s of bf16 published beside the
    slime-style path into the same receiver, under the CUDA IPC row's HBM limit; and the trainer's peak extra GPU
    memory during one update (the largest over the timed updates), lower is better, against two buckets of the
    suite's budget. A tensor over the budget gets a bucket of its own (the dense model's embedding and lm_head,
    raw bf16), so the most two consecutive buckets of the plan hold is a param beside it: the sender keeps the
    bucket posted and the one queued behind it."""
    sizes = [b.nbytes for b in plan.buckets]
    pair = max((a + b for a, b in zip(sizes, sizes[1:])), default=sizes[0]) / GiB
    peak, anchor_peak, two = t["sglang_peak"] / GiB, t["slime_peak"] / GiB, 2 * BUCKET / GiB
    p = {**params, "ms": t["sglang"] * 1e3, "anchor_ms": t["slime"] * 1e3, "peak_extra_GiB": round(peak, 3),
         "anchor_peak_extra_GiB": round(anchor_peak, 3), "bucket_GiB": BUCKET / GiB,
         "largest_bucket_GiB": round(max(sizes) / GiB, 3), "two_consecutive_buckets_GiB": round(pair, 3),
         "form": "flattened_bucket"}
    goals = f"goals: >= 1.5x the anchor's GB/s, peak extra GPU memory <= 2 buckets ({two:g} GiB)"
    if pair > two:
        goals += f"; this plan's two consecutive buckets reach {pair:.2f} GiB (a tensor over the budget is a bucket)"
    yield Row("sync", f"{label}: SGLang tensor request", "GB/s", plan.source_bytes / t["sglang"] / GB,
              anchor=plan.source_bytes / t["slime"] / GB, anchor_name=SLIME + ", same receiver", limit=limit_gbps,
              limit_name=HBM_LIMIT, params=p, note=goals)
    yield Row("sync", f"{label}: SGLang tensor request, trainer's peak extra GPU memory", "GiB", peak,
              higher_is_better=False, anchor=anchor_peak, anchor_name=SLIME, limit=max(pair, two),
              limit_name="the plan's largest two consecutive buckets: the one posted and the one queued", params=p,
              note=goals + "; max_memory_allocated over what was allocated before the update (a block shared by "
                           "CUDA IPC counts until the receiver released it); the limit is a ceiling: >= 100% of it "
                           "is within it")


def _loader_rows(ctx, model: str, label: str, hbm: float):
    """The "into SGLang's loaders" row of ``model`` (nothing where SGLang is not installed: said as progress)."""
    if importlib.util.find_spec("sglang") is None:
        ctx.progress(f"sync {model}: SGLang not installed, no 'into SGLang's loaders' row")
        return
    ctx.progress(f"sync {model}: into SGLang's loaders (ebbtide's loader vs SGLang's load_weights)")
    try:
        r = spawn.call("main", model, ctx.quick, 3 if ctx.quick else 8, "cuda:0",
                       module="ebbtide.bench.suites._sglang_loader_worker", timeout=900)
    except spawn.WorkerFailed as e:
        r, why = None, e.brief
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


@suite("sync", needs="gpu", description="weight update to a second process on one GPU: ebbtide IPC / SGLang "
                                        "tensor request / host vs a slime-style path, GB/s of bf16 published")
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
                  anchor_name=SLIME, limit=src / hbm_s / GB, limit_name=HBM_LIMIT,
                  params={**params, "ms": t["ipc"] * 1e3, "anchor_ms": t["slime"] * 1e3})
        yield from sglang_rows(label, plan, t, src / hbm_s / GB, params)
        yield from _loader_rows(ctx, model, label, hbm)
        yield Row("sync", f"{label}: pinned host buffer", "GB/s", src / t["host"] / GB, anchor_note="n/a",
                  limit=src / pcie_s / GB, limit_name="pinned D2H + H2D of the FP8 bytes",
                  params={**params, "ms": t["host"] * 1e3})
