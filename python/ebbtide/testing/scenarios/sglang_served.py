"""SGLang's own layers arranged as a served Qwen3 / Qwen3-MoE model, loaded by SGLang's own ``load_weights``.

What SGLang runs per weight update, minus its serving runtime: the model's parameters are SGLang 0.5.23's
``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``RowParallelLinear``, ``ReplicatedLinear`` and ``FusedMoE``
(unquantized bf16, or FP8 128x128 block with fp32 ``weight_scale_inv`` as SGLang serves an FP8 checkpoint), each with
its own ``weight_loader``; the model's ``load_weights`` *is* ``Qwen3ForCausalLM.load_weights`` /
``Qwen3MoeForCausalLM.load_weights`` from SGLang's model files, called on this module (it reads ``config``,
``pp_group``, ``model`` and ``named_parameters``). Norms and embeddings are plain parameters: SGLang loads them with
``default_weight_loader`` (a ``copy_``) either way. SGLang's whole model classes need its attention backends and
kernels (``sgl_kernel`` or vllm's rotary op) to be built, which neither a CPU nor the benchmark needs.

``prepare`` must run first in the process: it publishes a ``ServerArgs`` (TP simulated by the published rank, no
process group, as SGLang's own layer tests do) and puts an inert stand-in, in this process only, for each package
SGLang imports at module level but no weight loader calls, where it does not import: torchvision (SGLang's
multimodal utilities; CI's CPU torch has no matching build), on CUDA SGLang's kernel package ``sgl_kernel`` (its
activation and norm kernels, a multi-hundred-MB wheel per CUDA version), and IPython (the frontend's notebook
display helpers). ``rebuild_flattened`` / ``flattened_request`` are SGLang's side of slime's flattened-bucket
request (what its weight updater hands ``load_weights``). Used by the sync suite's "into SGLang's loaders" rows and by
``tests/sync``.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import re
import sys
import types
from unittest import mock

__all__ = ["prepare", "build", "rebuild_flattened", "flattened_request", "HEAD_DIM"]

HEAD_DIM = 128
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class _Inert(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers every import of the named packages with a module whose attributes are inert (never called here)."""

    def __init__(self, names: set):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = mock.MagicMock(name=spec.name)
        m.__name__, m.__path__, m.__spec__, m.__version__ = spec.name, [], spec, "0.0"
        return m

    def exec_module(self, module):
        pass


def _missing(name: str) -> bool:
    try:
        importlib.import_module(name)
        return False
    except Exception:  # noqa: BLE001 (a build for another torch raises more than ImportError)
        for k in [k for k in sys.modules if k.split(".")[0] == name]:
            del sys.modules[k]
        return True


def prepare(tp_size: int = 1, tp_rank: int = 0) -> list:
    """Make SGLang's layers constructible in this process (see the module note); returns the packages stood in."""
    stood_in = [n for n in ("torchvision", "sgl_kernel", "IPython") if _missing(n)]
    if stood_in:
        sys.meta_path.insert(0, _Inert(set(stood_in)))
    from sglang.srt.runtime_context import SpawnRanks, publish  # noqa: PLC0415
    from sglang.srt.server_args import ServerArgs  # noqa: PLC0415

    publish(ServerArgs(model_path="dummy", tp_size=tp_size), role="test",
            ranks=SpawnRanks(world_rank=tp_rank, dp_rank=None))
    return stood_in


def _shapes(specs) -> tuple[dict, dict]:
    """({layer: {suffix: shape}}, {top-level name: shape}) of HF-named bf16 tensors; experts counted per layer."""
    layers, top = {}, {}
    for name, shape in specs:
        m = _LAYER.match(name)
        if m:
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = tuple(shape)
        else:
            top[name] = tuple(shape)
    return layers, top


def build(specs, *, fp8: bool, device="cpu"):
    """The served model of the HF-named tensors ``specs`` ([(name, shape)], as the sync suite lists them)."""
    import torch  # noqa: PLC0415
    from sglang.srt.layers.linear import (  # noqa: PLC0415
        MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear)
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE  # noqa: PLC0415
    from sglang.srt.layers.quantization.fp8 import Fp8Config  # noqa: PLC0415
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM  # noqa: PLC0415
    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM  # noqa: PLC0415

    dt = torch.bfloat16
    quant = Fp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=[128, 128]) if fp8 else None
    layers, top = _shapes(specs)

    def plain(*shape):
        return torch.nn.Parameter(torch.empty(*shape, dtype=dt), requires_grad=False)

    def layer(i: int, s: dict) -> torch.nn.Module:
        hidden = s["input_layernorm.weight"][0]
        q, kv = s["self_attn.q_proj.weight"][0], s["self_attn.k_proj.weight"][0]
        p = f"model.layers.{i}."
        mod = torch.nn.Module()
        mod.input_layernorm, mod.post_attention_layernorm = torch.nn.Module(), torch.nn.Module()
        mod.input_layernorm.weight, mod.post_attention_layernorm.weight = plain(hidden), plain(hidden)
        mod.self_attn = torch.nn.Module()
        mod.self_attn.qkv_proj = QKVParallelLinear(hidden, HEAD_DIM, q // HEAD_DIM, kv // HEAD_DIM, bias=False,
                                                   params_dtype=dt, quant_config=quant,
                                                   prefix=p + "self_attn.qkv_proj")
        mod.self_attn.o_proj = RowParallelLinear(q, hidden, bias=False, params_dtype=dt, quant_config=quant,
                                                 prefix=p + "self_attn.o_proj")
        mod.mlp = torch.nn.Module()
        experts = {int(k.split(".")[2]) for k in s if k.startswith("mlp.experts.")}
        if experts:
            inter = s["mlp.experts.0.gate_proj.weight"][0]
            mod.mlp.gate = ReplicatedLinear(hidden, len(experts), bias=False, params_dtype=dt, quant_config=None,
                                            prefix=p + "mlp.gate")
            mod.mlp.experts = FusedMoE(num_experts=len(experts), hidden_size=hidden, intermediate_size=inter,
                                       layer_id=i, top_k=min(8, len(experts)), params_dtype=dt, quant_config=quant,
                                       prefix=p + "mlp.experts")
        else:
            inter = s["mlp.gate_proj.weight"][0]
            mod.mlp.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias=False, params_dtype=dt,
                                                              quant_config=quant, prefix=p + "mlp.gate_up_proj")
            mod.mlp.down_proj = RowParallelLinear(inter, hidden, bias=False, params_dtype=dt, quant_config=quant,
                                                  prefix=p + "mlp.down_proj")
        return mod

    moe = any("mlp.experts.0.gate_proj.weight" in s for s in layers.values())
    n_experts = max((len({k.split(".")[2] for k in s if k.startswith("mlp.experts.")}) for s in layers.values()),
                    default=0)
    loader = Qwen3MoeForCausalLM.load_weights if moe else Qwen3ForCausalLM.load_weights

    class Served(torch.nn.Module):
        """Parameters under SGLang's served names; ``load_weights`` is SGLang's own for the architecture."""

        def __init__(self):
            super().__init__()
            self.config = types.SimpleNamespace(tie_word_embeddings=False, num_experts=n_experts)
            self.pp_group = types.SimpleNamespace(is_last_rank=True, is_first_rank=True)
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList([layer(i, layers[i]) for i in sorted(layers)])
            if "model.embed_tokens.weight" in top:
                self.model.embed_tokens = torch.nn.Module()
                self.model.embed_tokens.weight = plain(*top["model.embed_tokens.weight"])
            if "model.norm.weight" in top:
                self.model.norm = torch.nn.Module()
                self.model.norm.weight = plain(*top["model.norm.weight"])
            if "lm_head.weight" in top:
                self.lm_head = torch.nn.Module()
                self.lm_head.weight = plain(*top["lm_head.weight"])

        def load_weights(self, weights):
            return loader(self, weights)

    with torch.device(device):
        model = Served()
    for prm in model.parameters():  # SGLang's loaders write fresh parameters; start from zeros, not garbage
        prm.data.zero_()
    return model


def rebuild_flattened(payload: dict) -> list:
    """What SGLang's weight updater does with a flattened-bucket request's payload: its metadata converted, the
    bucket's views rebuilt (``_update_weights_from_flattened_bucket``)."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata  # noqa: PLC0415

    meta = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                    end_idx=m.end_idx, numel=m.numel) for m in payload["metadata"]]
    return FlattenedTensorBucket(flattened_tensor=payload["flattened_tensor"], metadata=meta).reconstruct_tensors()


def flattened_request(bucket, buf) -> list:
    """Slime's flattened-bucket request for ``bucket`` in ``buf``, as SGLang's process rebuilds it."""
    from ebbtide.integrations.sglang import flattened_payload  # noqa: PLC0415

    return rebuild_flattened(flattened_payload(bucket, buf))
