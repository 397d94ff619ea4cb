"""Run by test_colocate_megatron_cpu.py in a fresh process: Megatron-core's GPTModel (local layer spec, fp32, CPU)
against the rollout's MegatronGPT holding the same weights. Megatron's forward asks for CUDA in three places that do
not matter on a CPU (the rotary table's device, the global memory buffer's device, the model-parallel RNG fork for
attention dropout, which is 0 here); this script points them at the CPU. An 8th argument EXPERTS (and a 9th, TOPK)
makes every MLP Megatron's MoE layer (local spec, SequentialMLP experts, the allgather dispatcher: the alltoall one
allocates on the GPU) against the rollout's ``MoEConfig``; a 10th, "fp32", sets Megatron's ``moe_router_dtype="fp32"``
against ``router_fp32``. Prints one JSON line."""
import contextlib
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ebbtide.testing.ports import free_port  # noqa: E402


def main():
    layers, hidden, heads, ffn, vocab, seq = (int(x) for x in sys.argv[1:7])
    experts = int(sys.argv[7]) if len(sys.argv) > 7 else 0
    topk = int(sys.argv[8]) if len(sys.argv) > 8 else 2
    fp32_router = len(sys.argv) > 9 and sys.argv[9] == "fp32"
    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ebbtide.integrations.names import served_names as megatron_names
    from ebbtide.testing.models import KVCache, MegatronGPT, ModelConfig, MoEConfig, greedy_decode

    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    moe = {}
    if experts:
        import megatron.core.transformer.moe.moe_utils as moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):  # megatron-core 0.16.1 without Transformer Engine
            moe_utils.te_general_gemm = None
        moe = dict(num_moe_experts=experts, moe_router_topk=topk, moe_token_dispatcher_type="allgather")
        if fp32_router:
            moe["moe_router_dtype"] = "fp32"
    cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=ffn,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                            init_method_std=0.02, **moe)
    spec = get_gpt_layer_local_spec(num_experts=experts or None, moe_grouped_gemm=False)
    gpt = GPTModel(cfg, spec, vocab_size=vocab, max_sequence_length=seq, position_embedding_type="rope").eval()
    with torch.no_grad():  # non-trivial norms and biases, so a swapped one shows
        for n, p in gpt.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    torch.cuda.current_device = lambda: "cpu"
    tensor_parallel.random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()

    mine = MegatronGPT(ModelConfig(vocab=vocab, d_model=hidden, n_layers=layers, n_heads=heads, d_ff=ffn,
                                   max_seq=seq), moe=MoEConfig(experts, topk, fp32_router) if experts else None).float()
    theirs = megatron_names(gpt.named_parameters())
    ours = dict(mine.named_parameters())
    out = {"names_equal": sorted(theirs) == sorted(ours),
           "only_megatron": sorted(set(theirs) - set(ours))[:5], "only_ours": sorted(set(ours) - set(theirs))[:5]}
    from ebbtide.bench.colocate.sync import megatron_plan

    # the plan each side builds from its own model (bf16, as trained and served) must be the same one
    bf16 = lambda named: {n: torch.empty(t.shape, dtype=torch.bfloat16) for n, t in named.items()}  # noqa: E731
    out["plan_equal"] = megatron_plan(bf16(theirs)).signature == megatron_plan(bf16(ours)).signature
    out["order_equal"] = list(theirs) == list(ours)
    with torch.no_grad():
        for n, p in ours.items():
            p.copy_(theirs[n])
        B, T = 2, seq // 2
        tok = torch.randint(vocab, (B, T), generator=torch.Generator().manual_seed(1))
        pos = torch.arange(T).unsqueeze(0).expand(B, -1)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1).view(1, 1, T, T)
        ref = gpt(tok, pos, mask).float()
        got = mine(tok).float()
        out["max_abs_diff"] = float((ref - got).abs().max())
        out["max_abs_logit"] = float(ref.abs().max())
        cache = KVCache(mine.cfg, B, T, device="cpu", dtype=torch.float32)
        seq_c, last_c = greedy_decode(mine, tok[:, :T // 2], T - T // 2, cache)
        full = gpt(seq_c[:, :-1], pos[:, :T - 1], mask[..., :T - 1, :T - 1]).float()[:, -1]
        out["decode_vs_megatron_max_abs"] = float((full - last_c).abs().max())
        if experts:  # the routing matters: one expert more per token must not match
            for layer in mine.decoder.layers:
                layer.mlp.topk = min(topk + 1, experts) if topk < experts else topk - 1
            out["other_topk_max_abs_diff"] = float((ref - mine(tok).float()).abs().max())
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
