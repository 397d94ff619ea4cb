"""What a weight update sends: which tensors are quantized how, what the serving side calls them, which bucket
each lands in and at which byte offset. A pure function of the trainer's ``(name, shape, dtype)`` list and the
options, so sender and receiver compute the same plan and compare its signature before any byte is used.

Policies:
- Kind per source tensor, first match wins: ``rules`` (``(regex, kind)`` pairs, ``re.search`` on the name), then
  a ``.weight`` tensor in bf16 with 2 dimensions (3 for a stacked MoE [E, N, K], FP8 only) whose name contains
  none of ``ignore`` gets ``default``; everything else is sent raw (its own dtype, its own name). A rule that asks
  for FP8 or INT4 on a tensor the kernel cannot take is an error, never a silent fallback.
- Names as the serving loader expects them: FP8 block ``<m>.weight`` (float8_e4m3fn, the weight's shape) and
  ``<m>.weight_scale_inv`` (float32 ``[.., ceil(N/128), ceil(K/128)]``, the dequant multiplier, UE8M0 powers of
  two with ``scale="ue8m0"``); INT4 (compressed-tensors ``pack-quantized``, as ``ebbtide.quant.export_int4``)
  ``<m>.weight_packed`` int32 [N, K/8], ``<m>.weight_scale`` bf16 [N, K/group], ``<m>.weight_shape`` int32 [2].
- Buckets: source tensors in order, a new bucket when the next one would pass ``bucket_bytes`` of output (a tensor
  larger than the budget gets a bucket of its own; tensors are never split).
- Layout of a bucket (one flat uint8 buffer, no gaps): outputs ordered by the largest power of two (up to 256)
  that divides their byte size, largest first, in plan order within a class. Every output then starts at a
  multiple of its own size's alignment (so at least its dtype's), and the bucket is exactly what SGLang's
  ``FlattenedTensorBucket.empty(names, dtypes, shapes)`` allocates for the same lists: a broadcast of the whole
  bucket lands in place on the serving side.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from collections.abc import Iterable, Mapping

import torch

from ..errors import InvalidArgumentError
from ..quant.export import DEFAULT_IGNORE
from ..quant.layout import Fp8BucketLayout, block_grid, scale_shape

__all__ = ["KINDS", "Output", "Item", "BucketPlan", "Plan", "DEFAULT_BUCKET_BYTES", "dtype_name"]

KINDS = ("fp8", "int4", "raw")
DEFAULT_BUCKET_BYTES = 512 << 20  # slime's --update-weight-buffer-size default
_MAX_ALIGN = 256


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float8_e4m3fn`` -> ``"float8_e4m3fn"`` (the form SGLang's requests carry)."""
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise InvalidArgumentError(f"unknown dtype {name!r}")
    return dt


@dataclasses.dataclass(frozen=True)
class Output:
    """One tensor on the wire: its serving name, dtype name, shape and byte range in its bucket."""

    name: str
    dtype: str
    shape: tuple
    offset: int = 0
    nbytes: int = 0

    def view(self, bucket: torch.Tensor) -> torch.Tensor:
        """This output inside a bucket buffer (uint8)."""
        return bucket[self.offset:self.offset + self.nbytes].view(_dtype(self.dtype)).view(self.shape)


@dataclasses.dataclass(frozen=True)
class Item:
    """One source tensor: how it is sent and what it becomes."""

    source: str
    kind: str
    shape: tuple
    dtype: str
    outputs: tuple  # Output, in the kind's order: fp8 (weight, scale); int4 (packed, scale, shape); raw (tensor,)


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    index: int
    items: tuple  # Item
    nbytes: int
    fp8: Fp8BucketLayout | None  # the FP8 weights of the bucket (experts one entry each), offsets into the bucket

    @property
    def outputs(self) -> list:
        """Every output in wire (offset) order: the order SGLang's request lists must have."""
        return sorted((o for it in self.items for o in it.outputs), key=lambda o: o.offset)

    def request_lists(self) -> tuple[list, list, list]:
        """(names, dtypes, shapes) in wire order, for ``update_weights_from_distributed``."""
        outs = self.outputs
        return [o.name for o in outs], [o.dtype for o in outs], [list(o.shape) for o in outs]


def _align_of(nbytes: int) -> int:
    return _MAX_ALIGN if nbytes == 0 else min(_MAX_ALIGN, nbytes & -nbytes)


def _outputs(name: str, kind: str, shape: tuple, dtype: str, int4_group: int) -> tuple:
    base = name[: -len("weight")] if name.endswith("weight") else name + "."
    if kind == "fp8":
        return (Output(base + "weight", "float8_e4m3fn", shape),
                Output(base + "weight_scale_inv", "float32", scale_shape(shape)))
    if kind == "int4":
        N, K = shape
        return (Output(base + "weight_packed", "int32", (N, K // 8)),
                Output(base + "weight_scale", "bfloat16", (N, K // int4_group)),
                Output(base + "weight_shape", "int32", (2,)))
    return (Output(name, dtype, shape),)


def _sized(o: Output) -> Output:
    n = _dtype(o.dtype).itemsize
    for s in o.shape:
        n *= s
    return dataclasses.replace(o, nbytes=n)


class Plan:
    """The buckets of one model's update. Build with :meth:`build` (from specs) or :meth:`of` (from tensors)."""

    def __init__(self, items: list, buckets: list, *, scale: str, int4_group: int, eps: float, bucket_bytes: int):
        self.items = tuple(items)
        self.buckets = tuple(buckets)
        self.scale, self.int4_group, self.eps, self.bucket_bytes = scale, int4_group, eps, bucket_bytes
        self.nbytes = sum(b.nbytes for b in self.buckets)  # bytes of the whole update on the wire
        self.max_bucket_bytes = max((b.nbytes for b in self.buckets), default=0)
        self.source_bytes = sum(_dtype(it.dtype).itemsize * math.prod(it.shape) for it in self.items)  # e.g. bf16
        h = hashlib.sha256(repr((scale, int4_group, eps, [(b.index, [(i.source, i.kind, i.shape, i.dtype,
                                                                      i.outputs) for i in b.items])
                                                          for b in self.buckets])).encode())
        self.signature = h.hexdigest()  # equal plans, equal signatures: both ends compare it

    def bucket_offsets(self) -> list:
        """Byte offset of each bucket when the whole update sits in one buffer (receiver staging, host buffer)."""
        out, o = [], 0
        for b in self.buckets:
            out.append(o)
            o += b.nbytes
        return out

    def __repr__(self) -> str:
        kinds = {k: sum(1 for i in self.items if i.kind == k) for k in KINDS}
        return (f"Plan({len(self.items)} tensors {kinds}, {len(self.buckets)} buckets, {self.nbytes} B, "
                f"scale={self.scale})")

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor] | Iterable, **options) -> "Plan":
        """The plan for named tensors (a mapping or ``(name, tensor)`` pairs, e.g. ``model.named_parameters()``)."""
        pairs = tensors.items() if isinstance(tensors, Mapping) else tensors
        specs = []
        for pair in pairs:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise InvalidArgumentError(f"tensors must be a mapping or (name, tensor) pairs, got an item {pair!r}")
            name, t = pair
            if not isinstance(t, torch.Tensor):
                raise InvalidArgumentError(f"{name!r}: not a tensor ({type(t).__name__})")
            specs.append((name, tuple(t.shape), t.dtype))
        return cls.build(specs, **options)

    @classmethod
    def build(cls, specs: Iterable, *, default: str = "fp8", rules: Iterable = (),
              ignore: Iterable[str] = DEFAULT_IGNORE, scale: str = "fp32", int4_group: int = 128,
              eps: float = 1e-4, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> "Plan":
        """``specs``: ``(name, shape, dtype)`` of every tensor to send, in order. See the module policies."""
        if default not in KINDS:
            raise InvalidArgumentError(f"default must be one of {KINDS}, got {default!r}")
        if scale not in ("fp32", "ue8m0"):
            raise InvalidArgumentError(f"scale must be 'fp32' or 'ue8m0', got {scale!r}")
        if int4_group not in (32, 64, 128):
            raise InvalidArgumentError(f"int4_group must be 32, 64 or 128, got {int4_group!r}")
        if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise InvalidArgumentError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        try:
            rules = [(re.compile(p), k) for p, k in rules]
        except (TypeError, ValueError, re.error) as e:
            raise InvalidArgumentError(f"rules must be (regex, kind) pairs: {e}") from None
        for _, k in rules:
            if k not in KINDS:
                raise InvalidArgumentError(f"rule kind must be one of {KINDS}, got {k!r}")
        ignore = tuple(ignore)
        items, seen = [], set()
        for name, shape, dtype in specs:
            shape = tuple(int(s) for s in shape)
            dt = dtype if isinstance(dtype, str) else dtype_name(dtype)
            _dtype(dt)
            if name in seen:
                raise InvalidArgumentError(f"tensor {name!r} appears twice")
            seen.add(name)
            kind = next((k for p, k in rules if p.search(name)), None)
            forced = kind is not None
            if kind is None:
                auto = (name.endswith(".weight") and dt == "bfloat16" and not any(s in name for s in ignore)
                        and (len(shape) == 2 or (len(shape) == 3 and default == "fp8")))
                kind = default if auto else "raw"
            if kind == "fp8" and (dt != "bfloat16" or len(shape) not in (2, 3) or 0 in shape):
                raise InvalidArgumentError(f"{name}: FP8 block quant takes bf16 [N, K] or [E, N, K] "
                                           f"(got {dt} {shape})" + (" (chosen by a rule)" if forced else ""))
            if kind == "int4" and (dt != "bfloat16" or len(shape) != 2 or shape[1] % int4_group or 0 in shape):
                raise InvalidArgumentError(f"{name}: INT4 takes bf16 [N, K] with K a multiple of the group "
                                           f"{int4_group} (got {dt} {shape})")
            outs = tuple(_sized(o) for o in _outputs(name, kind, shape, dt, int4_group))
            items.append(Item(name, kind, shape, dt, outs))
        names = [o.name for it in items for o in it.outputs]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise InvalidArgumentError(f"two tensors would be sent under the same name: {dup[:4]}")
        groups, cur, size = [], [], 0
        for it in items:
            n = sum(o.nbytes for o in it.outputs)
            if cur and size + n > bucket_bytes:
                groups.append(cur)
                cur, size = [], 0
            cur.append(it)
            size += n
        if cur:
            groups.append(cur)
        buckets = [_place(i, g) for i, g in enumerate(groups)]
        return cls(items, buckets, scale=scale, int4_group=int4_group, eps=float(eps), bucket_bytes=bucket_bytes)


def _place(index: int, items: list) -> BucketPlan:
    outs = [(it_i, o_i, o) for it_i, it in enumerate(items) for o_i, o in enumerate(it.outputs)]
    order = sorted(range(len(outs)), key=lambda j: -_align_of(outs[j][2].nbytes))  # stable within a class
    placed = {}
    off = 0
    for j in order:
        it_i, o_i, o = outs[j]
        placed[(it_i, o_i)] = dataclasses.replace(o, offset=off)
        off += o.nbytes
    new_items = [dataclasses.replace(it, outputs=tuple(placed[(it_i, o_i)] for o_i in range(len(it.outputs))))
                 for it_i, it in enumerate(items)]
    fp8 = fp8_entries(new_items)
    return BucketPlan(index, tuple(new_items), off, Fp8BucketLayout.at(fp8) if fp8 else None)


def fp8_entries(items) -> list:
    """The FP8 layout entries ``(q_offset, scale_offset, N, K)`` of the placed ``items``' FP8 weights, in order (a
    stacked MoE weight one entry per expert): a bucket's layout, or a part of it."""
    fp8 = []
    for it in items:
        if it.kind == "fp8":
            po = it.outputs
            *lead, N, K = it.shape
            nb, kb = block_grid(N, K)
            for e in range(lead[0] if lead else 1):
                fp8.append((po[0].offset + e * N * K, po[1].offset + 4 * e * nb * kb, N, K))
    return fp8
