"""transformers' Qwen3 (``Qwen3ForCausalLM``) from a ``ModelConfig`` with random weights, nothing downloaded: the
model the FSDP2 loop trains under ``fully_shard`` and, as ``Qwen3LM``, the one its rollout serves (the same
architecture under the same names, what an HF checkpoint and SGLang's loaders use).

Policies:
- Shape (``config``): ``d_model`` hidden, ``d_ff`` intermediate, ``n_layers`` layers of ``n_heads`` attention heads
  of ``head_dim = d_model / n_heads`` and ``n_heads / 2`` KV heads (grouped-query, as Qwen3's), tied embeddings (as
  Qwen3 up to 4B), ``max_seq`` positions, transformers' defaults otherwise (RMSNorm with q/k norms, SiLU MLP, rotary
  base 1e6, sdpa attention). ``ModelConfig(vocab=151936, d_model=2048, n_layers=28, n_heads=16, d_ff=6144)`` is
  Qwen3-1.7B (1.72 B parameters).
- ``build(cfg, seed=, device=, dtype=)``: transformers' own random init under ``torch.manual_seed(seed)``, made
  on ``device`` in ``dtype`` (the default dtype while it is built: no copy in another dtype is ever allocated, which
  on a GPU would stay cached in the region the weights are built in); the rotary ``inv_freq`` is computed in fp32
  whatever the default, as it is under FSDP's ``MixedPrecisionPolicy``.
- ``Qwen3LM(model)``: the rollout's view of the HF model, with the harness's model interface: ``forward(tokens,
  cache=None, start=0)`` returns the logits of the last position only (``[B, 1, vocab]``: every caller reads
  ``[:, -1]``, and a prompt's logits over Qwen3's vocabulary are gigabytes); with a ``Qwen3Cache`` the call continues
  where the cache's last one stopped (``start`` must say where: 0 begins anew). Its ``named_parameters()`` are the
  HF model's, in the same order (``model.``..., a tied ``lm_head.weight`` not listed).
- ``Qwen3Cache``: transformers' own ``StaticCache``, its key and value tensors allocated whole (``batch`` x
  ``max_len`` tokens, ``nbytes``) where the ``Qwen3Cache`` is constructed, as an engine's KV pool is: the rollout
  builds it in its ``kv_cache`` region, so a pause releases it and no decode allocates a cache of its own (a
  ``DynamicCache`` grows by a ``torch.cat`` per layer per token, and after a pause has emptied torch's pool every
  one of those sizes is a new segment from below). The call at ``start`` 0 resets it (zeros: what a discarded
  region maps back holds any bits, and a masked position's NaN would still reach the attention's product); a
  later call continues where the last one stopped. The
  model's forward takes it as ``cache`` (transformers 5.x) or ``past_key_values`` (4.x and early 5.x): whichever
  its signature names.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from ..errors import InvalidArgumentError
from .models import ModelConfig

__all__ = ["config", "build", "Qwen3LM", "Qwen3Cache"]


def config(cfg: ModelConfig):
    """The ``transformers.Qwen3Config`` of ``cfg`` (see the module policies)."""
    from transformers import Qwen3Config  # noqa: PLC0415

    cfg.validate()
    if cfg.n_heads % 2 or cfg.head_dim % 2:
        raise InvalidArgumentError(f"a Qwen3 needs an even n_heads (n_heads / 2 KV heads) and an even head_dim "
                                   f"(rotary halves): n_heads {cfg.n_heads}, head_dim {cfg.head_dim}")
    return Qwen3Config(vocab_size=cfg.vocab, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                       num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                       num_key_value_heads=cfg.n_heads // 2, head_dim=cfg.head_dim,
                       max_position_embeddings=cfg.max_seq, tie_word_embeddings=True)


def build(cfg: ModelConfig, *, seed: int, device="cpu", dtype=torch.bfloat16):
    """A ``Qwen3ForCausalLM`` of ``cfg``'s shape with random weights (see the module policies)."""
    from transformers import Qwen3ForCausalLM  # noqa: PLC0415

    hf_cfg = config(cfg)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return Qwen3ForCausalLM(hf_cfg)
    finally:
        torch.set_default_dtype(default)


class Qwen3Cache:
    """What a ``Qwen3LM`` forward continues from (see the module policies). The constructor takes the harness's
    ``KVCache`` arguments and allocates the whole cache on ``device``."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, *, device, dtype):
        from transformers import StaticCache  # noqa: PLC0415

        self.batch, self.max_len = batch, max_len
        kv_heads = cfg.n_heads // 2
        self.past = StaticCache(config=config(cfg), max_cache_len=max_len)
        self.past.early_initialization(batch_size=batch, num_heads=kv_heads, head_dim=cfg.head_dim, dtype=dtype,
                                       device=torch.device(device))
        held = [t for layer in self.past.layers for t in (layer.keys, layer.values)]
        self.nbytes = sum(t.numel() * t.element_size() for t in held)
        self.length = 0

    def begin(self) -> None:
        self.past.reset()
        self.length = 0


class Qwen3LM(nn.Module):
    """The rollout's Qwen3 (see the module policies)."""

    def __init__(self, hf_model):
        super().__init__()
        self.model, self.lm_head = hf_model.model, hf_model.lm_head  # the HF model's names, in its order
        self.config = hf_model.config
        params = inspect.signature(type(self.model).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @classmethod
    def random(cls, cfg: ModelConfig, *, seed: int, device="cpu", dtype=torch.bfloat16) -> "Qwen3LM":
        return cls(build(cfg, seed=seed, device=device, dtype=dtype))

    def forward(self, tokens: torch.Tensor, cache: Qwen3Cache | None = None, start: int = 0) -> torch.Tensor:
        if cache is None:
            out = self.model(input_ids=tokens, use_cache=False)
        else:
            if start != 0 and start != cache.length:
                raise InvalidArgumentError(f"the cache holds {cache.length} tokens; a call at {start} cannot "
                                           f"continue it")
            if start + tokens.shape[1] > cache.max_len or tokens.shape[0] != cache.batch:
                raise InvalidArgumentError(f"{tokens.shape[0]} x {start + tokens.shape[1]} tokens do not fit the cache "
                                           f"({cache.batch} x {cache.max_len}: a batch of {cache.batch} exactly)")
            if start == 0:
                cache.begin()
            out = self.model(input_ids=tokens, use_cache=True, **{self._cache_kw: cache.past})  # fills it in place
            cache.length = start + tokens.shape[1]
        return self.lm_head(out.last_hidden_state[:, -1:])
