"""Small named-tensor sets shaped like a served checkpoint, shared by the sync tests."""
import torch


def checkpoint(seed: int = 0, device="cpu") -> dict:
    """FP8 linears (one ragged), a stacked MoE weight, an INT4 (QAT) linear, norms and an embedding (raw)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16).to(device)

    return {
        "model.embed_tokens.weight": r(96, 128),
        "model.layers.0.input_layernorm.weight": r(256),
        "model.layers.0.self_attn.qkv_proj.weight": r(384, 256),
        "model.layers.0.self_attn.o_proj.weight": r(256, 256),
        "model.layers.0.mlp.experts.w13_weight": r(4, 256, 256),
        "model.layers.0.mlp.gate.weight": r(4, 256),
        "model.layers.1.mlp.down_proj.weight": r(200, 300),
        "model.layers.1.qat.down_proj.weight": r(128, 256),
        "lm_head.weight": r(96, 256),
    }


RULES = [(r"qat\.", "int4"), (r"experts\.w13_weight$", "fp8")]
