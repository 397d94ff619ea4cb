"""The host side of the offloaded optimizers (OffloadedAdam, ShardedAdam): flat host arrays holding the fp32 master
and the Adam moments of a set of params, one contiguous range per param, shown as torch's per-param state and saved
and loaded in torch's format.

What holds:
- Arrays: ``master`` fp32, ``m``/``v`` in the moments dtype (fp32 or bf16), ``vmax`` fp32 with amsgrad (else None);
  pageable host memory, 12 B per element (8 with bf16 moments, 16 with amsgrad).
- ``publish`` puts views of them into the optimizer's ``state[p]`` (``exp_avg``, ``exp_avg_sq``, ``master_param``,
  ``max_exp_avg_sq``, shaped like ``p``) with a ``step`` tensor that ``state_dict`` fills: torch's
  ``Optimizer.state_dict`` then writes torch's format, so the state loads into torch's Adam/AdamW too.
- ``load`` validates everything first (``_validate.check_state_dict``, each saved entry's moments, one step count
  for all params), then applies: hyper-parameters into the groups, masters from the params (the caller's
  ``sync_masters``) unless the entry carries ``master_param``, moments zeroed unless saved (converted to the
  moments dtype; to bf16 by round to nearest even). Bad input changes nothing.
"""
from __future__ import annotations

import torch

from ..errors import InvalidArgumentError
from ._validate import check_state_dict

__all__ = ["HostState"]


class HostState:
    """Master, moments (and amsgrad's max) of ``numel`` elements in host memory."""

    def __init__(self, numel: int, moments_dtype: torch.dtype, amsgrad: bool):
        self.master = torch.zeros(numel, dtype=torch.float32)
        self.m = torch.zeros(numel, dtype=moments_dtype)
        self.v = torch.zeros(numel, dtype=moments_dtype)
        self.vmax = torch.zeros(numel, dtype=torch.float32) if amsgrad else None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.master, self.m, self.v, self.vmax) if t is not None)

    def arrays(self) -> dict:
        """The state key -> the flat host array it is a range of."""
        out = {"master_param": self.master, "exp_avg": self.m, "exp_avg_sq": self.v}
        if self.vmax is not None:
            out["max_exp_avg_sq"] = self.vmax
        return out

    def publish(self, state: dict, positions, step: int) -> None:
        """``state[p]`` for every ``(p, offset)`` of ``positions``: views of the arrays shaped like ``p``."""
        state.clear()
        for p, o in positions:
            sl = slice(o, o + p.numel())
            st = {key: a[sl].view(p.shape) for key, a in self.arrays().items()}
            state[p] = {"step": torch.tensor(float(step), dtype=torch.float32), **st}

    @staticmethod
    def fill_steps(state: dict, step: int) -> None:
        """Every published ``step`` tensor to the optimizer's one step count (before torch's ``state_dict``)."""
        for st in state.values():
            st["step"].fill_(float(step))

    @torch.no_grad()
    def load(self, state_dict, param_groups: list, positions, sync_masters, owner: str, defaults: dict) -> int:
        """Load ``state_dict`` (torch's format, ``master_param`` optional) into the arrays and ``param_groups``;
        returns the step count. ``positions``: ``(p, offset)`` of every param; ``sync_masters()`` sets every master
        from its param."""
        check_state_dict(state_dict, param_groups)  # hyper-parameters, group sizes, exact state shapes
        saved_groups, state = state_dict["param_groups"], state_dict.get("state", {})
        entries = {}
        for mine, saved in zip(param_groups, saved_groups):
            for sid, p in zip(saved["params"], mine["params"]):
                s = state.get(sid)
                if s is None:
                    continue
                for key in ("step", "exp_avg", "exp_avg_sq"):
                    if key not in s:
                        raise InvalidArgumentError(f"state_dict state[{sid!r}] lacks {key!r} (a param of shape "
                                                   f"{tuple(p.shape)})")
                entries[id(p)] = s
        steps = {float(s["step"]) for s in entries.values()}
        if len(steps) > 1:
            raise InvalidArgumentError(f"per-param steps differ ({sorted(steps)}); {owner} keeps one step count")
        # Validated: now apply.
        for mine, saved in zip(param_groups, saved_groups):
            for k, val in saved.items():
                if k != "params":
                    mine[k] = val
            mine.setdefault("mode", defaults["mode"])
            mine.setdefault("decoupled_weight_decay", True)
        sync_masters()  # masters of params without saved masters come from the params
        for a in (self.m, self.v, self.vmax):
            if a is not None:
                a.zero_()
        arrays = self.arrays()
        for p, o in positions:
            s = entries.get(id(p))
            if s is None:
                continue
            sl = slice(o, o + p.numel())
            for key, a in arrays.items():
                if key in s:
                    a[sl].copy_(s[key].reshape(-1))
        return int(steps.pop()) if steps else 0
