"""The models the bench and the tests build: a small decoder-only transformer in plain PyTorch (``TinyLM``) and
Megatron-core's local-spec GPT written again for inference (``MegatronGPT``, dense or MoE), with a preallocated KV
cache, greedy decode and a decode step replayed from a CUDA graph (``GraphDecoder``) serving both.

Policies:
- Random init from a seed, no downloads. Every weight is a 2-D or 1-D parameter (no buffers), so a weight sync
  moves ``named_parameters()`` and nothing else: 2-D weights travel FP8 block-quantized, 1-D (norm gains, biases)
  as bf16. ``TinyLM`` learns its positions (a parameter); ``MegatronGPT`` computes its rotary tables in each forward
  (a few tiny kernels), so a pause that discards the weights region loses nothing the sync does not rewrite.
- Every matrix dimension is a multiple of 128 (``ModelConfig.validate``), so the FP8 128x128 blocks tile exactly
  and the torch-formula anchor (which pads) produces the same layout as ebbtide's kernel.
- ``forward(tokens, cache=None, start=0)``: without a cache a causal full-sequence forward; with one, the new
  tokens' keys/values are written at ``[start, start + T)`` and queries attend to ``[0, start + T)`` (causal within
  the new tokens). Decode with the cache equals the full forward up to float reordering (tests/colocate).
  ``decode_step(token, pos, cache)``: one static-shape step, capturable in a CUDA graph.
- ``MegatronGPT``: the same architecture and the same parameter names and shapes as Megatron's ``GPTModel`` built
  by ``get_gpt_layer_local_spec()`` with these settings (``ModelConfig``): word embeddings, rotary positions (base
  10000, all channels, not interleaved), pre-norm LayerNorm with bias (eps 1e-5), fused QKV whose rows are grouped
  per head as [q, k, v], attention scaled by 1/sqrt(head_dim), output projection, MLP fc1 -> exact GELU -> fc2,
  every linear with a bias, a final LayerNorm and an untied output layer without bias. The trainer's names are
  Megatron's with the ``module.`` prefixes of DDP and Float16Module removed (``ebbtide.integrations.names.
  served_names``): nothing else is renamed, so a weight sync is the identity on names. The equality with
  Megatron's own forward on the same weights is tested on the CPU (fp32) and checked on every verified step of the
  colocated loop on the GPU (bf16).
- MoE (``MegatronGPT(cfg, moe=MoEConfig(experts, topk))``): every layer's MLP is Megatron's MoE layer from the local
  spec without grouped GEMM: a router (``mlp.router``: weight [experts, d_model] and bias) whose top-k logits are
  softmaxed in fp32 (Megatron's defaults: no pre-softmax, no scaling, no capacity, no shared experts) and
  ``mlp.experts.local_experts.{e}`` MLPs of ``d_ff`` under the names of an expert-parallel size of 1 (the whole
  model, as a serving engine holds it). Every expert runs on every token and the top-k weights select: static
  shapes for the CUDA-graph decode, and at a decode batch most experts are read anyway. ``router_fp32`` follows
  ``moe_router_dtype="fp32"``: logits, top-k and softmax in fp32 as Megatron computes them, so a near-tie between
  two experts is decided as the trainer decides it more often than in bf16. The weighted sum is p * (fc2(act) +
  bias) accumulated in fp32 here; Megatron scales the activation and the bias by p in bf16 and sums the top-k
  outputs in bf16: the same math, other roundings.
"""
from __future__ import annotations

import dataclasses
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidArgumentError, UnsupportedError

__all__ = ["ModelConfig", "TinyLM", "KVCache", "greedy_decode", "GraphDecoder", "QUANT_BLOCK", "MegatronGPT",
           "MoEConfig", "ROPE_BASE", "LN_EPS"]

QUANT_BLOCK = 128
ROPE_BASE = 10000.0  # MegatronGPT's rotary base and LayerNorm eps (Megatron's defaults)
LN_EPS = 1e-5


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

    def attend(self, q, k, v, layer: int, start: int):
        """Write k/v ([B, H, T, hd]) at positions [start, start + T) of ``layer`` and attend q over the keys so
        far: query i (absolute start + i) sees keys [0, start + i]."""
        B, T = q.shape[0], q.shape[2]
        self.k[layer, :B, :, start:start + T] = k
        self.v[layer, :B, :, start:start + T] = v
        keys, vals = self.k[layer, :B, :, :start + T], self.v[layer, :B, :, :start + T]
        if T == 1:  # the one new query sees every key
            return F.scaled_dot_product_attention(q, keys, vals)
        qpos = torch.arange(start, start + T, device=q.device)[:, None]
        mask = torch.arange(start + T, device=q.device)[None, :] <= qpos
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)

    def attend_step(self, q, k, v, layer: int, pos, mask):
        """Static-shape decode (q, k, v [B, H, 1, hd]): k/v written at device position ``pos`` ([1] long),
        attention over the whole cache under ``mask`` ([1, 1, 1, max_len] bool)."""
        B = q.shape[0]
        keys, vals = self.k[layer, :B], self.v[layer, :B]  # views of fixed shape [B, H, max_len, hd]
        keys.index_copy_(2, pos, k)
        vals.index_copy_(2, pos, v)
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)


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

    def _qkv(self, x):
        B, T, _ = x.shape
        return self.qkv(self.norm1(x)).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)

    def _out(self, x, a):
        B, T, D = x.shape
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))

    def forward(self, x, layer: int, cache: KVCache | None, start: int):
        q, k, v = self._qkv(x)
        if cache is None:
            return self._out(x, F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return self._out(x, cache.attend(q, k, v, layer, start))

    def step(self, x, layer: int, cache: KVCache, pos, mask):
        """Static-shape decode (x [B, 1, D]); see ``KVCache.attend_step``."""
        return self._out(x, cache.attend_step(*self._qkv(x), layer, pos, mask))


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

    def decode_step(self, token, pos, cache: KVCache):
        """One static-shape decode step: ``token`` [B, 1] long, ``pos`` [1] long on the device (where this token
        goes; the caller keeps it < cache.max_len), ``cache.batch >= B``. Returns logits [B, vocab] (model dtype).
        No shape, and no Python value, depends on the position: capturable in a CUDA graph."""
        x = self.embed(token) + self.pos(pos)
        keep = torch.arange(cache.max_len, device=pos.device) <= pos
        mask = keep.view(1, 1, 1, cache.max_len)
        for i, blk in enumerate(self.blocks):
            x = blk.step(x, i, cache, pos, mask)
        return self.head(self.norm(x))[:, -1]

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


class GraphDecoder:
    """Greedy decode whose per-token step is a replayed CUDA graph (what rollout engines do; the eager loop is
    bound by kernel launches for small models).

    One step is the model's ``decode_step`` and the greedy feedback together: argmax of the logits, the token
    written into the decoder's static sequence and fed back, the position advanced, all on the device. So a step
    costs the host one graph launch, and nothing the host does between steps can delay the device.

    ``GraphDecoder(model, cache, batch)`` allocates its static buffers (token [batch, 1], position [1], sequence
    [batch, cache.max_len]) where it is constructed: build it inside the region that should own them. The first
    ``generate`` captures one step into a graph inside ``graph_context(graph, stream)`` (default
    ``torch.cuda.graph(graph, stream=stream)``; pass e.g. ``lambda g, s: ebbtide.memory.graph(g, tag=...,
    backup="none", stream=s)`` to make the graph's private memory pausable); every later decode step is
    ``replay()``. The graph bakes in the addresses of the weights, the cache and the static buffers: they must stay
    where they are (pause/resume that maps memory back at the same addresses is fine; reallocating them is not).
    ``capture=False`` runs the same step eagerly (the CPU path and the tests).
    """

    def __init__(self, model: TinyLM, cache: KVCache, batch: int, *, capture: bool | None = None,
                 graph_context=None):
        dev = cache.k.device
        if not isinstance(batch, int) or isinstance(batch, bool) or not 1 <= batch <= cache.batch:
            raise InvalidArgumentError(f"batch must be an int in [1, {cache.batch}] (the cache's batch), got {batch!r}")
        if capture is None:
            capture = dev.type == "cuda"
        if capture and dev.type != "cuda":
            raise UnsupportedError(f"CUDA-graph capture needs the cache on a CUDA device, not {dev}")
        self.model, self.cache, self.batch, self.capture = model, cache, batch, bool(capture)
        self.graph_context = graph_context
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.seq = torch.zeros(batch, cache.max_len, dtype=torch.long, device=dev)
        self.graph = self.stream = None
        self.logits = None  # the graph's static output
        self.graph_bytes = None  # memory the capture added to torch's reserved pools (device; None before)

    @property
    def mode(self) -> str:
        return "cuda-graph" if self.capture else "static-eager"

    def _body(self):
        """One decode step at ``pos`` with ``token``; the greedy choice goes to ``seq[:, pos + 1]`` and becomes the
        next ``token``; ``pos`` advances. Returns the step's logits [B, vocab] (model dtype)."""
        logits = self.model.decode_step(self.token, self.pos, self.cache)
        nxt = logits.float().argmax(-1, keepdim=True)
        self.seq.index_copy_(1, self.pos + 1, nxt)
        self.token.copy_(nxt)
        self.pos.add_(1)
        return logits

    def _capture(self):
        dev = self.cache.k.device
        # warm-up on the stream the capture will use, outside the capture: lazy inits (the cuBLAS handle and
        # workspace of that stream, kernel selection and loading) happen here, in ordinary memory, not in the
        # graph's pool. The body advances the decoder's state: it is put back after each run, so both runs step
        # from the same position, whose sequence slot pos + 1 exists whenever a step runs (the k/v they write at
        # pos is rewritten by the real step before anything attends to it).
        saved = (self.token.clone(), self.pos.clone(), self.seq.clone())
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._body()
                for buf, old in zip((self.token, self.pos, self.seq), saved):
                    buf.copy_(old)
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        del saved
        torch.cuda.empty_cache()  # torch.cuda.graph empties it too: measure the capture alone
        before = torch.cuda.memory_reserved(dev)
        g = torch.cuda.CUDAGraph()
        ctx = (self.graph_context(g, side) if self.graph_context is not None
               else torch.cuda.graph(g, stream=side))
        with ctx:
            self.logits = self._body()
        torch.cuda.synchronize(dev)
        self.graph_bytes = torch.cuda.memory_reserved(dev) - before
        self.graph, self.stream = g, side  # the stream stays: torch keys the cuBLAS workspace the graph uses by it

    def _step(self):
        if not self.capture:
            return self._body()
        if self.graph is None:
            self._capture()  # not run by the capture: the replay below computes this step
        self.graph.replay()
        return self.logits

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, new_tokens: int, events: dict | None = None):
        """As ``greedy_decode(model, prompt, new_tokens, cache)``: returns (tokens [B, P + n], logits of the last
        position [B, vocab], fp32). ``prompt`` must have exactly ``batch`` rows. ``events`` (a dict, CUDA only): CUDA
        events recorded on the current stream at "start", "prefilled" (after the eager prefill) and "end", and
        ``prefill_host_s`` / ``host_enqueue_s`` (host seconds until the prefill / the last step was launched), so the
        caller can split the generation's device time from its host time."""
        B, P = prompt.shape
        if B != self.batch:
            raise InvalidArgumentError(f"prompt batch {B} != the decoder's static batch {self.batch}")
        if not isinstance(new_tokens, int) or new_tokens < 1:
            raise InvalidArgumentError(f"new_tokens must be >= 1, got {new_tokens!r}")
        if P + new_tokens > self.cache.max_len:
            raise InvalidArgumentError(f"KV cache ({self.cache.max_len} positions) is too small for {P} + "
                                       f"{new_tokens} tokens")
        timed = events is not None and prompt.is_cuda
        t0 = time.perf_counter()

        def mark(name):
            if timed:
                events[name] = torch.cuda.current_stream().record_event(torch.cuda.Event(enable_timing=True))

        mark("start")
        logits = self.model(prompt, self.cache, 0)[:, -1].float()  # eager prefill
        # masked positions still enter the attention products: make them finite (a resumed cache is undefined)
        self.cache.k[:, :B, :, P:].zero_()
        self.cache.v[:, :B, :, P:].zero_()
        nxt = logits.argmax(-1, keepdim=True)
        self.seq[:, :P] = prompt
        self.seq[:, P:P + 1] = nxt
        self.token.copy_(nxt)
        self.pos.fill_(P)
        mark("prefilled")
        if timed:
            events["prefill_host_s"] = time.perf_counter() - t0
        for _ in range(new_tokens - 1):
            logits = self._step()
        mark("end")
        if timed:
            events["host_enqueue_s"] = time.perf_counter() - t0
        # the static logits are overwritten by the next replay and discarded by a pause of their tag: a copy
        return self.seq[:, :P + new_tokens].clone(), logits.float().clone()


# ---- Megatron-core's local-spec GPT, for inference ----------------------------------------------------
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
    """Megatron-core's local-spec GPT for inference (see the module policies: ``MegatronGPT``, MoE)."""

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
