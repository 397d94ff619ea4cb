"""The rollout's model for the Megatron loop: Megatron-core's GPT from its local (non-Transformer-Engine) layer spec,
written again in plain PyTorch for inference (KV cache, greedy decode, a static decode step for CUDA graphs), as a
serving engine implements the trainer's architecture.

Policies:
- Same architecture and the same parameter names and shapes as Megatron's ``GPTModel`` built by
  ``get_gpt_layer_local_spec()`` with the example's settings (``ModelConfig``): word embeddings, rotary positions
  (base 10000, all channels, not interleaved), pre-norm LayerNorm with bias (eps 1e-5), fused QKV whose rows are
  grouped per head as [q, k, v], attention scaled by 1/sqrt(head_dim), output projection, MLP fc1 -> exact GELU ->
  fc2, every linear with a bias, a final LayerNorm and an untied output layer without bias. The trainer's names are
  Megatron's with the ``module.`` prefixes of DDP and Float16Module removed (``megatron_names``): nothing else is
  renamed, so the weight sync is the identity on names.
- Parameters only, no buffers: the rotary tables are computed in each forward (a few tiny kernels), so a pause that
  discards the weights region loses nothing the sync does not rewrite.
- ``forward(tokens, cache=None, start=0)`` and ``decode_step(token, pos, cache)`` have the interface of
  ``model.TinyLM``, so ``greedy_decode``, ``KVCache`` and ``GraphDecoder`` serve both models.
- The equality with Megatron's own forward on the same weights is tested on the CPU (fp32) and checked on every
  verified step of the loop on the GPU (bf16, the trainer's Megatron forward against the rollout's logits).
- MoE (``MegatronGPT(cfg, moe=MoEConfig(experts, topk))``): every layer's MLP is Megatron's MoE layer from the local
  spec without grouped GEMM: a router (``mlp.router``: weight [experts, d_model] and bias) whose top-k logits are
  softmaxed in fp32 (Megatron's defaults: no pre-softmax, no scaling, no capacity, no shared experts) and
  ``mlp.experts.local_experts.{e}`` MLPs of ``d_ff`` under the names of an expert-parallel size of 1 (the whole
  model, as a serving engine holds it). Every expert runs on every token and the top-k weights select: static
  shapes for the CUDA-graph decode, and at a decode batch most experts are read anyway. ``router_fp32`` follows
  ``moe_router_dtype="fp32"`` (the Megatron loop's setting): logits, top-k and softmax in fp32 as Megatron computes
  them, so a near-tie between two experts is decided as the trainer decides it more often than in bf16. The
  weighted sum is p * (fc2(act) + bias) accumulated in fp32 here; Megatron scales the activation and the bias by p
  in bf16 and sums the top-k outputs in bf16: the same math, other roundings.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidArgumentError
from ..integrations.names import served_names as megatron_names
from .model import KVCache, ModelConfig

__all__ = ["MegatronGPT", "MoEConfig", "megatron_names", "ROPE_BASE", "LN_EPS"]

ROPE_BASE = 10000.0
LN_EPS = 1e-5


class _LayerNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, LN_EPS)


class _Linear(nn.Module):
    def __init__(self, d_in: int, d_out: int, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


def _rope(pos: torch.Tensor, head_dim: int, dtype):
    """cos, sin of shape [T, head_dim] for positions ``pos`` [T] (Megatron: fp32 freqs, cast to the activations)."""
    inv = 1.0 / (ROPE_BASE ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=pos.device) / head_dim))
    f = pos.float()[:, None] * inv[None, :]
    emb = torch.cat((f, f), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _apply_rope(t, cos, sin):
    x1, x2 = t.chunk(2, dim=-1)
    return t * cos + torch.cat((-x2, x1), dim=-1) * sin


class _Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.linear_qkv = _Linear(d, 3 * d)
        self.linear_proj = _Linear(d, d)

    def qkv(self, x, cos, sin):
        B, T, _ = x.shape
        q, k, v = self.linear_qkv(x).view(B, T, self.n_heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        return _apply_rope(q, cos, sin), _apply_rope(k, cos, sin), v

    def out(self, a):
        B, H, T, hd = a.shape
        return self.linear_proj(a.transpose(1, 2).reshape(B, T, H * hd))


class _MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.linear_fc1 = _Linear(cfg.d_model, cfg.d_ff)
        self.linear_fc2 = _Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x):
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Megatron's MoE MLP in every layer: ``experts`` experts (Megatron's ``num_moe_experts``), ``topk`` of them per
    token (``moe_router_topk``); ``router_fp32``: the router's logits, top-k and weights in fp32
    (``moe_router_dtype="fp32"``) and the experts' weighted sum accumulated in fp32, else both in the activations'
    dtype."""
    experts: int
    topk: int = 2
    router_fp32: bool = False

    def validate(self) -> "MoEConfig":
        for name in ("experts", "topk"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidArgumentError(f"moe {name} must be a positive int, got {v!r}")
        if self.experts < 2 or self.topk > self.experts:
            raise InvalidArgumentError(f"moe needs 2+ experts and topk <= experts, got experts={self.experts}, "
                                       f"topk={self.topk}")
        return self


class _Router(nn.Module):
    def __init__(self, d: int, experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, d))
        self.bias = nn.Parameter(torch.zeros(experts))


class _Experts(nn.Module):
    def __init__(self, cfg: ModelConfig, experts: int):
        super().__init__()
        self.local_experts = nn.ModuleList(_MLP(cfg) for _ in range(experts))


class _MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: MoEConfig):
        super().__init__()
        self.topk, self.fp32 = moe.topk, moe.router_fp32
        self.router = _Router(cfg.d_model, moe.experts)
        self.experts = _Experts(cfg, moe.experts)

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])
        w, b = self.router.weight, self.router.bias
        if self.fp32:
            logits = F.linear(h.float(), w.float(), b.float())  # [tokens, experts]
        else:
            logits = F.linear(h, w, b)  # in the activations' dtype
        top, idx = torch.topk(logits, self.topk, dim=-1)
        weight = torch.zeros_like(logits).scatter(1, idx, torch.softmax(top, dim=-1, dtype=torch.float32)
                                                  .to(logits.dtype))
        out = torch.zeros(h.shape, dtype=weight.dtype, device=h.device)  # fp32 with the fp32 router
        for e, mlp in enumerate(self.experts.local_experts):
            out = out + weight[:, e:e + 1] * mlp(h)
        return out.to(x.dtype).view(x.shape)


class _Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: MoEConfig | None = None):
        super().__init__()
        self.input_layernorm = _LayerNorm(cfg.d_model)
        self.self_attention = _Attention(cfg)
        self.pre_mlp_layernorm = _LayerNorm(cfg.d_model)
        self.mlp = _MoE(cfg, moe) if moe is not None else _MLP(cfg)

    def _finish(self, x, a):
        x = x + self.self_attention.out(a)
        return x + self.mlp(self.pre_mlp_layernorm(x))

    def forward(self, x, layer: int, cache: KVCache | None, start: int, cos, sin):
        q, k, v = self.self_attention.qkv(self.input_layernorm(x), cos, sin)
        if cache is None:
            return self._finish(x, F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return self._finish(x, cache.attend(q, k, v, layer, start))

    def step(self, x, layer: int, cache: KVCache, pos, mask, cos, sin):
        q, k, v = self.self_attention.qkv(self.input_layernorm(x), cos, sin)
        return self._finish(x, cache.attend_step(q, k, v, layer, pos, mask))


class _Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab, cfg.d_model)


class _Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: MoEConfig | None):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(cfg, moe) for _ in range(cfg.n_layers))
        self.final_layernorm = _LayerNorm(cfg.d_model)


class MegatronGPT(nn.Module):
    """Megatron-core's local-spec GPT for inference (see the module policies)."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig | None = None):
        super().__init__()
        self.cfg = cfg.validate()
        self.moe = moe.validate() if moe is not None else None
        self.embedding = _Embedding(cfg)
        self.decoder = _Decoder(cfg, self.moe)
        self.output_layer = _Linear(cfg.d_model, cfg.vocab, bias=False)

    @classmethod
    def random(cls, cfg: ModelConfig, *, seed: int, device="cpu", dtype=torch.bfloat16,
               moe: MoEConfig | None = None) -> "MegatronGPT":
        """Allocated on ``device`` in the final dtype (one allocation per tensor, no temporaries) and filled there from
        ``seed`` (the rollout's initial weights only need to differ from the trainer's: every sync rewrites them)."""
        device = torch.device(device)
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.device("meta"):
            m = cls(cfg, moe).to(dtype)
        m = m.to_empty(device=device)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith("layernorm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02, generator=gen)
        return m

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens, cache: KVCache | None = None, start: int = 0):
        T = tokens.shape[1]
        if start + T > self.cfg.max_seq:
            raise InvalidArgumentError(f"positions up to {start + T} exceed max_seq {self.cfg.max_seq}")
        x = self.embedding.word_embeddings(tokens)
        cos, sin = _rope(torch.arange(start, start + T, device=tokens.device), self.cfg.head_dim, x.dtype)
        for i, layer in enumerate(self.decoder.layers):
            x = layer(x, i, cache, start, cos, sin)
        return self.output_layer(self.decoder.final_layernorm(x))

    def decode_step(self, token, pos, cache: KVCache):
        """One static-shape decode step (as ``TinyLM.decode_step``): capturable in a CUDA graph."""
        x = self.embedding.word_embeddings(token)
        cos, sin = _rope(pos, self.cfg.head_dim, x.dtype)
        mask = (torch.arange(cache.max_len, device=pos.device) <= pos).view(1, 1, 1, cache.max_len)
        for i, layer in enumerate(self.decoder.layers):
            x = layer.step(x, i, cache, pos, mask, cos, sin)
        return self.output_layer(self.decoder.final_layernorm(x))[:, -1]
