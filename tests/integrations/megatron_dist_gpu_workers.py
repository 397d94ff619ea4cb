"""Rank bodies for the distributed (sharded) optimizer on GPUs (NCCL, one rank per GPU): exact-mode losses against
Megatron's CPU path as slime runs it (DistributedOptimizer + HybridDeviceOptimizer, offload fraction 1.0, D2H/H2D
overlap, its CPU AdamW in for-loop form) at DP=2 and TP=2, and the CPU step time per rank."""
from __future__ import annotations

import datetime
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist

from megatron_dist_workers import opt_config as cpu_config
from megatron_dist_workers import moe_kwargs, no_te_moe_fix

warnings.filterwarnings("ignore")

SIZES = {"tiny": (2, 256, 4, 1024, 128, 2), "quick": (4, 1024, 16, 32000, 512, 2)}  # layers hidden heads vocab seq b


def _setup(rank, world, init, tp, ep=1, groups=False):
    from megatron.core import parallel_state as ps  # noqa: PLC0415

    from ebbtide.testing.spawn import join_store  # noqa: PLC0415

    torch.cuda.set_device(rank)
    if groups:
        import ebbtide.integrations.megatron as ebt  # noqa: PLC0415

        ebt.install_groups(timeout=120)
    dist.init_process_group("nccl", store=join_store(init), rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank), timeout=datetime.timedelta(seconds=120))
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    no_te_moe_fix()


def _gpt(size, seed=7, experts=0, dispatcher="alltoall"):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: PLC0415
    from megatron.core.models.gpt import GPTModel  # noqa: PLC0415
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: PLC0415
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: PLC0415
    from megatron.core.transformer.module import Float16Module  # noqa: PLC0415
    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: PLC0415

    layers, hidden, heads, vocab, seq, _ = SIZES[size]
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    moe = moe_kwargs(experts, dispatcher, 2 * hidden)
    cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, bf16=True,
                            pipeline_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
                            init_method_std=0.02, **moe)
    spec = get_gpt_layer_local_spec(num_experts=experts or None, moe_grouped_gemm=False)
    gpt = GPTModel(cfg, spec, vocab_size=vocab, max_sequence_length=seq, position_embedding_type="rope")
    gpt.cuda(torch.cuda.current_device())
    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=False,
                                            overlap_grad_reduce=False)
    return DistributedDataParallel(cfg, ddp_cfg, Float16Module(cfg, gpt))


def _train(model, size, step):
    from megatron.core import parallel_state as ps  # noqa: PLC0415

    _, _, _, vocab, seq, b = SIZES[size]
    g = torch.Generator().manual_seed(10_000 + 100 * step + ps.get_data_parallel_rank())
    data = torch.randint(vocab, (b, seq + 1), generator=g).cuda()
    pos = torch.arange(seq, device="cuda").unsqueeze(0).expand(b, -1)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device="cuda"), 1).view(1, 1, seq, seq)
    model.zero_grad_buffer()
    loss = model(data[:, :-1].contiguous(), pos, mask, labels=data[:, 1:].contiguous()).float().mean()
    loss.backward()
    model.finish_grad_sync()
    out = loss.detach().double().reshape(1)
    dist.all_reduce(out)
    return float(out.item())


def _config(**kw):
    return cpu_config(**{"lr": 3e-4, **kw})


def _hdo(model):
    from megatron.core.optimizer import get_megatron_optimizer  # noqa: PLC0415

    opt = get_megatron_optimizer(_config(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0,
                                         overlap_cpu_optimizer_d2h_h2d=True),
                                 [model])
    for sub in getattr(opt, "chained_optimizers", [opt]):
        for g in sub.optimizer.param_groups:
            g["fused"] = False  # torch's CPU AdamW in for-loop form: the exact reference
    return opt


def _timed_steps(model, opt, size, steps, first=0):
    losses, times = [], []
    for s in range(first, first + steps):
        opt.zero_grad()
        losses.append(_train(model, size, s))
        torch.cuda.synchronize()
        t = time.perf_counter()
        ok, _, _ = opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        assert ok
    return losses, times


def exact(rank, world, init, tp=1, steps=20, size="tiny"):
    """Losses over ``steps`` bit-identical to Megatron's DistributedOptimizer + HybridDeviceOptimizer (for-loop
    CPU AdamW); params equal after; host state per rank = 12 B per owned element."""
    import ebbtide.integrations.megatron as ebt  # noqa: PLC0415

    _setup(rank, world, init, tp)
    ref_model = _gpt(size)
    ref_losses, ref_t = _timed_steps(ref_model, _hdo(ref_model), size, steps)
    model = _gpt(size)
    opt = ebt.get_optimizer(_config(), [model], mode="exact")
    losses, t = _timed_steps(model, opt, size, steps)
    diff = [(i, a, b) for i, (a, b) in enumerate(zip(losses, ref_losses)) if a != b]
    assert not diff, diff[:5]
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    total = sum(b.numel for b in model.buffers)
    return {"losses": losses, "owned": opt.optimizer.numel, "total": total, "host_bytes": opt.optimizer.host_bytes,
            "step_s": statistics.median(t[2:]), "hdo_step_s": statistics.median(ref_t[2:])}


def step_time(rank, world, init, size="quick", steps=6):
    """Median CPU optimizer step per rank (fast mode, all the host's cores shared by the local ranks)."""
    import ebbtide.integrations.megatron as ebt  # noqa: PLC0415

    _setup(rank, world, init, 1)
    model = _gpt(size)
    threads = max(1, (os.cpu_count() or 2) // world)
    opt = ebt.get_optimizer(_config(), [model], threads=threads)
    _, t = _timed_steps(model, opt, size, steps)
    return {"step_s": statistics.median(t[1:]), "owned": opt.optimizer.numel, "threads": threads,
            "host_bytes": opt.optimizer.host_bytes}


def moe(rank, world, init, dispatcher="alltoall", steps=8, size="tiny"):
    """A MoE GPT at EP=``world`` (4 experts, top-2; ``dispatcher`` "alltoall" or "flex" = DeepEP): ebbtide's sharded
    optimizer (exact) against Megatron's DistributedOptimizer + HybridDeviceOptimizer; ebbtide's run offloads its
    state (TrainingState) and releases every group -- DeepEP's buffer too -- between steps, as the colocated loop
    does around a rollout: losses bit-identical to the reference that never cycles."""
    import ebbtide.comm as comm  # noqa: PLC0415
    import ebbtide.integrations.megatron as ebt  # noqa: PLC0415

    _setup(rank, world, init, 1, ep=world, groups=True)
    ref_model = _gpt(size, experts=4, dispatcher=dispatcher)
    ref = _hdo(ref_model)
    ref_losses, _ = _timed_steps(ref_model, ref, size, steps)
    del ref, ref_model
    model = _gpt(size, experts=4, dispatcher=dispatcher)
    opt = ebt.get_optimizer(_config(), [model], mode="exact")
    state = ebt.TrainingState([model], opt)
    losses, rows = [], []
    for s in range(steps):
        opt.zero_grad()
        losses.append(_train(model, size, s))
        ok, _, _ = opt.step()
        assert ok
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        off = state.offload()
        rel = ebt.release_groups(include_world=True)
        free1 = torch.cuda.mem_get_info()[0]
        rel2 = ebt.reload_groups()
        state.restore()
        deep = [g for g in rel.groups if g.desc == "DeepEP buffer"]
        rows.append({"freed_mib": (free1 - free0) / 2**20, "deepep_buffers": len(deep),
                     "release_s": rel.seconds, "reload_s": rel2.seconds, "offload_s": off.seconds})
    diff = [(i, a, b) for i, (a, b) in enumerate(zip(losses, ref_losses)) if a != b]
    assert not diff, diff[:5]
    if dispatcher == "flex":
        assert all(r["deepep_buffers"] == 1 for r in rows), rows
    experts = sum(g["is_expert_parallel"] for g in opt.param_groups)
    assert experts >= 1 and comm.is_installed()
    return {"losses": losses, "cycles": rows}


def discard_cycles(rank, world, init, steps=6, size="tiny", overlap=False):
    """ebbtide's sharded optimizer under ``TrainingState(weights="discard")``: the DDP param buffers dropped at every
    offload and rebuilt from each rank's host mirror of its shards (zeroed, uploaded, all-gathered at the restore or,
    with ``overlap``, at the first forward): losses and params bit-identical to a twin that never offloads."""
    import ebbtide.integrations.megatron as ebt  # noqa: PLC0415

    _setup(rank, world, init, 1)
    twin_model = _gpt(size)
    twin = ebt.get_optimizer(_config(), [twin_model], mode="exact")
    model = _gpt(size)
    opt = ebt.get_optimizer(_config(), [model], mode="exact")
    state = ebt.TrainingState([model], opt, weights="discard")
    assert opt.optimizer.param_mirror is not None
    losses, twin_losses, copied = [], [], []
    for s in range(steps):
        for m, o, out in ((model, opt, losses), (twin_model, twin, twin_losses)):
            o.zero_grad()
            out.append(_train(m, size, s))
            ok, _, _ = o.step()
            assert ok
        off = state.offload()
        rep = state.restore(overlap_forward=overlap)
        copied.append((off.tags[state.tags["weights_mirrored"]]["bytes_copied"],
                       rep.tags[state.tags["weights_mirrored"]]["bytes_copied"]))
    state.wait_weights()
    diff = [(i, a, b) for i, (a, b) in enumerate(zip(losses, twin_losses)) if a != b]
    assert not diff, diff[:5]
    for p, q in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(p, q)
    return {"losses": losses, "copied": copied, "mirror_bytes": opt.optimizer.param_mirror.nbytes}
