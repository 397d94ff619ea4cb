"""One process of the Megatron benchmark and GPU tests: a Megatron-core GPT from the local (non-Transformer-Engine)
layer spec on one GPU (NCCL world of one), under Float16Module (bf16) and Megatron's DDP.

``python -m ebbtide.bench.suites._megatron_worker COMMAND SPEC_JSON OUT_JSON``; the result (or the traceback) goes
to OUT_JSON. Commands:
- ``exact``: 20 steps with ebbtide's optimizer in exact mode, then the same model and data under Megatron's CPU
  AdamW path (DistributedOptimizer + HybridDeviceOptimizer, offload fraction 1.0, D2H/H2D overlap), once with the
  CPU AdamW as Megatron configures it (``fused=True``) and once with ``fused=False``; the losses of each.
- ``cycles``: ebbtide's optimizer + TrainingState; ``cycles`` offload/restore cycles; params, host state and grad
  buffers compared bit for bit; the refusals (offload twice, restore without offload).
- ``overlap``: weights discarded at each offload, restored plainly in one model and with
  ``restore(overlap_forward=True)`` (its upload held back by a long kernel) in an identical one; losses and params.
- ``megatron_state``: TrainingState over Megatron's own GPU-resident DistributedOptimizer (params, grad buffers,
  fp32 main params and Adam moments) for a few cycles, compared bit for bit.
- ``checkpoint``: ebbtide's state_dict loads into Megatron's Float16OptimizerWithFloat16Params and back.
- ``bench``: per-phase timings of one variant: "ebbtide" (get_optimizer + TrainingState), "hdo" (Megatron's
  HybridDeviceOptimizer with overlap; Megatron's offload_grad_buffers + buffer offload_to_cpu), "hdo_tms" (HDO,
  DDP buffers and optimizer in one torch_memory_saver region with CPU backup, the step inside it), "gpu_tms" (GPU-resident
  DistributedOptimizer, same torch_memory_saver region).
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time
import traceback
from itertools import chain
import warnings

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex.*")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ...anchors.megatron import build_gpt, hdo, opt_config  # noqa: E402,F401  (shared with the colocated example)

SIZES = {  # name -> (layers, hidden, heads, vocab, seq, batch)
    "tiny": (2, 256, 4, 1024, 128, 2),
    "quick": (4, 1024, 16, 32000, 512, 2),
    "default": (24, 2048, 16, 32000, 2048, 1),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(seed: int = 1234, ebbtide_groups: bool = False):
    from megatron.core import parallel_state as ps  # noqa: PLC0415
    from megatron.core import tensor_parallel  # noqa: PLC0415

    torch.cuda.set_device(0)
    if ebbtide_groups:
        import ebbtide.integrations.megatron as ebt  # noqa: PLC0415

        ebt.install_groups()
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    ps.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build(size: str, *, dist_opt: bool, seed: int = 1234):
    """A GPT chunk of size ``size`` (SIZES) wrapped as Megatron trains it: GPTModel -> Float16Module (bf16) -> DDP."""
    layers, hidden, heads, vocab, seq, _ = SIZES[size]
    return build_gpt(layers, hidden, heads, 4 * hidden, vocab, seq, dist_opt=dist_opt, seed=seed)


def batch(size: str, step: int):
    _, _, _, vocab, seq, b = SIZES[size]
    g = torch.Generator().manual_seed(10_000 + step)
    data = torch.randint(vocab, (b, seq + 1), generator=g).cuda()
    pos = torch.arange(seq, device="cuda").unsqueeze(0).expand(b, -1)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device="cuda"), 1).view(1, 1, seq, seq)
    return data[:, :-1].contiguous(), pos, mask, data[:, 1:].contiguous()


def train(model, size: str, step: int) -> float:
    """zero the grad buffer, forward, backward, finish the grad sync (Megatron's order); returns the loss."""
    model.zero_grad_buffer()
    tokens, pos, mask, labels = batch(size, step)
    loss = model(tokens, pos, mask, labels=labels).float().mean()
    loss.backward()
    model.finish_grad_sync()
    return float(loss.item())


def ours(model, mode: str = "fast", clip: float = 0.0):
    import ebbtide.integrations.megatron as ebt  # noqa: PLC0415

    return ebt.get_optimizer(opt_config(clip_grad=clip), [model], mode=mode)


def _sync_time(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


# ---- commands --------------------------------------------------------------------------------------------------
def cmd_exact(spec: dict) -> dict:
    init()
    size, steps = spec.get("size", "tiny"), spec.get("steps", 20)
    out = {}
    for name, make in (("ebbtide_exact", lambda m: ours(m, "exact")), ("hdo_forloop", lambda m: hdo(m, fused=False)),
                       ("hdo_fused", lambda m: hdo(m, fused=True))):
        model = build(size, dist_opt=name.startswith("hdo"))
        opt = make(model)
        losses = []
        for s in range(steps):
            opt.zero_grad()
            losses.append(train(model, size, s))
            ok, _, _ = opt.step()
            assert ok
        out[name] = losses
        del opt, model
        torch.cuda.empty_cache()
    return out


def _snapshot(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    host = {k: getattr(opt.optimizer, k).clone() for k in ("_master", "_m", "_v")}
    return params, host


def cmd_cycles(spec: dict) -> dict:
    import ebbtide.integrations.megatron as ebt  # noqa: PLC0415
    from ebbtide.errors import StateError  # noqa: PLC0415

    init(ebbtide_groups=True)
    size, cycles = spec.get("size", "tiny"), spec.get("cycles", 50)
    model = build(size, dist_opt=False)
    opt = ours(model, "exact")
    state = ebt.TrainingState([model], opt, weights=spec.get("weights", "copy"))
    losses = []
    for s in range(2):
        opt.zero_grad()
        losses.append(train(model, size, s))
        opt.step()
    params, host = _snapshot(model, opt)
    errors = {}
    try:
        state.restore()
    except StateError as e:
        errors["restore_without_offload"] = str(e)
    reports = []
    for c in range(cycles):
        off = state.offload()
        if c == 0:
            try:
                state.offload()
            except StateError as e:
                errors["offload_twice"] = str(e)
            ebt.release_groups(include_world=True)
            ebt.reload_groups()
        on = state.restore()
        reports.append((off.bytes, off.bytes_copied, off.residual_reserved, on.bytes_copied))
        for p, q in zip(model.parameters(), params):
            assert torch.equal(p, q), f"param differs after cycle {c}"
        for b in model.buffers:
            assert not b.grad_data.any(), f"grad buffer not zero after cycle {c}"
    now = _snapshot(model, opt)[1]
    assert all(torch.equal(host[k], now[k]) for k in host), "host optimizer state changed"
    # training goes on after the cycles, the cache trimmed on a thread as each CPU update starts
    opt.update_start_hooks.append(lambda: state.trim_cache(background=True))
    trims = []
    for s in range(2, 4):
        opt.zero_grad()
        losses.append(train(model, size, s))
        opt.step()
        trims.append(state.offload().parts)
        try:
            state.trim_cache()
        except StateError as e:
            errors["trim_offloaded"] = str(e)
        state.restore()
    return {"errors": errors, "reports": reports[:2] + reports[-1:], "losses": losses, "trims": trims,
            "offload": off.summary(), "restore": on.summary()}


def cmd_overlap(spec: dict) -> dict:
    """Two identical models, weights discarded at every offload: one restored plainly, one with
    ``restore(overlap_forward=True)`` whose upload stream is held back by a long kernel first (so a forward that
    did not wait for its weights would read the fresh, unfilled pages). Losses and params must be bitwise equal."""
    import ebbtide.integrations.megatron as ebt  # noqa: PLC0415

    init(ebbtide_groups=True)
    size, cycles = spec.get("size", "tiny"), spec.get("cycles", 3)
    runs = {}
    for overlap in (False, True):
        model = build(size, dist_opt=False)
        opt = ours(model, "exact")
        state = ebt.TrainingState([model], opt, weights="discard", tag_prefix=f"ov{int(overlap)}")
        losses, armed = [], []
        for s in range(2 + cycles):
            if s >= 2:
                state.offload()
                if overlap:
                    for o in state._offadams:
                        with torch.cuda.stream(o._transport.h2d):
                            torch.cuda._sleep(spec.get("delay_cycles", 200_000_000))
                state.restore(overlap_forward=overlap)
                armed.append(len(state._armed))
            opt.zero_grad()
            losses.append(train(model, size, s))
            opt.step()
        torch.cuda.synchronize()
        runs[overlap] = (losses, [p.detach().clone() for p in model.parameters()], armed)
    (l0, p0, _), (l1, p1, armed) = runs[False], runs[True]
    return {"losses_plain": l0, "losses_overlap": l1, "params_equal": all(torch.equal(a, b) for a, b in zip(p0, p1)),
            "hooks_armed": armed}


def cmd_megatron_state(spec: dict) -> dict:
    import ebbtide.integrations.megatron as ebt  # noqa: PLC0415
    from megatron.core.optimizer import get_megatron_optimizer  # noqa: PLC0415

    init()
    size = spec.get("size", "tiny")
    model = build(size, dist_opt=True)
    opt = get_megatron_optimizer(opt_config(use_distributed_optimizer=True), [model])
    state = ebt.TrainingState([model], opt)
    for s in range(2):
        opt.zero_grad()
        train(model, size, s)
        opt.step()
    inner = opt.optimizer
    snap = [t.detach().clone() for g in inner.param_groups for t in g["params"]]
    snap += [v.detach().clone() for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    params = [p.detach().clone() for p in model.parameters()]
    for _ in range(spec.get("cycles", 3)):
        off = state.offload()
        state.restore()
    now = [t for g in inner.param_groups for t in g["params"]]
    now += [v for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(snap, now)), "optimizer state differs"
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params)), "params differ"
    opt.zero_grad()
    train(model, size, 2)
    opt.step()
    return {"offload": off.summary(), "tags": off.tags}


def cmd_checkpoint(spec: dict) -> dict:
    from megatron.core.optimizer import get_megatron_optimizer  # noqa: PLC0415

    init()
    size = spec.get("size", "tiny")
    model = build(size, dist_opt=False)
    opt = ours(model, "exact")
    for s in range(2):
        opt.zero_grad()
        train(model, size, s)
        opt.step()
    sd = opt.state_dict()
    meg_model = build(size, dist_opt=False)
    with torch.no_grad():
        for p, q in zip(meg_model.parameters(), model.parameters()):
            p.copy_(q)
    meg = get_megatron_optimizer(opt_config(), [meg_model])  # Float16OptimizerWithFloat16Params, GPU AdamW
    inner = meg.chained_optimizers[0] if hasattr(meg, "chained_optimizers") else meg
    inner.load_state_dict(sd)
    for g_ours, g_meg in zip(sd["fp32_from_fp16_params"], inner.fp32_from_float16_groups):
        for a, b in zip(g_ours, g_meg):
            assert torch.equal(a.cuda(), b), "master differs in Megatron's optimizer"
    back = ours(build(size, dist_opt=False), "exact")
    back.load_state_dict(inner.state_dict())
    for p, q in zip(chain.from_iterable(back.float16_groups), chain.from_iterable(opt.float16_groups)):
        a, b = back.optimizer.state[p], opt.optimizer.state[q]
        for k in ("master_param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a[k], b[k]), f"{k} differs after the round trip"
    return {"ok": True, "type": type(inner).__name__}


def _phase_stats(xs):
    return {"median_s": statistics.median(xs), "min_s": min(xs), "n": len(xs)}


def cmd_bench(spec: dict) -> dict:
    variant, size = spec["variant"], spec.get("size", "default")
    steps, warmup = spec.get("steps", 5), spec.get("warmup", 2)
    tms = None
    if variant in ("hdo_tms", "gpu_tms"):
        # Importing Megatron's GPT model imports its inference context, which sets torch_memory_saver.hook_mode; TMS
        # refuses that once initialised (the retain_cpu_backup setter below initialises it): import Megatron first.
        import megatron.core.models.gpt  # noqa: F401, PLC0415
        from torch_memory_saver import torch_memory_saver as tms  # noqa: PLC0415

        tms.hook_mode = "torch"
        tms.retain_cpu_backup = True  # keep the pinned backup across cycles (its best setting)
    init(ebbtide_groups=variant == "ebbtide")
    dist_opt = variant != "ebbtide"
    if tms is not None:
        # The anchors' best settings (as the colocated Megatron loop runs them): the model is built outside the
        # region and only DDP's construction inside it, so its buffers are paused while the construction-time
        # storages it copied from are freed in the default pool instead of cached in the region and copied at every
        # pause; the optimizer is built, and steps (below), inside the region, so the Adam state its first step
        # creates is paused too; zero_grad() right after the step frees the fp32 main grads before the pause.
        region = lambda: tms.region(tag="train", enable_cpu_backup=True)  # noqa: E731
        layers, hidden, heads, vocab, seq, _ = SIZES[size]
        model = build_gpt(layers, hidden, heads, 4 * hidden, vocab, seq, dist_opt=True, ddp_region=region)
        with region():
            opt = hdo(model, clip=1.0) if variant == "hdo_tms" else get_gpu_opt(model)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    else:
        model = build(size, dist_opt=dist_opt)
        opt = ours(model, "fast", clip=1.0) if variant == "ebbtide" else hdo(model, clip=1.0)
    state = None
    if variant == "ebbtide":
        import ebbtide.integrations.megatron as ebt  # noqa: PLC0415

        state = ebt.TrainingState([model], opt)

    def offload():
        if state is not None:
            return state.offload()
        if tms is not None:
            torch.cuda.empty_cache()
            tms.pause()
            return torch.cuda.empty_cache()
        model.offload_grad_buffers()
        for b in model.buffers:
            b.offload_to_cpu(move_params=True, move_grads=False)
        return torch.cuda.empty_cache()

    def restore():
        if state is not None:
            return state.restore()
        if tms is not None:
            return tms.resume()
        for b in model.buffers:
            b.reload_from_cpu(move_params=True, move_grads=False)
        return model.restore_grad_buffers()

    phases = {k: [] for k in ("train", "optimizer_step", "offload", "restore")}
    losses, residual, used = [], [], []
    def step():
        if tms is None:
            return opt.step()
        with tms.region(tag="train", enable_cpu_backup=True):
            out = opt.step()
        opt.zero_grad()
        return out

    for s in range(warmup + steps):
        opt.zero_grad()
        t_train, loss = _sync_time(lambda s=s: train(model, size, s))
        t_opt, _ = _sync_time(step)
        t_off, _ = _sync_time(offload)
        free, total = torch.cuda.mem_get_info()
        t_on, _ = _sync_time(restore)
        losses.append(loss)
        if s >= warmup:
            for k, v in (("train", t_train), ("optimizer_step", t_opt), ("offload", t_off), ("restore", t_on)):
                phases[k].append(v)
            used.append(total - free)
            residual.append(torch.cuda.memory_reserved())
    n_params = sum(p.numel() for p in model.parameters())
    return {"variant": variant, "size": size, "params": n_params, "losses": losses,
            "phases": {k: _phase_stats(v) for k, v in phases.items()},
            "device_used_offloaded": min(used), "torch_reserved_offloaded": min(residual),
            "device": torch.cuda.get_device_name(), "optimizer": type(opt).__name__,
            "inner": type(getattr(opt, "optimizer", opt)).__name__}


def get_gpu_opt(model):
    from megatron.core.optimizer import get_megatron_optimizer  # noqa: PLC0415

    return get_megatron_optimizer(opt_config(use_distributed_optimizer=True, clip_grad=1.0), [model])


COMMANDS = {"exact": cmd_exact, "cycles": cmd_cycles, "overlap": cmd_overlap, "megatron_state": cmd_megatron_state,
            "checkpoint": cmd_checkpoint, "bench": cmd_bench}


def run(command: str, spec: dict, *, timeout: float = 600.0, env: dict | None = None) -> dict:
    """Run ``command`` in a fresh process (its own CUDA context, memory engine and process groups); returns its
    result dict, or raises RuntimeError with the process's traceback and output tail."""
    import subprocess  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="ebt-megatron-") as d:
        out = os.path.join(d, "out.json")
        proc = subprocess.run([sys.executable, "-m", __name__, command, json.dumps(spec), out],
                              capture_output=True, text=True, timeout=timeout, env=env)
        try:
            with open(out) as f:
                res = json.load(f)
        except (OSError, ValueError):
            res = {"ok": False, "error": f"no result (exit code {proc.returncode})"}
        if not res.get("ok"):
            raise RuntimeError(f"megatron worker {command} failed:\n{res.get('error')}\n--- output tail ---\n"
                               f"{(proc.stdout + proc.stderr)[-4000:]}")
        return res["result"]


def main(argv=None) -> int:
    command, spec, out = (argv or sys.argv[1:])[:3]
    res: dict = {"ok": False}
    try:
        res["result"] = COMMANDS[command](json.loads(spec))
        res["ok"] = True
    except Exception:  # noqa: BLE001 (written to the result file for the parent)
        res["error"] = traceback.format_exc()
        print(res["error"], file=sys.stderr, flush=True)
    with open(out, "w") as f:
        json.dump(res, f)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: paused pools and communicators go with the process
