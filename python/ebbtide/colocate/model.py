"""A small decoder-only transformer in plain PyTorch, with a preallocated KV cache and greedy decode.

Policies:
- Random init from a seed, no downloads. Every weight is a 2-D or 1-D parameter (no buffers), so the weight sync
  moves ``named_parameters()`` and nothing else: 2-D weights travel FP8 block-quantized, 1-D (norm gains) as bf16.
- Learned position embeddings (a parameter) instead of rotary tables, for the same reason.
- Every matrix dimension is a multiple of 128 (``ModelConfig.validate``), so the FP8 128x128 blocks tile exactly
  and the torch-formula anchor (which pads) produces the same layout as ebbtide's kernel.
- ``forward(tokens, cache=None, start=0)``: without a cache a causal full-sequence forward; with one, the new
  tokens' keys/values are written at ``[start, start + T)`` and queries attend to ``[0, start + T)`` (causal within
  the new tokens). Decode with the cache equals the full forward up to float reordering (tests/colocate).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidArgumentError

__all__ = ["ModelConfig", "TinyLM", "KVCache", "greedy_decode", "QUANT_BLOCK"]

QUANT_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int = 16384
    d_model: int = 1536
    n_layers: int = 12
    n_heads: int = 12
    d_ff: int = 6144
    max_seq: int = 1024

    def validate(self) -> "ModelConfig":
        for name in ("vocab", "d_model", "n_layers", "n_heads", "d_ff", "max_seq"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidArgumentError(f"model {name} must be a positive int, got {v!r}")
        for name in ("vocab", "d_model", "d_ff", "max_seq"):
            if getattr(self, name) % QUANT_BLOCK:
                raise InvalidArgumentError(f"model {name}={getattr(self, name)} must be a multiple of {QUANT_BLOCK} "
                                           f"(FP8 128x128 blocks tile every weight exactly)")
        if self.d_model % self.n_heads:
            raise InvalidArgumentError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        return self

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def n_params(self) -> int:
        d, f, L = self.d_model, self.d_ff, self.n_layers
        per_layer = 4 * d * d + 2 * d * f + 2 * d
        return 2 * self.vocab * d + self.max_seq * d + L * per_layer + d


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight


class KVCache:
    """Keys and values for every layer, preallocated: k, v of shape [layers, batch, heads, max_len, head_dim]."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, *, device, dtype):
        if max_len > cfg.max_seq:
            raise InvalidArgumentError(f"KV cache length {max_len} exceeds the model's max_seq {cfg.max_seq}")
        shape = (cfg.n_layers, batch, cfg.n_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.batch, self.max_len = batch, max_len

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.norm1 = RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.norm2 = RMSNorm(d)
        self.up = nn.Linear(d, cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, d, bias=False)

    def forward(self, x, layer: int, cache: KVCache | None, start: int):
        B, T, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if cache is None:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            cache.k[layer, :B, :, start:start + T] = k
            cache.v[layer, :B, :, start:start + T] = v
            keys, vals = cache.k[layer, :B, :, :start + T], cache.v[layer, :B, :, :start + T]
            if T == 1:
                a = F.scaled_dot_product_attention(q, keys, vals)
            else:  # query i (absolute start + i) sees keys [0, start + i]
                qpos = torch.arange(start, start + T, device=x.device)[:, None]
                mask = torch.arange(start + T, device=x.device)[None, :] <= qpos
                a = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))


class TinyLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg.validate()
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    @classmethod
    def random(cls, cfg: ModelConfig, *, seed: int, device="cpu", dtype=torch.bfloat16) -> "TinyLM":
        """Initialized on ``device`` from ``seed`` (same seed, same device kind: same weights)."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        with torch.device("meta"):
            m = cls(cfg)
        # filled on the CPU in the final dtype, then moved: the device sees one allocation per weight, no fp32
        # temporaries (a freed temporary would stay cached in a pausable region's pool)
        m = m.to_empty(device="cpu").to(dtype)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if p.dim() == 1:
                    p.fill_(1.0)
                else:
                    std = 0.02 if "embed" in name or "pos" in name else 1.0 / math.sqrt(p.shape[1])
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
        return m.to(device)

    def forward(self, tokens, cache: KVCache | None = None, start: int = 0):
        T = tokens.shape[1]
        if start + T > self.cfg.max_seq:
            raise InvalidArgumentError(f"positions up to {start + T} exceed max_seq {self.cfg.max_seq}")
        x = self.embed(tokens) + self.pos(torch.arange(start, start + T, device=tokens.device))
        for i, blk in enumerate(self.blocks):
            x = blk(x, i, cache, start)
        return self.head(self.norm(x))

    def loss(self, tokens):
        """Next-token cross entropy over a batch [B, T] (fp32 loss)."""
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


@torch.no_grad()
def greedy_decode(model: TinyLM, prompt: torch.Tensor, new_tokens: int, cache: KVCache | None = None):
    """Greedy generation of ``new_tokens`` after ``prompt`` [B, P]. With a cache: one prefill, then one token per
    forward. Without: the full sequence is recomputed every token (the reference). Returns (tokens [B, P + n],
    logits of the last position [B, vocab], fp32)."""
    B, P = prompt.shape
    if new_tokens < 1:
        raise InvalidArgumentError(f"new_tokens must be >= 1, got {new_tokens}")
    if cache is not None and (cache.batch < B or cache.max_len < P + new_tokens):
        raise InvalidArgumentError(f"KV cache ({cache.batch} x {cache.max_len}) is too small for batch {B} and "
                                   f"{P} + {new_tokens} tokens")
    seq = prompt
    logits = model(prompt, cache, 0) if cache is not None else model(prompt)
    for i in range(new_tokens):
        nxt = logits[:, -1].float().argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
        if i == new_tokens - 1:
            break
        logits = model(nxt, cache, P + i) if cache is not None else model(seq)
    return seq, logits[:, -1].float()
