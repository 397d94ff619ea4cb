"""Parameter names as a serving engine's copy of a Megatron-core model takes them (no Megatron import here: the
rollout side uses it too)."""
from __future__ import annotations

__all__ = ["served_names"]


def served_names(named) -> dict:
    """``{name: tensor}`` from ``(name, tensor)`` pairs with the wrappers' ``module.`` prefixes removed (DDP ->
    Float16Module -> GPTModel)."""
    out = {}
    for n, t in named:
        while n.startswith("module."):
            n = n[len("module."):]
        out[n] = t
    return out
