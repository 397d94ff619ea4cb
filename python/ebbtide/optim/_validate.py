"""Input checks shared by CPUAdam and OffloadedAdam: hyper-parameters, params, step arguments and loaded state.

Rules (each violation raises InvalidArgumentError naming the group, the key and the value passed; nothing has
changed when it does):
- ``lr``: a real number (int or float, not bool or str) or a one-element floating-point tensor; finite, >= 0.
- ``betas``: a pair; each a real number or a one-element floating-point tensor in [0, 1).
- ``eps``, ``weight_decay``: real numbers, finite, >= 0.
- ``amsgrad``, ``maximize``, ``decoupled_weight_decay``: bool (or the ints 0 and 1).
- ``mode``: "fast" or "exact".
- ``step(grad_scale=...)``: None or a finite real number.
- Params: tensors; none passed twice (in one group or across groups) and no two whose address ranges intersect
  (views of one storage; interleaved strided views count as intersecting): both would be updated from the same
  bytes at once, and the result would depend on thread timing.
- ``step`` checks every group before any group is stepped.
- ``load_state_dict``: a mapping with ``param_groups`` (a list matching the optimizer's groups and their sizes)
  and ``state``; each loaded group's hyper-parameters obey the rules above; each per-param state tensor
  (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``master_param``) is a tensor of exactly its param's shape
  (never reshaped), and ``step`` a finite number >= 0 (a number or a one-element tensor).
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping

import torch

from .._messages import shown
from ..errors import InvalidArgumentError

__all__ = ["MODES", "STATE_TENSORS", "check_group", "check_groups", "check_distinct", "check_grad_scale",
           "check_state_dict", "check_bucketing", "scalar_value"]

MODES = ("fast", "exact")
STATE_TENSORS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")
_FLAGS = ("amsgrad", "maximize", "decoupled_weight_decay")


def _shown(value) -> str:
    return shown(value, bare_numbers=True)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def scalar_value(value, where: str) -> float:
    """A real number or one-element floating-point tensor as a float; anything else is an InvalidArgumentError."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point() or value.device.type == "meta":
            raise InvalidArgumentError(f"{where} as a tensor must be a one-element floating-point tensor with a "
                                       f"value (got {_shown(value)} on {value.device})")
        return float(value.item())
    if not _is_real(value):
        raise InvalidArgumentError(f"{where} must be a number (got {_shown(value)})")
    return float(value)


def _non_negative(value, where: str, *, tensor_ok: bool) -> None:
    if isinstance(value, torch.Tensor) and not tensor_ok:
        raise InvalidArgumentError(f"{where} must be a number (got {_shown(value)})")
    v = scalar_value(value, where)
    if not (math.isfinite(v) and v >= 0.0):
        raise InvalidArgumentError(f"{where} must be finite and >= 0 (got {_shown(value)})")


def param_list(params, owner: str) -> list:
    """The constructor's ``params`` as a non-empty list (of tensors or of param group dicts)."""
    if isinstance(params, torch.Tensor):
        raise InvalidArgumentError("params must be an iterable of tensors or of param group dicts, not a tensor")
    if not isinstance(params, Iterable):
        raise InvalidArgumentError(f"params must be an iterable of tensors or of param group dicts, got {_shown(params)}")
    params = list(params)
    if not params:
        raise InvalidArgumentError(f"{owner} got an empty parameter list")
    return params


def check_group(group: Mapping, where: str = "optimizer") -> None:
    """Check one param group's (or the constructor's) hyper-parameters; keys a group lacks are not checked."""
    if "lr" in group:
        _non_negative(group["lr"], f"{where}: lr", tensor_ok=True)
    if "betas" in group:
        betas = group["betas"]
        if isinstance(betas, (str, bytes, torch.Tensor)) or not isinstance(betas, Iterable):
            raise InvalidArgumentError(f"{where}: betas must be a pair of numbers (got {_shown(betas)})")
        betas = tuple(betas)
        if len(betas) != 2:
            raise InvalidArgumentError(f"{where}: betas must be a pair of numbers (got {len(betas)} values)")
        for i, b in enumerate(betas):
            v = scalar_value(b, f"{where}: betas[{i}]")
            if not 0.0 <= v < 1.0:
                raise InvalidArgumentError(f"{where}: betas[{i}] must be in [0, 1) (got {_shown(b)})")
    for key in ("eps", "weight_decay"):
        if key in group:
            _non_negative(group[key], f"{where}: {key}", tensor_ok=False)
    for key in _FLAGS:
        if key in group:
            v = group[key]
            if not (isinstance(v, bool) or (isinstance(v, numbers.Integral) and v in (0, 1))):
                raise InvalidArgumentError(f"{where}: {key} must be True or False (got {_shown(v)})")
    if "mode" in group and group["mode"] not in MODES:
        raise InvalidArgumentError(f"{where}: mode must be 'fast' or 'exact' (got {_shown(group['mode'])})")


def check_groups(groups: list) -> None:
    """Check every param group before any is used (a bad group 1 leaves group 0 unstepped)."""
    for i, g in enumerate(groups):
        check_group(g, f"param_groups[{i}]")


def _span(p: torch.Tensor) -> tuple[int, int]:
    """[first, last] byte address the tensor's elements can touch."""
    start = p.data_ptr()
    reach = sum((s - 1) * abs(st) for s, st in zip(p.shape, p.stride()))
    return start, start + (reach + 1) * p.element_size() - 1


def check_distinct(params: Iterable, existing: Iterable = ()) -> None:
    """Reject a tensor passed twice and two params whose memory ranges overlap (views of one storage), among
    ``params`` and against ``existing`` (the params already held). O(n log n): one sort of the address ranges."""
    seen: dict[int, str] = {}
    spans: list[tuple[str, int, int, str]] = []
    labelled = [(f"an already added param ({i})", p) for i, p in enumerate(existing)]
    labelled += [(f"param {i}", p) for i, p in enumerate(params)]
    for name, p in labelled:
        if not isinstance(p, torch.Tensor):
            raise InvalidArgumentError(f"params must be tensors (got {_shown(p)})")
        if id(p) in seen:
            raise InvalidArgumentError(f"{name} is the same tensor as {seen[id(p)]}: pass each param once "
                                       f"(two updates of one tensor would race)")
        seen[id(p)] = name
        if p.numel() > 0 and p.device.type != "meta":
            lo, hi = _span(p)
            spans.append((str(p.device), lo, hi, name))
    spans.sort()
    for (dev_a, _, hi_a, name_a), (dev_b, lo_b, _, name_b) in zip(spans, spans[1:]):
        if dev_a == dev_b and lo_b <= hi_a:
            raise InvalidArgumentError(f"{name_b} overlaps {name_a} in memory (views of one storage): each param "
                                       f"needs memory of its own")


def check_bucketing(bucket_numel, slots, minimum: int) -> None:
    """The pipeline's ``bucket_numel`` (an int >= ``minimum``) and ``slots`` (an int >= 1)."""
    if not isinstance(bucket_numel, int) or isinstance(bucket_numel, bool) or bucket_numel < minimum:
        raise InvalidArgumentError(f"bucket_numel must be an int >= {minimum} (got {bucket_numel!r})")
    if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
        raise InvalidArgumentError(f"slots must be an int >= 1 (got {slots!r})")


def check_grad_scale(grad_scale) -> float:
    if grad_scale is None:
        return 1.0
    if not _is_real(grad_scale) or not math.isfinite(float(grad_scale)):
        raise InvalidArgumentError(f"grad_scale must be a finite number (got {_shown(grad_scale)})")
    return float(grad_scale)


def _step_value(step, where: str) -> float:
    v = scalar_value(step, where) if isinstance(step, torch.Tensor) else (
        float(step) if _is_real(step) else None)
    if v is None or not (math.isfinite(v) and v >= 0.0):
        raise InvalidArgumentError(f"{where} must be a finite number >= 0 (got {_shown(step)})")
    return v


def check_state_dict(state_dict, groups: list) -> None:
    """Check a state dict against the optimizer's ``groups`` (their ``params``) before anything is loaded."""
    if not isinstance(state_dict, Mapping) or "param_groups" not in state_dict:
        raise InvalidArgumentError(f"state_dict must be a mapping with 'param_groups' and 'state' (got "
                                   f"{_shown(state_dict) if not isinstance(state_dict, Mapping) else sorted(state_dict)})")
    saved_groups = state_dict["param_groups"]
    state = state_dict.get("state", {})
    if not isinstance(saved_groups, (list, tuple)) or not isinstance(state, Mapping):
        raise InvalidArgumentError("state_dict: 'param_groups' must be a list and 'state' a mapping")
    if len(saved_groups) != len(groups):
        raise InvalidArgumentError(f"state_dict has {len(saved_groups)} parameter groups, the optimizer "
                                   f"{len(groups)}")
    for gi, (mine, saved) in enumerate(zip(groups, saved_groups)):
        if not isinstance(saved, Mapping) or not isinstance(saved.get("params"), (list, tuple)):
            raise InvalidArgumentError(f"state_dict: param_groups[{gi}] must be a mapping with a 'params' list")
        if len(saved["params"]) != len(mine["params"]):
            raise InvalidArgumentError(f"state_dict: param_groups[{gi}] has {len(saved['params'])} params, the "
                                       f"optimizer's group {len(mine['params'])}")
        check_group(saved, f"state_dict param_groups[{gi}]")
        for sid, p in zip(saved["params"], mine["params"]):
            s = state.get(sid)
            if s is None:
                continue
            where = f"state_dict state[{sid!r}]"
            if not isinstance(s, Mapping):
                raise InvalidArgumentError(f"{where} must be a mapping (got {_shown(s)})")
            if "step" in s:
                _step_value(s["step"], f"{where}['step']")
            for key in STATE_TENSORS:
                if key not in s:
                    continue
                t = s[key]
                if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                    raise InvalidArgumentError(f"{where}['{key}'] must be a floating-point tensor (got {_shown(t)})")
                if tuple(t.shape) != tuple(p.shape):
                    raise InvalidArgumentError(f"{where}['{key}'] has shape {tuple(t.shape)} but its param has "
                                               f"shape {tuple(p.shape)}")
