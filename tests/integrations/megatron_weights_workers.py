"""Rank bodies for a Megatron-core GPT's weights as the rollout takes them, on CPU (Gloo): the tensor-parallel
gather (``tensor_parallel_dims``, ``full_weights``) and ``ebbtide.sync.Sender`` with ``each_rank_sends`` over the
host transport. With ``use_cpu_initialization`` Megatron draws every split weight whole and keeps the rank's
piece, so the same seed gives the TP=1 model's tensors bit for bit: the oracle."""
from __future__ import annotations

import torch

from ebbtide.testing.bits import digests
from megatron_dist_workers import _gpt, _setup


def weights(rank, world, init, tp=1):
    import ebbtide.integrations.megatron as ebt  # noqa: PLC0415
    from ebbtide.integrations.names import served_names  # noqa: PLC0415
    from ebbtide.sync import (HostReceiver, HostSender, Plan, Receiver, Sender, SharedHostBuffer,  # noqa: PLC0415
                              expected)

    _setup(rank, world, init, tp=tp)
    model = _gpt(seed=11, hidden=128, heads=4, vocab=256)
    dims = ebt.tensor_parallel_dims([model])
    full = ebt.full_weights([model])
    out = {"dims": dims, "digests": digests(full)}
    if tp > 1:
        from megatron.core import parallel_state as ps  # noqa: PLC0415

        local = {n: p.detach() for n, p in served_names(model.named_parameters()).items()}
        plan = Plan.of({n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in full.items()})
        buf = SharedHostBuffer.create(SharedHostBuffer.size_for(plan), pin=False)
        try:
            sender = Sender(local, HostSender(buf, keep_slots=False), plan=plan, each_rank_sends=True,
                            tp_group=ps.get_tensor_model_parallel_group(), tp_dims=dims)
            dst = {it.source: torch.zeros(it.shape, dtype=full[it.source].dtype) for it in plan.items}
            sender.push(3)
            HostReceiver(buf).receive(Receiver(dst, plan), 3)
            want = expected(plan, full)
            out["sent_equal"] = all(torch.equal(dst[n], want[n]) for n in want)
            out["sent"] = len(want)
            out["fp8_items"] = sum(it.kind == "fp8" for it in plan.items)
        finally:
            buf.close()
    return out


def shard_mirror(rank, world, init, steps=4):
    """ebbtide's distributed optimizer with its host mirror (what TrainingState(weights="discard") rebuilds the
    weights from): losses bitwise those without it, the mirror equal to the owned params after every step, and
    params scribbled over come back bitwise from the mirror and DDP's all-gather."""
    import ebbtide.integrations.megatron as ebt  # noqa: PLC0415
    from ebbtide.integrations.megatron._sharded import shard_ranges  # noqa: PLC0415
    from megatron_dist_workers import _step, opt_config  # noqa: PLC0415

    _setup(rank, world, init)
    plain_model = _gpt()
    plain = ebt.get_optimizer(opt_config(), [plain_model], mode="exact", bucket_numel=1000)
    model = _gpt()
    opt = ebt.get_optimizer(opt_config(), [model], mode="exact", bucket_numel=1000)
    inner = opt.optimizer
    mirror = inner.enable_param_mirror()
    assert mirror.numel() == inner.numel and inner.enable_param_mirror() is mirror
    losses, plain_losses = [], []
    for s in range(steps):
        plain_losses.append(_step(plain_model, plain, s, rank))
        losses.append(_step(model, opt, s, rank))
        host = 0  # the mirror holds the shards' elements in their order
        for shard in inner.shards:
            n = shard.param.numel()
            assert torch.equal(mirror[host:host + n], shard.param), (s, host)
            host += n
    assert losses == plain_losses, (losses, plain_losses)
    before = [p.detach().clone() for p in model.parameters()]
    for b in model.buffers:
        b.param_data.normal_()  # the weights lost (on a GPU: discarded pages)
    inner.upload_params_from_mirror()
    owned_written = all(b.param_data[lo:hi].ne(0).any() for b in model.buffers for lo, hi in shard_ranges(b))
    model.start_param_sync(force_sync=True)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    more = [_step(model, opt, s, rank) for s in range(steps, steps + 2)]
    more_plain = [_step(plain_model, plain, s, rank) for s in range(steps, steps + 2)]
    assert more == more_plain, (more, more_plain)
    return {"losses": losses, "owned_written": bool(owned_written)}


def ep_weights(rank, world, init, experts=4, topk=2):
    """A MoE GPT at expert parallel ``world`` (fp32, SequentialMLP experts, the allgather dispatcher): every rank's
    ``full_weights`` holds all experts under their global names, and the rollout's ``MegatronGPT`` loaded with them
    gives Megatron's expert-parallel forward's logits."""
    import contextlib  # noqa: PLC0415

    from megatron.core import parallel_state, tensor_parallel  # noqa: PLC0415
    from megatron.core.models.gpt import GPTModel  # noqa: PLC0415
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: PLC0415
    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: PLC0415

    import ebbtide.integrations.megatron as ebt  # noqa: PLC0415
    from ebbtide.testing.models import MegatronGPT, MoEConfig, ModelConfig  # noqa: PLC0415
    from megatron_dist_workers import moe_kwargs  # noqa: PLC0415

    _setup(rank, world, init, ep=world)
    torch.manual_seed(5)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    layers, hidden, heads, ffn, vocab, seq = 2, 128, 4, 256, 256, 128
    cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=ffn,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                            init_method_std=0.02, **dict(moe_kwargs(experts, "allgather", ffn), moe_router_topk=topk))
    gpt = GPTModel(cfg, get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False), vocab_size=vocab,
                   max_sequence_length=seq, position_embedding_type="rope").eval()
    with torch.no_grad():  # non-trivial norms and biases; replicated tensors equal on every rank, experts not
        shared, own = torch.Generator().manual_seed(100), torch.Generator().manual_seed(200 + rank)
        for n, p in gpt.named_parameters():
            g = own if ".local_experts." in n else shared
            p.add_(torch.randn(p.shape, generator=g) * (0.1 if p.dim() == 1 else 0.01))
    tensor_parallel.random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    names = ebt.expert_parallel_names([gpt])
    local = {names[n]: p.detach() for n, p in gpt.named_parameters() if n in names}
    full = ebt.full_weights([gpt])
    mine = MegatronGPT(ModelConfig(vocab=vocab, d_model=hidden, n_layers=layers, n_heads=heads, d_ff=ffn,
                                   max_seq=seq), moe=MoEConfig(experts, topk)).float()
    ours = dict(mine.named_parameters())
    out = {"local_experts": len(names), "full": len(full), "names_equal": sorted(ours) == sorted(full),
           "local_digests": digests(local), "digests": digests(full)}
    with torch.no_grad():
        for n, p in ours.items():
            p.copy_(full[n])
        B, T = 2, 24
        tok = torch.randint(vocab, (B, T), generator=torch.Generator().manual_seed(1))  # the same on every rank
        pos = torch.arange(T).unsqueeze(0).expand(B, -1)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1).view(1, 1, T, T)
        ref = gpt(tok, pos, mask).float()
        out["max_abs_diff"] = float((ref - mine(tok).float()).abs().max())
        out["max_abs_logit"] = float(ref.abs().max())
    # each rank's own engine gets the whole model through ebbtide.sync, the gather done by the weights callable
    from ebbtide.sync import HostReceiver, HostSender, Plan, Receiver, Sender, SharedHostBuffer, expected  # noqa: PLC0415

    plan = Plan.of({n: torch.empty(t.shape, dtype=torch.bfloat16, device="meta") for n, t in full.items()})
    src = lambda: {n: t.to(torch.bfloat16) for n, t in ebt.full_weights([gpt]).items()}  # noqa: E731
    buf = SharedHostBuffer.create(SharedHostBuffer.size_for(plan), pin=False)
    try:
        dst = {it.source: torch.zeros(it.shape, dtype=torch.bfloat16) for it in plan.items}
        Sender(src, HostSender(buf, keep_slots=False), plan=plan).push(1)
        HostReceiver(buf).receive(Receiver(dst, plan), 1)
        want = expected(plan, src())
        out["sent_equal"] = sorted(dst) == sorted(want) and all(torch.equal(dst[n], want[n]) for n in want)
        # ... and with the sender gathering the experts per bucket (small buckets: a layer's experts span several)
        small = Plan.of({n: torch.empty(t.shape, dtype=torch.bfloat16, device="meta")
                         for n, t in sorted(full.items())}, bucket_bytes=32 << 10)
        local = lambda: {n: p.detach().to(torch.bfloat16) for n, p in gpt.named_parameters()}  # noqa: E731
        sources = ebt.expert_sources([gpt])
        out["sources_match_names"] = all(sources[g] == (n, rank) for n, g in names.items())
        buf2 = SharedHostBuffer.create(SharedHostBuffer.size_for(small), pin=False)
        try:
            dst = {it.source: torch.zeros(it.shape, dtype=torch.bfloat16) for it in small.items}
            Sender(local, HostSender(buf2, keep_slots=False), plan=small, each_rank_sends=True,
                   ep_group=parallel_state.get_expert_model_parallel_group(), ep_sources=sources).push(1)
            HostReceiver(buf2).receive(Receiver(dst, small), 1)
            want = expected(small, src())
            out["buckets"] = len(small.buckets)
            out["sent_per_bucket_equal"] = all(torch.equal(dst[n], want[n]) for n in want)
        finally:
            buf2.close()
    finally:
        buf.close()
    return out


def tp_moe_weights(rank, world, init, experts=4):
    """A MoE GPT at TP=``world`` with whole experts (expert tensor parallel 1, what MoE with biases requires): the
    experts are not gathered over the TP group (Megatron marks them tensor-parallel all the same), the rest is."""
    import datetime  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415
    from megatron.core import parallel_state as ps  # noqa: PLC0415
    from megatron.core.models.gpt import GPTModel  # noqa: PLC0415
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: PLC0415
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: PLC0415
    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: PLC0415

    import ebbtide.integrations.megatron as ebt  # noqa: PLC0415
    from ebbtide.testing.spawn import join_store  # noqa: PLC0415
    from megatron_dist_workers import cpu_megatron, no_te_moe_fix  # noqa: PLC0415

    cpu_megatron()
    dist.init_process_group("gloo", store=join_store(init), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    ps.initialize_model_parallel(tensor_model_parallel_size=world, expert_tensor_parallel_size=1)
    no_te_moe_fix()
    torch.manual_seed(5)
    model_parallel_cuda_manual_seed(5)
    hidden, ffn = 128, 256
    cfg = TransformerConfig(num_layers=2, hidden_size=hidden, num_attention_heads=4, ffn_hidden_size=ffn,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                            init_method_std=0.02, num_moe_experts=experts, moe_router_topk=2,
                            moe_token_dispatcher_type="allgather", expert_tensor_parallel_size=1,
                            tensor_model_parallel_size=world,
                            sequence_parallel=False)
    gpt = GPTModel(cfg, get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False), vocab_size=256,
                   max_sequence_length=128, position_embedding_type="rope")
    dims = ebt.tensor_parallel_dims([gpt])
    full = ebt.full_weights([gpt])
    fc1 = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    return {"experts_in_dims": sorted(n for n in dims if ".mlp.experts." in n),
            "split": len(dims), "fc1_shape": list(full[fc1].shape), "want_fc1": [ffn, hidden],
            "qkv_rows": full["decoder.layers.0.self_attention.linear_qkv.weight"].shape[0], "want_qkv_rows": 3 * hidden,
            "experts": digests({n: t for n, t in full.items() if ".mlp.experts." in n})}
