"""Measurement worker of the `steady` suite: ``measure(spec)``, run by ``ebbtide.testing.spawn.call`` in a process of
its own, runs one memory setup ("mode") and returns a dict of timings.

The same code runs in every mode; only where the memory comes from differs (``MODES``):
- ``plain``: no memory library (the reference every other mode is held to);
- ``tms-torch`` / ``tms-preload``: torch_memory_saver in its torch hook mode / its default LD_PRELOAD mode (the
  parent starts this process with its shim preloaded); in preload mode the decode graph is captured pausable
  (``torch_memory_saver.cuda_graph``), as SGLang does;
- ``ebbtide-preload``: ebbtide's LD_PRELOAD shim with a process default tag (every allocation of every thread in the
  engine), the decode graph captured with ``ebbtide.memory.graph`` into the cache's tag: the colocated loop's
  rollout;
- ``ebbtide-torch``: ebbtide's in-process (pluggable allocator) regions and pausable graph;
- ``compat-torch``: ``ebbtide.compat.torch_memory_saver`` in torch hook mode (the drop-in).

Weights live in a CPU-backed tag, the KV cache (and, where the mode makes it pausable, the decode graph) in a
discarded one. A "cycle" is what a colocated rollout does between two generations: ``empty_cache`` and a pause of
every tag, then a resume. Timings: wall clock around synchronous calls (``torch.cuda.synchronize`` before and
after); the graph's step alone with CUDA events around ``STEP_REPLAYS`` replays. Part ``update`` (run in the plain
process): the decode right after a weight update through ``ebbtide.sync`` against the anchor's load. Part ``hf``:
the FSDP2 loop's rollout decode (transformers' Qwen3, eager, its static cache in the discarded tag), steady and
right after a cycle, with the decoding thread's CPU time (an eager decode of it is host-bound: its CPU time is its
wall time, so a setup that made the host's work slower shows there).
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch

MODES = ("plain", "tms-torch", "tms-preload", "ebbtide-preload", "ebbtide-torch", "compat-torch")
STEP_REPLAYS = 50
ALLOC_SIZES = (512, 64 << 10, 2 << 20, 32 << 20, 256 << 20, 1 << 30)


def _now_synced() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


class _Memory:
    """The mode's regions, graph context, pause and resume behind one surface."""

    def __init__(self, mode: str):
        self.mode = mode
        self.em = self.tms = None
        if mode.startswith("ebbtide"):
            import ebbtide.memory as em  # noqa: PLC0415

            want = "preload" if mode == "ebbtide-preload" else "torch"
            if em.hook_mode() != want:
                raise RuntimeError(f"mode {mode} needs hook mode {want}, this process has {em.hook_mode()} "
                                   f"(LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r})")
            self.em = em
        elif mode in ("tms-torch", "tms-preload", "compat-torch"):
            if mode == "compat-torch":
                from ebbtide.compat.torch_memory_saver import torch_memory_saver as tms  # noqa: PLC0415
            else:
                from torch_memory_saver import torch_memory_saver as tms  # noqa: PLC0415
            tms.hook_mode = "preload" if mode == "tms-preload" else "torch"
            self.tms = tms
        elif mode != "plain":
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")

    def region(self, tag: str, cpu_backup: bool):
        if self.em is not None:
            return self.em.region(tag, backup="cpu" if cpu_backup else "none")
        if self.tms is not None:
            return self.tms.region(tag=tag, enable_cpu_backup=cpu_backup)
        return contextlib.nullcontext()

    def graph_context(self, tag: str, pausable: bool):
        """``graph_context(graph, stream)`` for GraphDecoder; None: plain ``torch.cuda.graph``."""
        if not pausable:
            return None
        if self.em is not None:
            return lambda g, s: self.em.graph(g, tag=tag, backup="none", stream=s)
        if self.mode == "tms-preload":
            return lambda g, s: self.tms.cuda_graph(g, stream=s, tag=tag)
        return None  # torch hook mode of torch_memory_saver cannot pause a graph's private pool

    def pause(self, empty_cache: bool):
        torch.cuda.synchronize()
        if empty_cache:
            torch.cuda.empty_cache()
        # by tag, for either library: the allocation part leaves its own tags paused, and torch_memory_saver's
        # pause of every tag exits the process on a tag that is already paused
        if self.em is not None:
            self.em.pause("weights")
            self.em.pause("kv_cache")
        elif self.tms is not None:
            self.tms.pause("weights")
            self.tms.pause("kv_cache")
            if empty_cache:
                torch.cuda.empty_cache()

    def pause_tag(self, tag: str):
        torch.cuda.synchronize()
        if self.em is not None:
            self.em.pause(tag)
        elif self.tms is not None:
            self.tms.pause(tag)

    def resume(self):
        if self.em is not None:
            self.em.resume("weights")
            self.em.resume("kv_cache")
        elif self.tms is not None:
            self.tms.resume("weights")
            self.tms.resume("kv_cache")
        torch.cuda.synchronize()


def _step_us(dec, pos: int) -> float:
    """Mean µs of one decode step replayed alone (graph) or run eagerly (static-eager), over STEP_REPLAYS, from
    position ``pos`` (a step advances the decoder's position: ``pos + STEP_REPLAYS + 2`` must fit the cache)."""
    dec.pos.fill_(pos)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dec._step()
    start.record()
    for _ in range(STEP_REPLAYS):
        dec._step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / STEP_REPLAYS


def build_model(spec: dict):
    """The example's model (bf16, ``TinyLM.random``: the same construction as the colocated rollout's), built inside
    the caller's region."""
    from ebbtide.testing.models import ModelConfig, TinyLM  # noqa: PLC0415

    return TinyLM.random(ModelConfig(**spec["model"]), seed=0, device="cuda")


def decode_rows(mem: _Memory, spec: dict) -> dict:
    from ebbtide.testing.models import GraphDecoder, KVCache, ModelConfig  # noqa: PLC0415

    cfg = ModelConfig(**spec["model"])
    B, P, N = spec["batch"], spec["prompt_len"], spec["new_tokens"]
    with mem.region("weights", cpu_backup=True):
        model = build_model(spec)
    model.requires_grad_(False)
    with mem.region("kv_cache", cpu_backup=False):
        cache = KVCache(cfg, B, P + N, device="cuda", dtype=torch.bfloat16)
    prompt = torch.randint(cfg.vocab, (B, P), generator=torch.Generator().manual_seed(7))
    out: dict = {}
    pausable = spec.get("graph", "tag") == "tag"
    for decode in spec.get("decodes", ("graph", "eager")):
        with mem.region("kv_cache", cpu_backup=False):  # the static token/position/sequence buffers
            dec = GraphDecoder(model, cache, B, capture=decode == "graph",
                               graph_context=mem.graph_context("kv_cache", pausable))

        gpu, host = [], []

        def generate(dec=dec):
            t0 = _now_synced()
            ev = {}
            seq, _ = dec.generate(prompt.cuda(), N, events=ev)
            t = _now_synced() - t0
            gpu.append(ev["prefilled"].elapsed_time(ev["end"]) / 1e3)
            host.append(ev["host_enqueue_s"])
            return t, int(seq.sum().item())

        generate()  # the capture (graph) and lazy inits
        steady, first, step, step_after, checks = [], [], [], [], set()
        for _ in range(spec["cycles"] if decode == "graph" else 1):  # eager is long and host-bound: one cycle
            for _ in range(spec["reps"]):
                t, c = generate()
                steady.append(t)
                checks.add(c)
            step.append(_step_us(dec, P))
            mem.pause(spec.get("empty_cache", True))
            mem.resume()
            t, c = generate()  # the first generation after the cycle (the KV cache came back undefined)
            first.append(t)
            checks.add(c)
            step_after.append(_step_us(dec, P))
        out[decode] = {"generate_s": steady, "first_after_cycle_s": first, "step_us": step,
                       "step_after_cycle_us": step_after, "distinct_checksums": len(checks),
                       "decode_gpu_s": gpu[1:], "host_enqueue_s": host[1:]}
        del dec
    return out


def _fwd_bwd_times(model, tokens, reps: int, zero_grad, after=lambda: None) -> list:
    """Seconds of ``reps`` forward + backward passes (two untimed first: lazy inits, the caching allocator's first
    blocks); ``zero_grad`` before and ``after`` after each, untimed."""
    times = []
    for i in range(reps + 2):
        zero_grad()
        t0 = _now_synced()
        model.loss(tokens).backward()
        t = _now_synced() - t0
        after()
        if i >= 2:
            times.append(t)
    return times


def train_rows(mem: _Memory, spec: dict) -> dict:
    """Forward + backward of the toy model (bf16), its weights in the mode's CPU-backed tag, gradients and
    activations where the mode puts untagged memory (preload: the process default tag; otherwise torch's pool).
    In the ebbtide modes also with ``OffloadedAdam`` attached (its flat params and grads in tags, as the colocated
    trainer places them), with and without the gradient download overlapped with the backward."""
    from ebbtide.testing.models import ModelConfig  # noqa: PLC0415
    from ebbtide.bench.colocate.rank import train_tokens  # noqa: PLC0415

    cfg = ModelConfig(**spec["model"])
    tokens = train_tokens(cfg, spec["train_batch"], spec["train_seq"], 0, 0).cuda()
    with mem.region("weights", cpu_backup=True):
        model = build_model(spec)
    out = {"fwd_bwd_s": _fwd_bwd_times(model, tokens, spec["train_reps"], lambda: model.zero_grad(set_to_none=False))}
    del model
    if mem.em is not None:
        from ebbtide.bench.colocate.trainer import region_buffers  # noqa: PLC0415
        from ebbtide.optim import OffloadedAdam  # noqa: PLC0415

        for overlap in (False, True):
            model = build_model(spec)
            opt = OffloadedAdam(model.parameters(), lr=1e-5, mode="fast", overlap_with_backward=overlap,
                                buffer_factory=region_buffers(mem.em))
            torch.cuda.empty_cache()
            # the step (untimed) consumes the gradient downloads the hooks started during the backward
            out[f"fwd_bwd_offloaded_{'overlap' if overlap else 'plain'}_s"] = _fwd_bwd_times(
                model, tokens, spec["train_reps"], opt.zero_grad, opt.step)
            del opt, model
            torch.cuda.empty_cache()
    return out


def alloc_rows(mem: _Memory) -> dict:
    """``torch.empty`` of each size, median µs of 9: cold (the caching allocator asks the allocator below it) and
    warm (a cached block). ``default``: outside any region (``empty_cache`` makes the next one cold; in preload mode
    that is the process default tag's engine path); ``region``: in a fresh discard tag per try (a tag's pool keeps its
    cached blocks through ``empty_cache``), paused afterwards to give the memory back."""
    out: dict = {}
    wheres = ("default", "region") if mem.mode != "plain" else ("default",)
    for where in wheres:
        for size in ALLOC_SIZES:
            cold, warm = [], []
            for i in range(9):
                torch.cuda.empty_cache()
                tag = f"alloc{size}_{i}"
                with (mem.region(tag, cpu_backup=False) if where == "region" else contextlib.nullcontext()):
                    t0 = _now_synced()
                    x = torch.empty(size, dtype=torch.uint8, device="cuda")
                    cold.append(_now_synced() - t0)
                    del x
                    t0 = _now_synced()
                    x = torch.empty(size, dtype=torch.uint8, device="cuda")
                    warm.append(_now_synced() - t0)
                    del x
                if where == "region":
                    mem.pause_tag(tag)
            out[f"{where}/{size}"] = {"cold_us": statistics.median(cold) * 1e6,
                                      "warm_us": statistics.median(warm) * 1e6}
    torch.cuda.empty_cache()
    if mem.mode == "plain":  # the driver's VMM calls alone: the floor of any allocator that maps its own memory
        from ._vmm_floor import torch_segment_bytes, vmm_floor_us  # noqa: PLC0415

        seg = {s: torch_segment_bytes(s) for s in ALLOC_SIZES}  # what the cold torch.empty really maps
        floor = vmm_floor_us(sorted(set(seg.values())))
        out["vmm"] = {str(s): {**floor[seg[s]], "segment_bytes": seg[s]} for s in ALLOC_SIZES}
    return out


def _other_context_work() -> None:
    """A little GPU work in a second CUDA context of this process (a 1 MiB memset): the GPU switches contexts, as it
    does when a colocated trainer works between two generations (Note [One compute stream in a rollout] in
    ebbtide/sync/receiver.py)."""
    import ctypes  # noqa: PLC0415

    cu = ctypes.CDLL("libcuda.so.1")
    dev = torch.cuda.current_device()
    ctx, ptr = ctypes.c_void_p(), ctypes.c_uint64()
    if cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) != 0:
        raise RuntimeError("cuCtxCreate_v2 failed")
    try:
        for call, args in (("cuMemAlloc_v2", (ctypes.byref(ptr), 1 << 20)), ("cuMemsetD8_v2", (ptr, 0, 1 << 20)),
                           ("cuCtxSynchronize", ())):
            if getattr(cu, call)(*args) != 0:
                raise RuntimeError(f"{call} failed in the second context")
    finally:
        if ptr.value:
            cu.cuMemFree_v2(ptr)
        cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        cu.cuCtxDestroy_v2(ctx)
        torch.cuda.set_device(dev)


def update_rows(spec: dict) -> dict:
    """CUDA-graph decode right after a weight update, the colocated rollout's two load paths over one shared pinned
    buffer: ebbtide.sync (``HostReceiver`` into a ``Receiver``) and the anchor's (one copy to the device, then the
    torch formula per tensor on the caller's stream). Before each load the sender packs the update and another
    context does a little GPU work, as the trainer does between two generations. The model loads its own
    quantized weights (the figures are timings; the bits are tests/sync's)."""
    from ebbtide.testing.models import GraphDecoder, KVCache, ModelConfig  # noqa: PLC0415
    from ebbtide.bench.colocate.sync import RolloutSync, TrainerSync  # noqa: PLC0415

    cfg = ModelConfig(**spec["model"])
    B, P, N = spec["batch"], spec["prompt_len"], spec["new_tokens"]
    model = build_model(spec)
    model.requires_grad_(False)
    dec = GraphDecoder(model, KVCache(cfg, B, P + N, device="cuda", dtype=torch.bfloat16), B)
    prompt = torch.randint(cfg.vocab, (B, P), generator=torch.Generator().manual_seed(7)).cuda()
    senders = {c: TrainerSync(model, c, pin=True) for c in ("ebbtide", "torch")}
    loaders = {c: RolloutSync(model, c, senders[c].fd, senders[c].nbytes, pin=True) for c in senders}
    out = {c: {"generate_s": [], "decode_gpu_s": [], "load_s": []} for c in senders}
    dec.generate(prompt, N)  # the capture
    version = 0
    for _ in range(spec["cycles"] * spec["reps"] + 1):
        version += 1
        for codec in senders:
            senders[codec].pack(version)
            _other_context_work()
            t0 = _now_synced()
            loaders[codec].load(version)
            t1 = _now_synced()
            ev = {}
            dec.generate(prompt, N, events=ev)
            t2 = _now_synced()
            if version > 1:  # the first round warms both paths up
                for k, v in (("load_s", t1 - t0), ("generate_s", t2 - t1),
                             ("decode_gpu_s", ev["prefilled"].elapsed_time(ev["end"]) / 1e3)):
                    out[codec][k].append(v)
    for c in senders:
        loaders[c].close()
        senders[c].close()
    return out


def hf_decode_rows(mem: _Memory, spec: dict) -> dict:
    """Part ``hf`` (see the module policies): ``spec["hf_reps"]`` generations in a row, then as many each after a
    cycle; wall and thread CPU seconds of each. ``spec["device"]`` (default "cuda"; "cpu" runs the logic alone)."""
    from ebbtide.testing.models import ModelConfig, greedy_decode  # noqa: PLC0415
    from ebbtide.testing.qwen3 import Qwen3Cache, Qwen3LM  # noqa: PLC0415

    dev = torch.device(spec.get("device", "cuda"))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    cfg = ModelConfig(**spec["hf_model"])
    B, P, N = spec["hf_batch"], spec["hf_prompt_len"], spec["hf_new_tokens"]
    with mem.region("weights", cpu_backup=True):
        model = Qwen3LM.random(cfg, seed=0, device=dev)
    model.requires_grad_(False)
    with mem.region("kv_cache", cpu_backup=False):
        cache = Qwen3Cache(cfg, B, P + N, device=dev, dtype=torch.bfloat16)
    prompt = torch.randint(cfg.vocab, (B, P), generator=torch.Generator().manual_seed(7))
    out: dict = {k: [] for k in ("generate_s", "cpu_s", "after_cycle_s", "after_cycle_cpu_s")}
    checks = set()

    def generate(wall: str, cpu: str):
        sync()
        t0, c0 = time.perf_counter(), time.thread_time()
        seq, _ = greedy_decode(model, prompt.to(dev), N, cache)
        sync()
        out[wall].append(time.perf_counter() - t0)
        out[cpu].append(time.thread_time() - c0)
        checks.add(int(seq.sum().item()))

    with torch.no_grad():
        generate("generate_s", "cpu_s")  # lazy inits; not kept
        for k in out:
            out[k].clear()
        for _ in range(spec["hf_reps"]):
            generate("generate_s", "cpu_s")
        for _ in range(spec["hf_reps"]):
            if dev.type == "cuda":
                mem.pause(True)
                mem.resume()
            generate("after_cycle_s", "after_cycle_cpu_s")
    out["distinct_checksums"] = len(checks)
    return out


def measure(spec: dict) -> dict:
    """Every part of ``spec`` in this process's memory setup. Run it with ``teardown=False``: no interpreter teardown,
    whatever is paused goes back with the process."""
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    mem = _Memory(spec["mode"])
    res: dict = {"mode": spec["mode"], "pid": os.getpid(), "device": torch.cuda.get_device_name()}
    t0 = time.perf_counter()
    for part in spec.get("parts", ("decode", "train", "alloc", "update")):
        if part == "decode":
            res["decode"] = decode_rows(mem, spec)
        elif part == "train":
            res["train"] = train_rows(mem, spec)
        elif part == "alloc":
            res["alloc"] = alloc_rows(mem)
        elif part == "update":
            res["update"] = update_rows(spec)
        elif part == "hf":
            res["hf"] = hf_decode_rows(mem, spec)
        else:
            raise ValueError(f"unknown part {part!r}")
    res["wall_s"] = time.perf_counter() - t0
    return res
