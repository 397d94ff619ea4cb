"""A model whose ``load_weights`` places checkpoint tensors the way SGLang's model classes do (qwen3.py's
``stacked_params_mapping`` onto fused ``qkv_proj`` / ``gate_up_proj``, a TP shard of a row-parallel weight along its
input dimension, per-expert slices of a stacked expert weight, and one fp32 parameter loaded with a cast), in plain
torch: the record/replay mechanism's CPU tests use it where SGLang's layers are not importable."""
import torch

H, I, E = 64, 96, 4  # hidden, intermediate, experts


class TinyServed(torch.nn.Module):
    def __init__(self, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.qkv_proj = torch.nn.Parameter(torch.zeros(3 * H, H, dtype=torch.bfloat16), requires_grad=False)
        self.gate_up_proj = torch.nn.Parameter(torch.zeros(2 * I, H, dtype=torch.bfloat16), requires_grad=False)
        self.down_proj = torch.nn.Parameter(torch.zeros(H, I // tp_size, dtype=torch.bfloat16), requires_grad=False)
        self.w13 = torch.nn.Parameter(torch.zeros(E, 2 * I, H, dtype=torch.bfloat16), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(H, dtype=torch.float32), requires_grad=False)  # loaded with a cast

    def load_weights(self, weights):
        stacked = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                   "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        for name, w in weights:
            short = name.split(".")[-2] if name.endswith(".weight") else name
            if short in stacked:
                target, shard = stacked[short]
                p = getattr(self, target)
                n = w.shape[0]
                p.data.narrow(0, shard * n, n).copy_(w)
            elif short == "down_proj":
                n = self.down_proj.shape[1]
                self.down_proj.data.copy_(w.narrow(1, self.tp_rank * n, n))
            elif short.startswith("experts"):
                e, which = int(short.split("_")[1]), short.split("_")[2]  # experts_<e>_<gate|up>
                off = 0 if which == "gate" else I
                self.w13.data[e].narrow(0, off, I).copy_(w)
            elif short == "norm":
                self.norm.data.copy_(w.float())  # a transform (cast): not a placement
            # anything else is ignored, as SGLang's loaders skip unknown names


def checkpoint(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    out = {f"layers.0.{n}.weight": r(H, H) for n in ("q_proj", "k_proj", "v_proj")}
    out.update({f"layers.0.{n}.weight": r(I, H) for n in ("gate_proj", "up_proj")})
    out["layers.0.down_proj.weight"] = r(H, I)
    for e in range(E):
        out[f"layers.0.experts_{e}_gate.weight"] = r(I, H)
        out[f"layers.0.experts_{e}_up.weight"] = r(I, H)
    out["layers.0.norm.weight"] = r(H)
    out["layers.0.rotary.inv_freq"] = r(8)  # skipped by the loader
    return out


class Combining(torch.nn.Module):
    """Loaders SGLang has that per-output recording must not break: one that writes a fused parameter only once
    two outputs of the same call arrived (DeepSeek's q_a_proj + kv_a_proj_with_mqa), a write into a registered
    buffer, and a transposed copy (one element per run)."""

    def __init__(self):
        super().__init__()
        self.fused_a = torch.nn.Parameter(torch.zeros(2 * H, H, dtype=torch.bfloat16), requires_grad=False)
        self.register_buffer("table", torch.zeros(H, dtype=torch.bfloat16))
        self.wt = torch.nn.Parameter(torch.zeros(H, I, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights):
        cached = {}
        for name, w in weights:
            if name in ("q_a.weight", "kv_a.weight"):
                cached[name] = w
                if len(cached) == 2:
                    self.fused_a.data.copy_(torch.cat([cached["q_a.weight"], cached["kv_a.weight"]]))
            elif name == "table":
                self.table.copy_(w)
            elif name == "wt.weight":
                self.wt.data.copy_(w.t())


def combining_checkpoint(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    return {"q_a.weight": r(H, H), "kv_a.weight": r(H, H), "table": r(H), "wt.weight": r(I, H)}
