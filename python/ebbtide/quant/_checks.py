"""Argument checks of the public quant API: every bad argument is an InvalidArgumentError (a ValueError) that names
the argument and shows the value passed, raised before anything runs.

Rules:
- Tensors are torch.Tensor objects of the documented dtype and rank, on the CPU or a CUDA device; CUDA inputs
  have a contiguous last dimension (any row stride) and non-overlapping expert slices.
- Block and group sizes are ints (not floats or bools) from the documented set: block 128; FP8 group 128; INT4
  group 32, 64 or 128. The INT4 divisor is 7 or 7.5. Choices (scale, scale_layout) are the exact strings listed.
- eps is a real number (not a bool or a string) in [1e-30, 1e30]: every scale stays a normal fp32 number.
- Flags (clip_ste, return_q) are bools.
- int4_unpack's input is either int4_pack's dict (the three keys present) or the three entries; weight_shape is
  two non-negative ints (a list, tuple or one-dimensional integer tensor) that agree with the tensors' shapes.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import torch

from .._messages import shown
from ..errors import InvalidArgumentError

__all__ = ["tensor", "eps", "scale", "choice", "int_choice", "flag", "mapping", "int4_unpack_args"]

SCALES = ("fp32", "ue8m0", "ue8m0_packed")


def _listed(allowed: tuple) -> str:
    items = [repr(a) if isinstance(a, str) else str(a) for a in allowed]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def tensor(t, name: str, dims: tuple[int, ...], dtype=torch.bfloat16, why: str = "the exact values being exported"):
    """A tensor of ``dtype`` with a rank in ``dims`` on the CPU or a CUDA device (see the module rules)."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {shown(t)}")
    if t.dtype != dtype:
        hint = f" ({why}); cast with .to({dtype})" if why else ""
        raise InvalidArgumentError(f"{name} must be {str(dtype).replace('torch.', '')}{hint}, got {t.dtype}")
    if t.dim() not in dims:
        want = (f"{dims[0]} to {dims[-1]}" if len(dims) > 2 and dims == tuple(range(dims[0], dims[-1] + 1))
                else _listed(dims))
        raise InvalidArgumentError(f"{name} must have {want} dimensions, got shape {tuple(t.shape)}")
    if t.device.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"{name} must be on the CPU or a CUDA device, got {t.device}")
    if t.device.type == "cuda" and t.numel() > 0:
        if t.stride(-1) != 1:
            raise InvalidArgumentError(f"{name} must have a contiguous last dimension (strides {t.stride()}); "
                                       f"call .contiguous()")
        if t.dim() == 3 and t.shape[0] > 1 and t.stride(0) < (t.shape[1] - 1) * t.stride(1) + t.shape[2]:
            raise InvalidArgumentError(f"{name}: expert slices overlap (strides {t.stride()}); call .contiguous()")
    return t


def eps(value) -> float:
    """[1e-30, 1e30]: every scale stays a normal fp32 number and every multiplier finite."""
    if (not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value)
            or not 1e-30 <= value <= 1e30):
        raise InvalidArgumentError(f"eps must be a number in [1e-30, 1e30], got {shown(value)}")
    return float(value)


def scale(value) -> str:
    return choice(value, "scale", SCALES)


def choice(value, name: str, allowed: tuple):
    """One of ``allowed`` (strings or numbers; a bool never matches a number)."""
    if isinstance(value, bool) or isinstance(value, torch.Tensor) or value not in allowed:
        raise InvalidArgumentError(f"{name} must be {_listed(allowed)}, got {shown(value)}")
    return value


def int_choice(value, name: str, allowed: tuple[int, ...]) -> int:
    """An int (not a float or a bool) from ``allowed``."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value not in allowed:
        raise InvalidArgumentError(f"{name} must be the int {_listed(allowed)}, got {shown(value)}")
    return int(value)


def flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be True or False, got {shown(value)}")
    return value


def mapping(value, name: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(f"{name} must be a mapping (a dict), got {shown(value)}")
    return value


def _shape_pair(weight_shape) -> tuple[int, int]:
    if isinstance(weight_shape, torch.Tensor):
        if weight_shape.dim() != 1 or weight_shape.is_floating_point() or weight_shape.is_complex():
            raise InvalidArgumentError(f"weight_shape must be [N, K] (two ints), got {shown(weight_shape)}")
        weight_shape = weight_shape.tolist()
    if isinstance(weight_shape, (str, bytes)) or not hasattr(weight_shape, "__len__") or len(weight_shape) != 2:
        raise InvalidArgumentError(f"weight_shape must be [N, K] (two ints), got {shown(weight_shape)}")
    vals = list(weight_shape)
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 0 for v in vals):
        raise InvalidArgumentError(f"weight_shape must be [N, K] (two non-negative ints), got {shown(weight_shape)}")
    return int(vals[0]), int(vals[1])


def int4_unpack_args(weight_packed, weight_scale, weight_shape):
    """(weight_packed, weight_scale, N, K, group) from int4_pack's dict or its three entries."""
    if isinstance(weight_packed, Mapping):
        missing = [k for k in ("weight_packed", "weight_scale", "weight_shape") if k not in weight_packed]
        if missing:
            raise InvalidArgumentError(f"int4_unpack: the dict lacks {', '.join(missing)} (int4_pack returns "
                                       f"weight_packed, weight_scale and weight_shape); it has "
                                       f"{sorted(map(str, weight_packed))}")
        if weight_scale is not None or weight_shape is not None:
            raise InvalidArgumentError("int4_unpack: pass either int4_pack's dict or the three tensors, not both")
        weight_packed, weight_scale, weight_shape = (weight_packed["weight_packed"], weight_packed["weight_scale"],
                                                     weight_packed["weight_shape"])
    tensor(weight_packed, "weight_packed", (2,), torch.int32, why="int4_pack's packed words [N, K/8]")
    tensor(weight_scale, "weight_scale", (2,), torch.bfloat16, why="int4_pack's scales [N, K/group]")
    N, K = _shape_pair(weight_shape)
    if K == 0 or K % 8:
        raise InvalidArgumentError(f"weight_shape {[N, K]}: K must be a positive multiple of 8")
    if tuple(weight_packed.shape) != (N, K // 8):
        raise InvalidArgumentError(f"weight_packed has shape {tuple(weight_packed.shape)}; weight_shape {[N, K]} "
                                   f"needs ({N}, {K // 8})")
    groups = weight_scale.shape[1]
    if weight_scale.shape[0] != N or groups == 0 or K % groups or K // groups not in (32, 64, 128):
        raise InvalidArgumentError(f"weight_scale has shape {tuple(weight_scale.shape)}; weight_shape {[N, K]} "
                                   f"needs ({N}, K/group) with group 32, 64 or 128")
    if weight_scale.device != weight_packed.device:
        raise InvalidArgumentError(f"weight_packed is on {weight_packed.device} but weight_scale on "
                                   f"{weight_scale.device}")
    return weight_packed, weight_scale, N, K, K // groups
