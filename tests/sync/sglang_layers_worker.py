"""SGLang's own layers behind ebbtide's loader (``main(tp_size, tp_rank, updates, form)``, run in its own process by
``ebbtide.testing.spawn.call``; form one of bf16 / fp8 / fp8-ue8m0; returns a dict). The model is
``ebbtide.testing.scenarios.sglang_served``: SGLang 0.5.23's ``QKVParallelLinear``, ``MergedColumnParallelLinear``,
``RowParallelLinear``, ``ReplicatedLinear`` and ``FusedMoE`` (unquantized, or FP8 128x128 block with
``weight_scale_inv``) with their own ``weight_loader``s and SGLang's own ``Qwen3MoeForCausalLM.load_weights``,
built on the CPU (TP simulated by the published rank: no process group). One dense and one MoE layer; every update
goes through ebbtide's loader into one model and through SGLang's own path (the flattened-bucket request slime
sends) into another, and the two must hold the same bits."""
import torch

H, Q, KV, I, E = 256, 2048, 256, 2048, 4  # TP=2 shards keep whole FP8 blocks and rows of 8+ scales


def specs() -> list:
    out = [("model.embed_tokens.weight", (512, H))]
    for i in range(2):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (H,)), (p + "self_attn.q_proj.weight", (Q, H)),
                (p + "self_attn.k_proj.weight", (KV, H)), (p + "self_attn.v_proj.weight", (KV, H)),
                (p + "self_attn.o_proj.weight", (H, Q)), (p + "post_attention_layernorm.weight", (H,))]
        if i == 0:
            out += [(p + "mlp.gate_proj.weight", (I, H)), (p + "mlp.up_proj.weight", (I, H)),
                    (p + "mlp.down_proj.weight", (H, I))]
        else:
            out.append((p + "mlp.gate.weight", (E, H)))
            for e in range(E):
                q = f"{p}mlp.experts.{e}."
                out += [(q + "gate_proj.weight", (I, H)), (q + "up_proj.weight", (I, H)),
                        (q + "down_proj.weight", (H, I))]
    return out + [("model.norm.weight", (H,)), ("lm_head.weight", (512, H))]


def checkpoint(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(*s, generator=g).to(torch.bfloat16) for n, s in specs()}


def main(tp_size: int, tp_rank: int, updates: int, form: str) -> dict:
    from multiprocessing.reduction import ForkingPickler

    from ebbtide.testing.bits import same_bits
    from ebbtide.testing.scenarios import sglang_served as served

    served.prepare(tp_size, tp_rank)
    from ebbtide.integrations import sglang as S
    from ebbtide.integrations.sglang import loader as L
    from ebbtide.sync import Plan, fill_bucket

    fp8 = form.startswith("fp8")
    plan = Plan.build([(n, s, torch.bfloat16) for n, s in specs()], default="fp8" if fp8 else "raw",
                      scale="ue8m0" if form == "fp8-ue8m0" else "fp32", bucket_bytes=1_000_000)
    model, ref = served.build(specs(), fp8=fp8), served.build(specs(), fp8=fp8)
    for v in range(updates):
        src = checkpoint(v)
        for b in plan.buckets:
            buf = torch.empty(b.nbytes, dtype=torch.uint8)
            fill_bucket(plan, b, src, buf)
            req = S.tensor_request(b, buf, form="ebbtide", weight_version=v, signature=plan.signature,
                                   buckets=len(plan.buckets))
            L.load_weights(model, ForkingPickler.loads(req["serialized_named_tensors"][0]))  # SGLang's call
            ref.load_weights(served.flattened_request(b, buf))  # SGLang's own path for slime's flattened-bucket request
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            if not same_bits(p, q):
                return {"ok": False, "why": f"update {v}: {n} differs from SGLang's own placement"}
    st = L.state(model)
    return {"ok": True, "recorded": st.recorded, "replayed": st.replayed, "buckets": len(plan.buckets),
            "fallback": sorted({n for r in st.records.values() for n in r.fallback}),
            "segments": sum(len(r.dst) for r in st.records.values()),
            "kinds": sorted({it.kind for it in plan.items}),
            "params": {n: [list(p.shape), str(p.dtype)] for n, p in model.named_parameters()}}

