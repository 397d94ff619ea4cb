"""Rank bodies for the distributed (sharded) optimizer on CPU (Gloo): a real Megatron-core GPT, Megatron's DDP with
``use_distributed_optimizer=True`` and ``initialize_model_parallel``, against Megatron's own DistributedOptimizer.

Megatron's DDP and GPT allocate on ``torch.cuda.current_device()`` and use CUDA RNG state: :func:`cpu_megatron`
redirects those calls to the CPU inside the spawned rank (a test harness only; nothing of it is in the library).
Megatron's DistributedOptimizer on CPU tensors falls back to torch's AdamW (no Transformer Engine/Apex), which runs
its for-loop form on CPU tensors: the reference ebbtide's exact mode must match bit for bit."""
from __future__ import annotations

import datetime
import os
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")


def cpu_megatron() -> None:
    """Redirect Megatron's CUDA-only allocation and RNG calls to the CPU (this process only)."""
    torch.cuda.current_device = lambda: "cpu"

    def cpu_kw(f):
        def g(*a, **k):
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return f(*a, **k)
        return g

    for name in ("tensor", "zeros", "ones", "empty", "full", "arange", "randn"):
        setattr(torch, name, cpu_kw(getattr(torch, name)))
    import megatron.core.tensor_parallel.random as R  # noqa: PLC0415

    R._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    R._set_cuda_rng_state = lambda s, *a, **k: torch.set_rng_state(s)
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.manual_seed = lambda s: torch.manual_seed(s)
    plain_type = torch.Tensor.type

    def cuda_type(self, *a, **k):  # Megatron's DistributedOptimizer checks param.type() for torch.cuda.*Tensor
        if not a and not k:
            t = plain_type(self)
            return t.replace("torch.", "torch.cuda.", 1) if self.device.type == "cpu" else t
        return plain_type(self, *a, **k)

    torch.Tensor.type = cuda_type


def _setup(rank, world, init, tp=1, ep=1):
    from megatron.core import parallel_state as ps  # noqa: PLC0415

    from ebbtide.testing.spawn import join_store  # noqa: PLC0415

    cpu_megatron()
    dist.init_process_group("gloo", store=join_store(init), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    no_te_moe_fix()


def no_te_moe_fix() -> None:
    """megatron-core 0.16.1 leaves ``moe_utils.te_general_gemm`` undefined without Transformer Engine (a NameError
    in every MoE forward); None selects its torch path."""
    import megatron.core.transformer.moe.moe_utils as moe_utils  # noqa: PLC0415

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def moe_kwargs(experts: int, dispatcher: str, ffn: int) -> dict:
    """TransformerConfig fields of a top-2 MoE over the expert-parallel group Megatron initialised ({} for a dense
    model); ``dispatcher`` "flex" runs on DeepEP."""
    if not experts:
        return {}
    from megatron.core import parallel_state as ps  # noqa: PLC0415

    moe = dict(num_moe_experts=experts, moe_router_topk=2, moe_token_dispatcher_type=dispatcher,
               expert_model_parallel_size=ps.get_expert_model_parallel_world_size(), moe_ffn_hidden_size=ffn)
    if dispatcher == "flex":
        moe["moe_flex_dispatcher_backend"] = "deepep"
    return moe


def _gpt(seed=7, layers=2, hidden=64, heads=4, vocab=128, seq=16, experts=0, fp32_grads=False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: PLC0415
    from megatron.core.models.gpt import GPTModel  # noqa: PLC0415
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: PLC0415
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: PLC0415
    from megatron.core.transformer.module import Float16Module  # noqa: PLC0415
    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: PLC0415

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    moe = moe_kwargs(experts, "allgather", 96)  # CPU: the alltoall dispatcher allocates on the GPU
    cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, bf16=True,
                            params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
                            use_cpu_initialization=True, init_method_std=0.02, **moe)
    spec = get_gpt_layer_local_spec(num_experts=experts or None, moe_grouped_gemm=False)
    gpt = GPTModel(cfg, spec, vocab_size=vocab, max_sequence_length=seq)
    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=fp32_grads,
                                            bucket_size=4096)  # several buckets, shards cutting params
    return DistributedDataParallel(cfg, ddp_cfg, Float16Module(cfg, gpt))


def _step(model, opt, step, rank, errors=None):
    """One training step; the DP-mean loss. A ``StepError`` of the optimizer goes to ``errors`` when given."""
    from ebbtide.errors import StepError  # noqa: PLC0415

    model.zero_grad_buffer()
    opt.zero_grad()
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, 128, (2, 17), generator=g)
    pos = torch.arange(16).unsqueeze(0).expand(2, 16)
    loss = model(ids[:, :-1], pos, None, labels=ids[:, 1:]).float().mean()
    loss.backward()
    model.finish_grad_sync()
    try:
        ok, _norm, _ = opt.step()
    except StepError as e:
        if errors is None:
            raise
        errors.append(e)
        ok = e.completed
    assert ok
    out = torch.tensor([loss.item()], dtype=torch.float64)
    dist.all_reduce(out)  # the DP-mean loss, as Megatron reports it
    return float(out.item())


def opt_config(lr=1e-3, **kw):
    from megatron.core.optimizer import OptimizerConfig  # noqa: PLC0415

    base = dict(optimizer="adam", lr=lr, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                bf16=True, use_distributed_optimizer=True, clip_grad=0.0)
    base.update(kw)
    return OptimizerConfig(**base)


def moe_exact(rank, world, init, steps=5, ep=2):
    """A Megatron MoE GPT at EP=``ep``: expert-parallel params (their own buffers, grad-reduction group and the
    shared norm group) in ebbtide's sharded optimizer; losses bit-identical to Megatron's DistributedOptimizer
    (dense + expert optimizers chained)."""
    from megatron.core.optimizer import get_megatron_optimizer  # noqa: PLC0415

    import ebbtide.integrations.megatron as ebt  # noqa: PLC0415

    _setup(rank, world, init, ep=ep)
    ref_model = _gpt(experts=4)
    ref = get_megatron_optimizer(opt_config(), [ref_model])
    assert len(getattr(ref, "chained_optimizers", [])) == 2, "expected a dense and an expert optimizer"
    ref_losses = [_step(ref_model, ref, s, rank) for s in range(steps)]
    model = _gpt(experts=4)
    opt = ebt.get_optimizer(opt_config(), [model], mode="exact", bucket_numel=1000)
    experts = [b for b in opt.layout.buffers if b in list(model.expert_parallel_buffers)]
    assert experts, "no expert-parallel buffer reached the optimizer"
    losses = [_step(model, opt, s, rank) for s in range(steps)]
    assert losses == ref_losses, (losses, ref_losses)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    from ebbtide.errors import UnsupportedError  # noqa: PLC0415

    try:
        opt.get_parameter_state_dp_zero()
        refused = ""
    except UnsupportedError as e:
        refused = str(e)
    assert "expert-parallel buffers" in refused, refused
    inner = opt.optimizer  # the pipeline's buckets: pieces of many params, of alternating param groups, few copies
    buckets = [(b.end - b.start, len(b.pieces), len(b.uploads), len(b.calls)) for b in inner._buckets]
    return {"losses": losses, "expert_groups": sum(g["is_expert_parallel"] for g in opt.param_groups),
            "shards": len(inner.shards), "buckets": buckets}


def dp_exact(rank, world, init, steps=6, tp=1, fp32_grads=False):
    """Losses, masters and Megatron's dp_zero checkpoint: ebbtide's sharded optimizer (exact) vs Megatron's
    DistributedOptimizer; then Megatron's checkpoint loaded into ebbtide's optimizer and trained on, equal again."""
    from megatron.core.optimizer import get_megatron_optimizer  # noqa: PLC0415

    import ebbtide.integrations.megatron as ebt  # noqa: PLC0415
    from ebbtide.errors import InvalidArgumentError  # noqa: PLC0415

    _setup(rank, world, init, tp=tp)
    ref_model = _gpt(fp32_grads=fp32_grads)
    ref = get_megatron_optimizer(opt_config(), [ref_model])
    ref_losses = [_step(ref_model, ref, s, rank) for s in range(steps)]
    ref_state = ref.chained_optimizers[0].get_parameter_state_dp_zero()
    model = _gpt(fp32_grads=fp32_grads)
    opt = ebt.get_optimizer(opt_config(), [model], mode="exact", bucket_numel=1000)
    assert type(opt).__name__ == "EbbtideDistributedOptimizer", type(opt)
    # the norm's all-reduce runs over a Gloo twin of the grad-stats group (its ranks, not the NCCL communicator)
    twin, stats = opt.grad_stats_cpu_group, opt.grad_stats_parallel_group
    assert twin is not None and twin is not stats and dist.get_backend(twin) == "gloo"
    assert dist.get_process_group_ranks(twin) == sorted(dist.get_process_group_ranks(stats))
    losses = [_step(model, opt, s, rank) for s in range(steps)]
    assert losses == ref_losses, (losses, ref_losses)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    total = sum(b.numel for b in model.buffers)
    owned = opt.optimizer.numel
    state = opt.get_parameter_state_dp_zero()
    if dist.get_rank(ref_model.buffers[0].data_parallel_group) == 0:
        for bi, v in ref_state.items():
            if bi == "buckets_coalesced":
                continue
            for key, world_t in v.items():
                for k in ("param", "exp_avg", "exp_avg_sq"):
                    assert torch.equal(world_t[k], state[bi][key][k]), (bi, key, k)
    # Megatron's checkpoint into ebbtide's optimizer (a fresh one, other weights), then both go on equal.
    fresh_model = _gpt(seed=99, fp32_grads=fp32_grads)
    fresh = ebt.get_optimizer(opt_config(), [fresh_model], mode="exact", bucket_numel=1000)
    fresh.load_state_dict(ref.chained_optimizers[0].state_dict())
    fresh.load_parameter_state_from_dp_zero(ref_state)
    for p, q in zip(fresh_model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    more_ref = [_step(ref_model, ref, s, rank) for s in range(steps, steps + 2)]
    more = [_step(fresh_model, fresh, s, rank) for s in range(steps, steps + 2)]
    assert more == more_ref, (more, more_ref)
    # A checkpoint of another layout is refused on every rank, nothing changed.
    before = [p.clone() for p in fresh_model.parameters()]
    try:
        fresh.load_parameter_state_from_dp_zero({"buckets_coalesced": True, 0: {}})
        refused = ""
    except InvalidArgumentError as e:
        refused = str(e)
    assert "dp_zero" in refused and all(torch.equal(a, b) for a, b in zip(before, fresh_model.parameters()))
    return {"losses": losses, "owned": owned, "total": total, "host_bytes": opt.optimizer.host_bytes}


def dp_interrupted(rank, world, init, steps=4, bf16_moments=False):
    """A step interrupted on one rank (its CPU kernel fails once, mid-step, inside a chunk of two param groups) is made
    whole there and the params gathered as after any step: losses, params and the dp_zero state bit-identical to
    an uninterrupted twin on every rank. With bf16 moments (Megatron's precision-aware fields, set after
    construction: its config check wants Transformer Engine), host memory is 8 B per owned element."""
    import ebbtide.integrations.megatron as ebt  # noqa: PLC0415

    _setup(rank, world, init)
    cfg = opt_config()
    if bf16_moments:
        cfg.use_precision_aware_optimizer = True
        cfg.exp_avg_dtype = cfg.exp_avg_sq_dtype = torch.bfloat16
    pairs = [(m, ebt.get_optimizer(cfg, [m], mode="exact", bucket_numel=300)) for m in (_gpt(), _gpt())]
    buckets = pairs[0][1].optimizer._buckets
    assert len(buckets) >= 4
    # the failing call: the second kernel call (param group) of the first bucket that makes several, so its first
    # call has run and must not run again when the step is finished
    at = next((i for i, b in enumerate(buckets) if len(b.calls) > 1), None) if rank == 0 else 0
    assert at is not None, [len(b.calls) for b in buckets]
    calls_before = sum(len(b.calls) for b in buckets[:at]) + 1
    errors, losses = [], [[], []]
    for s in range(steps):
        for k, (model, opt) in enumerate(pairs):
            if k == 0 and s == 2 and rank == 0:
                inject_kernel_failure(opt.optimizer._transport, at=calls_before)
            losses[k].append(_step(model, opt, s, rank, errors if k == 0 else None))
    assert all(e.bucket == at for e in errors), (errors, at)
    errors = [str(e) for e in errors]
    (a, oa), (b, ob) = pairs
    assert losses[0] == losses[1], losses
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    sa, sb = oa.get_parameter_state_dp_zero(), ob.get_parameter_state_dp_zero()
    if dist.get_rank(a.buffers[0].data_parallel_group) == 0:
        for bi, v in sb.items():
            if bi != "buckets_coalesced":
                for key, t in v.items():
                    for k in ("param", "exp_avg", "exp_avg_sq"):
                        assert torch.equal(t[k], sa[bi][key][k]), (bi, key, k)
    return {"errors": errors, "host_bytes": oa.optimizer.host_bytes, "owned": oa.optimizer.numel}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def dp_host_memory(rank, world, init, bf16_moments=False):
    """The host memory the sharded optimizer takes on each rank, measured (resident set before and after it is
    built; its growth over a second step), against the shard's bytes: 12 B per owned element, 8 with bf16
    moments."""
    import ctypes  # noqa: PLC0415
    import gc  # noqa: PLC0415

    import ebbtide.integrations.megatron as ebt  # noqa: PLC0415

    # glibc's mmap threshold fixed at 64 KiB (M_MMAP_THRESHOLD = -3): every large block is its own mapping, unmapped
    # when freed, so the resident set moves by exactly what is held (the default threshold adapts upwards and lets
    # new blocks reuse memory freed earlier, which hides them from the difference)
    if ctypes.CDLL(None).mallopt(-3, 1 << 16) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")
    _setup(rank, world, init)
    model = _gpt(hidden=512, heads=8, vocab=32000, seq=16)
    cfg = opt_config()
    if bf16_moments:
        cfg.use_precision_aware_optimizer = True
        cfg.exp_avg_dtype = cfg.exp_avg_sq_dtype = torch.bfloat16
    gc.collect()
    before = _rss()
    opt = ebt.get_optimizer(cfg, [model], bucket_numel=1 << 16)
    built = _rss()
    _step(model, opt, 0, rank)  # the first step also allocates the training's own host memory
    gc.collect()
    first = _rss()
    _step(model, opt, 1, rank)
    gc.collect()
    second = _rss()
    inner = opt.optimizer
    slots = sum(t.numel() * t.element_size() for t in inner._gslots + inner._oslots)
    return {"built": built - before, "growth": second - first, "host_bytes": inner.host_bytes,
            "slots": slots, "owned": inner.numel, "total": sum(b.numel for b in model.buffers)}


def inject_kernel_failure(transport, at):
    """Call ``at`` (from now) of the pipeline's CPU kernel raises once; the others run."""
    kernel, calls = transport.kernel, [0]

    def fail_once(step, *args):
        calls[0] += 1
        if calls[0] == at + 1:
            transport.kernel = kernel
            raise RuntimeError("injected kernel failure")
        return kernel(step, *args)

    transport.kernel = fail_once


def refusals(rank, world, init):
    """Mismatched DDP/optimizer forms are refused by name before anything is built."""
    import ebbtide.integrations.megatron as ebt  # noqa: PLC0415
    from ebbtide.errors import InvalidArgumentError, UnsupportedError  # noqa: PLC0415

    _setup(rank, world, init)
    model = _gpt()
    out = {}
    for name, cfg, kw in (("plain_config", opt_config(use_distributed_optimizer=False), {}),
                          ("cpu_offload", opt_config(optimizer_cpu_offload=True), {}),
                          ("factory", opt_config(), {"buffer_factory": lambda *a: None}),
                          ("stats_on_cpu", opt_config(), {"stats_on_cpu": "yes"})):
        try:
            ebt.get_optimizer(cfg, [model], **kw)
            out[name] = ""
        except (InvalidArgumentError, UnsupportedError) as e:
            out[name] = str(e)
    return out
