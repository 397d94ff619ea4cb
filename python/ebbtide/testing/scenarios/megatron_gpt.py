"""Megatron-core GPT scenarios on one GPU that the GPU tests run and the Megatron benchmark builds on: a GPT from
the local (non-Transformer-Engine) layer spec (NCCL world of one), under Float16Module (bf16) and Megatron's DDP.

The setup (``SIZES``, ``init``, ``build``, ``batch``, ``train``, ``ours``, ``sync_time``) is what the benchmark's
worker (``ebbtide bench megatron``) times; the scenarios, each run in a fresh process by
``ebbtide.testing.spawn.call`` (with ``teardown=False``: paused pools and communicators go with the process):
- ``exact``: losses of ebbtide's optimizer in exact mode beside Megatron's CPU AdamW path (DistributedOptimizer +
  HybridDeviceOptimizer, offload fraction 1.0, D2H/H2D overlap), its CPU AdamW in for-loop and fused form;
- ``cycles``: ebbtide's optimizer + TrainingState through offload/restore cycles; params, host state and grad
  buffers compared bit for bit; the refusals (offload twice, restore without offload);
- ``overlap``: weights discarded at each offload, restored plainly in one model and with
  ``restore(overlap_forward=True)`` (its upload held back by a long kernel) in an identical one; losses and params;
- ``megatron_state``: TrainingState over Megatron's own GPU-resident DistributedOptimizer, bit for bit;
- ``checkpoint``: ebbtide's state_dict loads into Megatron's Float16OptimizerWithFloat16Params and back.
"""
from __future__ import annotations

import time
import warnings
from itertools import chain

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex.*")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ...anchors.megatron import build_gpt, hdo, opt_config  # noqa: E402
from ..bits import same_bits  # noqa: E402
from ..ports import free_port  # noqa: E402

__all__ = ["SIZES", "init", "build", "batch", "train", "ours", "sync_time", "exact", "cycles", "overlap",
           "megatron_state", "checkpoint"]

SIZES = {  # name -> (layers, hidden, heads, vocab, seq, batch)
    "tiny": (2, 256, 4, 1024, 128, 2),
    "quick": (4, 1024, 16, 32000, 512, 2),
    "default": (24, 2048, 16, 32000, 2048, 1),
}


def init(seed: int = 1234, ebbtide_groups: bool = False):
    from megatron.core import parallel_state as ps  # noqa: PLC0415
    from megatron.core import tensor_parallel  # noqa: PLC0415

    torch.cuda.set_device(0)
    if ebbtide_groups:
        import ebbtide.integrations.megatron as ebt  # noqa: PLC0415

        ebt.install_groups()
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
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


def sync_time(fn):
    """(seconds, fn()) with the device synchronized before and after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


# ---- scenarios ------------------------------------------------------------------------------------------------
def exact(size: str = "tiny", steps: int = 20) -> dict:
    """``steps`` steps with ebbtide's optimizer in exact mode, then the same model and data under Megatron's CPU
    AdamW path with ``fused=False`` and as Megatron configures it (``fused=True``); the losses of each."""
    init()
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


def cycles(size: str = "tiny", cycles: int = 50, weights: str = "copy") -> dict:
    """ebbtide's optimizer + TrainingState through ``cycles`` offload/restore cycles (groups released and reloaded
    in the first): params, host state and grad buffers bit for bit; the refusals; training after, the cache
    trimmed on a thread as each CPU update starts."""
    import ebbtide.integrations.megatron as ebt  # noqa: PLC0415
    from ebbtide.errors import StateError  # noqa: PLC0415

    init(ebbtide_groups=True)
    model = build(size, dist_opt=False)
    opt = ours(model, "exact")
    state = ebt.TrainingState([model], opt, weights=weights)
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
            assert same_bits(p, q), f"param differs after cycle {c}"
        for b in model.buffers:
            assert not b.grad_data.any(), f"grad buffer not zero after cycle {c}"
    now = _snapshot(model, opt)[1]
    assert all(same_bits(host[k], now[k]) for k in host), "host optimizer state changed"
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


def overlap(size: str = "tiny", cycles: int = 3, delay_cycles: int = 200_000_000) -> dict:
    """Two identical models, weights discarded at every offload: one restored plainly, one with
    ``restore(overlap_forward=True)`` whose upload stream is held back by a long kernel first (so a forward that
    did not wait for its weights would read the fresh, unfilled pages). Losses and params must be bitwise equal."""
    import ebbtide.integrations.megatron as ebt  # noqa: PLC0415

    init(ebbtide_groups=True)
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
                            torch.cuda._sleep(delay_cycles)
                state.restore(overlap_forward=overlap)
                armed.append(len(state._armed))
            opt.zero_grad()
            losses.append(train(model, size, s))
            opt.step()
        torch.cuda.synchronize()
        runs[overlap] = (losses, [p.detach().clone() for p in model.parameters()], armed)
    (l0, p0, _), (l1, p1, armed) = runs[False], runs[True]
    return {"losses_plain": l0, "losses_overlap": l1, "params_equal": all(same_bits(a, b) for a, b in zip(p0, p1)),
            "hooks_armed": armed}


def megatron_state(size: str = "tiny", cycles: int = 3) -> dict:
    """TrainingState over Megatron's own GPU-resident DistributedOptimizer (params, grad buffers, fp32 main params
    and Adam moments) for ``cycles`` cycles, compared bit for bit."""
    import ebbtide.integrations.megatron as ebt  # noqa: PLC0415
    from megatron.core.optimizer import get_megatron_optimizer  # noqa: PLC0415

    init()
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
    for _ in range(cycles):
        off = state.offload()
        state.restore()
    now = [t for g in inner.param_groups for t in g["params"]]
    now += [v for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    assert all(same_bits(a, b) for a, b in zip(snap, now)), "optimizer state differs"
    assert all(same_bits(p, q) for p, q in zip(model.parameters(), params)), "params differ"
    opt.zero_grad()
    train(model, size, 2)
    opt.step()
    return {"offload": off.summary(), "tags": off.tags}


def checkpoint(size: str = "tiny") -> dict:
    """ebbtide's state_dict loads into Megatron's Float16OptimizerWithFloat16Params and back."""
    from megatron.core.optimizer import get_megatron_optimizer  # noqa: PLC0415

    init()
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
            assert same_bits(a.cuda(), b), "master differs in Megatron's optimizer"
    back = ours(build(size, dist_opt=False), "exact")
    back.load_state_dict(inner.state_dict())
    for p, q in zip(chain.from_iterable(back.float16_groups), chain.from_iterable(opt.float16_groups)):
        a, b = back.optimizer.state[p], opt.optimizer.state[q]
        for k in ("master_param", "exp_avg", "exp_avg_sq"):
            assert same_bits(a[k], b[k]), f"{k} differs after the round trip"
    return {"ok": True, "type": type(inner).__name__}
