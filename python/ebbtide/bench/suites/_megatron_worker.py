"""The Megatron benchmark's measurement process (``ebbtide bench megatron``): ``bench(variant, ...)``, run by
``ebbtide.testing.spawn.call`` with ``teardown=False`` in a process of its own, returns per-phase timings of one
variant on a Megatron-core GPT (``ebbtide.testing.scenarios.megatron_gpt``: the same setup the GPU tests run):
"ebbtide" (get_optimizer + TrainingState), "hdo" (Megatron's HybridDeviceOptimizer with overlap; Megatron's
offload_grad_buffers + buffer offload_to_cpu), "hdo_tms" (HDO, DDP buffers and optimizer in one torch_memory_saver
region with CPU backup, the step inside it), "gpu_tms" (GPU-resident DistributedOptimizer, same torch_memory_saver
region).
"""
from __future__ import annotations

import statistics

import torch

from ...anchors.megatron import build_gpt, hdo, opt_config
from ...testing.scenarios.megatron_gpt import SIZES, build, init, ours, sync_time, train


def _phase_stats(xs):
    return {"median_s": statistics.median(xs), "min_s": min(xs), "n": len(xs)}


def bench(variant: str, size: str = "default", steps: int = 5, warmup: int = 2) -> dict:
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
        t_train, loss = sync_time(lambda s=s: train(model, size, s))
        t_opt, _ = sync_time(step)
        t_off, _ = sync_time(offload)
        free, total = torch.cuda.mem_get_info()
        t_on, _ = sync_time(restore)
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
