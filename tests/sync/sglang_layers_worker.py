"""SGLang's own layers behind ebbtide's loader (run as a script in its own process: ``python sglang_layers_worker.py
TP_SIZE TP_RANK UPDATES``; prints one JSON line). The layers are SGLang 0.5.23's ``QKVParallelLinear``,
``MergedColumnParallelLinear``, ``RowParallelLinear`` and ``FusedMoE`` with their own ``weight_loader``s, built on
the CPU after publishing a ``ServerArgs`` as SGLang's own tests do (TP simulated by the published rank: no process
group). The model's ``load_weights`` follows qwen3.py / qwen3_moe.py: ``stacked_params_mapping`` onto the fused
projections, ``FusedMoE.make_expert_params_mapping`` for the experts. (SGLang's whole Qwen3ForCausalLM needs
vllm's rotary kernel or sgl_kernel on a CPU, so the layers stand in for it.) torchvision, which SGLang's
multimodal utilities import, is replaced by mock modules in this process only."""
import importlib.abc
import importlib.machinery
import json
import sys
from unittest import mock

import torch


class _NoTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = mock.MagicMock(name=spec.name)  # any attribute the importers reach for
        m.__name__, m.__path__, m.__spec__, m.__version__ = spec.name, [], spec, "0.0"
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _NoTorchvision())
H, I, E = 64, 96, 4


def build(tp_size: int, tp_rank: int):
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    publish(ServerArgs(model_path="dummy", tp_size=tp_size), role="test",
            ranks=SpawnRanks(world_rank=tp_rank, dp_rank=None))
    from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    class Served(torch.nn.Module):
        def __init__(self):
            super().__init__()
            dt = torch.bfloat16
            self.qkv_proj = QKVParallelLinear(H, 16, 4, 2, bias=False, params_dtype=dt)
            self.gate_up_proj = MergedColumnParallelLinear(H, [I, I], bias=False, params_dtype=dt)
            self.down_proj = RowParallelLinear(I, H, bias=False, params_dtype=dt)
            self.experts = FusedMoE(num_experts=E, hidden_size=H, intermediate_size=I, layer_id=0, top_k=2,
                                    params_dtype=dt)

        def load_weights(self, weights):
            stacked = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                       ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
            experts = FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name="gate_proj",
                                                          ckpt_down_proj_name="down_proj",
                                                          ckpt_up_proj_name="up_proj", num_experts=E)
            params = dict(self.named_parameters())
            for name, w in weights:
                for param_name, weight_name, shard in stacked:
                    if weight_name in name and "experts" not in name:
                        p = params[name.replace(weight_name, param_name)]
                        p.weight_loader(p, w, shard)
                        break
                else:
                    for param_name, weight_name, expert_id, shard in experts:
                        if weight_name in name:
                            pn = name.replace(weight_name, param_name)
                            p = params[pn]
                            p.weight_loader(p, w, pn, shard_id=shard, expert_id=expert_id)
                            break
                    else:
                        p = params.get(name)
                        if p is not None:
                            getattr(p, "weight_loader")(p, w)

    return Served()


def checkpoint(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    out = {"q_proj.weight": r(64, H), "k_proj.weight": r(32, H), "v_proj.weight": r(32, H),
           "gate_proj.weight": r(I, H), "up_proj.weight": r(I, H), "down_proj.weight": r(H, I)}
    for e in range(E):
        for n, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            out[f"experts.{e}.{n}.weight"] = r(*shape)
    return out


def main(tp_size: int, tp_rank: int, updates: int) -> dict:
    from multiprocessing.reduction import ForkingPickler

    from ebbtide.sync import Plan, fill_bucket, sglang as S
    from ebbtide.sync import sglang_loader as L

    model = build(tp_size, tp_rank)
    plan = Plan.of(checkpoint(0), default="raw", bucket_bytes=60_000)

    def requests(src, version, form):
        for b in plan.buckets:
            buf = torch.empty(b.nbytes, dtype=torch.uint8)
            fill_bucket(plan, b, src, buf)
            yield S.tensor_request(b, buf, form=form, weight_version=version, signature=plan.signature,
                                   buckets=len(plan.buckets))

    for v in range(updates):
        src = checkpoint(v)
        for req in requests(src, v, "ebbtide"):
            named = ForkingPickler.loads(req["serialized_named_tensors"][0])
            L.load_weights(model, named)  # what SGLang calls for load_format == L.LOADER
        ref = build(tp_size, tp_rank) if v == 0 else ref  # noqa: F821 (assigned on the first pass)
        for req in requests(src, None, "named"):
            ref.load_weights(ForkingPickler.loads(req["serialized_named_tensors"][0]))  # SGLang's own path
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            if not torch.equal(p, q):
                return {"ok": False, "why": f"update {v}: {n} differs from SGLang's own placement"}
    st = L.state(model)
    return {"ok": True, "recorded": st.recorded, "replayed": st.replayed, "buckets": len(plan.buckets),
            "fallback": sorted({n for r in st.records.values() for n in r.fallback}),
            "segments": sum(len(r.dst) for r in st.records.values()),
            "params": {n: list(p.shape) for n, p in model.named_parameters()}}


if __name__ == "__main__":
    tp_size, tp_rank, updates = (int(x) for x in sys.argv[1:4])
    print(json.dumps(main(tp_size, tp_rank, updates)))
