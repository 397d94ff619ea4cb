"""ebbtide.quant — FP8 (e4m3, 128x128 block / 1x128 group, fp32 or UE8M0 scales) and INT4 (W4A16 symmetric group,
QAT fake-quant bitwise identical to the served weight) under one pinned numerics contract (docs/quant.md).

Policies:
- One contract, several implementations: CPU tensors run the reference (ebbtide.quant.reference, the oracle);
  CUDA tensors run the native kernels, which match it with zero mismatching bytes and scales (tests/quant); the sm90
  or the portable variant, chosen per GPU in one place (_dispatch.py; EBBTIDE_QUANT_KERNELS).
- Inputs are bf16 — the exact values being exported, never an fp32 master (quantizing the master is a known
  cause of train/serve drift). Any row stride is accepted; the last dimension must be contiguous.
- Bad input raises InvalidArgumentError (a ValueError) naming the argument and the value passed, before anything
  runs; nothing is modified in place. The rules are listed in ``ebbtide.quant._checks``.
- CUDA calls are asynchronous on torch's current stream of the input's device, like any torch op.
- Non-finite inputs poison their block/group (NaN scale, e4m3 0x7F; INT4: NaN scale, q 0, NaN output); see
  reference.py, Note [Non-finite inputs].
"""
from __future__ import annotations

import torch

from ..errors import InvalidArgumentError
from . import _checks, _cuda
from . import reference as _ref
from .layout import Fp8BucketLayout

__all__ = ["fp8_block_quant", "fp8_block_quant_list", "fp8_block_quant_into", "fp8_group_quant",
           "fp8_block_dequant", "int4_fake_quant", "int4_pack", "int4_unpack", "Fp8Bucket"]

# ---- validation: the rules live in _checks.py (these names are kept for callers inside the package) ---------
_check_tensor = _checks.tensor
_check_eps = _checks.eps
_check_scale = _checks.scale
_check_fixed = _checks.choice


# ---- FP8 -----------------------------------------------------------------------------------------------------
def fp8_block_quant(w: torch.Tensor, block: int = 128, scale: str = "fp32", eps: float = 1e-4):
    """128x128 block FP8 quant of a bf16 weight [N, K] or a MoE batch [E, N, K] (one launch; blocks never straddle
    experts; ragged N and K allowed).

    Returns (q, scale): q float8_e4m3fn with w's shape; scale
      "fp32" / "ue8m0": float32 [(E,) ceil(N/128), ceil(K/128)] (HF `weight_scale_inv`; UE8M0 holds powers of 2),
      "ue8m0_packed":   int32 [(E,) N, ceil(K/512)] DeepGEMM SFB layout (per-row, MN-major, TMA-aligned).
    """
    _check_tensor(w, "w", (2, 3))
    block = _checks.int_choice(block, "block", (128,))
    scale, eps = _check_scale(scale), _check_eps(eps)
    if w.device.type == "cpu":
        return _ref.fp8_block_quant(w, block, scale, eps)
    return _cuda.fp8_block_quant(w, scale, eps)


class Fp8Bucket:
    """The output of fp8_block_quant_list: every tensor's q and scale as views into two flat buffers (the
    transfer bucket). ``q[i]`` is float8_e4m3fn [N_i, K_i]; ``scale[i]`` float32 [ceil(N_i/128), ceil(K_i/128)].
    Offsets are ``layout`` (``Fp8BucketLayout.packed``: each q at a 16-byte aligned offset of ``q_buffer``). The views are made on first use (building
    200 views costs about as much host time as a 100-tensor bucket costs GPU time)."""

    def __init__(self, q_buffer, scale_buffer, q=None, scale=None, *, layout: Fp8BucketLayout | None = None):
        self.q_buffer, self.scale_buffer = q_buffer, scale_buffer
        self._layout, self._q, self._scale = layout, q, scale

    @property
    def layout(self) -> Fp8BucketLayout | None:
        """Where each tensor sits in the two buffers (``ebbtide.quant.layout``)."""
        return self._layout

    def _views(self):
        if self._q is None:
            self._q, self._scale = self._layout.views(self.q_buffer, self.scale_buffer)

    @property
    def q(self) -> list:
        self._views()
        return self._q

    @property
    def scale(self) -> list:
        self._views()
        return self._scale

    def __len__(self):
        return len(self._layout) if self._q is None else len(self._q)

    def __iter__(self):
        return iter(zip(self.q, self.scale))


def _check_list(tensors) -> list:
    if isinstance(tensors, torch.Tensor) or not hasattr(tensors, "__iter__"):
        raise InvalidArgumentError(f"tensors must be a list of bf16 2-D tensors, got {_checks.shown(tensors)}")
    tensors = list(tensors)
    if not tensors:
        raise InvalidArgumentError("fp8_block_quant_list needs at least one tensor")
    dev0 = getattr(tensors[0], "device", None)
    bf16 = torch.bfloat16
    # fast screen (a few attribute reads per tensor; weight sync passes hundreds), then the detailed checks that
    # raise with the reason only when something is off
    if not all(isinstance(t, torch.Tensor) and t.dtype == bf16 and t.dim() == 2 and t.device == dev0
               and t.numel() > 0 and t.stride(-1) == 1 for t in tensors):
        for i, t in enumerate(tensors):
            _check_tensor(t, f"tensors[{i}]", (2,))
            if t.device != tensors[0].device:
                raise InvalidArgumentError(f"tensors[{i}] is on {t.device}, tensors[0] on {tensors[0].device}: "
                                           f"one bucket lives on one device")
            if t.numel() == 0:
                raise InvalidArgumentError(f"tensors[{i}] is empty (shape {tuple(t.shape)})")
    if dev0.type not in ("cpu", "cuda"):
        _check_tensor(tensors[0], "tensors[0]", (2,))
    return tensors


def _reference_into(tensors, layout: Fp8BucketLayout, q_buffer, scale_buffer, scale: str, eps: float) -> None:
    qs, ss = layout.views(q_buffer, scale_buffer)
    for t, qv, sv in zip(tensors, qs, ss):
        q, s = _ref.fp8_block_quant(t, 128, scale, eps)
        qv.view(torch.uint8).copy_(q.view(torch.uint8))
        sv.copy_(s)


def fp8_block_quant_list(tensors, scale: str = "fp32", eps: float = 1e-4) -> Fp8Bucket:
    """Block-quantize a list of bf16 2-D tensors of different shapes into one output bucket — one kernel launch
    for the whole list on CUDA (weight sync). Bits equal fp8_block_quant of each tensor. The bucket's layout is
    ``Fp8BucketLayout.packed`` of the shapes."""
    tensors = _check_list(tensors)
    _check_fixed(scale, "scale (packed UE8M0 has no flat bucket layout)", ("fp32", "ue8m0"))
    eps = _check_eps(eps)
    if tensors[0].device.type == "cuda":
        q_buf, s_buf, layout = _cuda.fp8_block_quant_list(tensors, scale, eps)
        return Fp8Bucket(q_buf, s_buf, layout=layout)
    layout = Fp8BucketLayout.packed([t.shape for t in tensors])
    q_buf = torch.zeros(layout.q_bytes, dtype=torch.uint8)
    s_buf = torch.empty(layout.scale_bytes // 4, dtype=torch.float32)
    _reference_into(tensors, layout, q_buf, s_buf, scale, eps)
    return Fp8Bucket(q_buf, s_buf, layout=layout)


def fp8_block_quant_into(tensors, layout: Fp8BucketLayout, q_buffer: torch.Tensor, scale_buffer: torch.Tensor,
                         scale: str = "fp32", eps: float = 1e-4) -> Fp8Bucket:
    """``fp8_block_quant_list`` into buffers the caller owns, at the offsets of ``layout`` (``Fp8BucketLayout.at``
    places tensors anywhere; ``q_buffer`` and ``scale_buffer`` may be one uint8 buffer). One launch on CUDA,
    asynchronous on the current stream; bytes outside the layout's entries are left as they were."""
    tensors, eps = check_into(tensors, layout, q_buffer, scale_buffer, scale, eps)
    if tensors[0].device.type == "cuda":
        _cuda.fp8_block_quant_into(tensors, layout, q_buffer, scale_buffer, scale, eps)
    else:
        _reference_into(tensors, layout, q_buffer, scale_buffer, scale, eps)
    return Fp8Bucket(q_buffer, scale_buffer, layout=layout)


def check_into(tensors, layout, q_buffer, scale_buffer, scale, eps) -> tuple[list, float]:
    """``fp8_block_quant_into``'s argument checks (raising ``InvalidArgumentError`` with the reason); returns the
    tensors as a list and eps as a float."""
    tensors = _check_list(tensors)
    _check_fixed(scale, "scale (packed UE8M0 has no flat bucket layout)", ("fp32", "ue8m0"))
    eps = _check_eps(eps)
    if not isinstance(layout, Fp8BucketLayout) or len(layout) != len(tensors):
        raise InvalidArgumentError(f"layout must be an Fp8BucketLayout with one entry per tensor "
                                   f"({len(tensors)}), got {layout!r}")
    for i, (t, (_, _, N, K)) in enumerate(zip(tensors, layout.entries)):
        if tuple(t.shape) != (N, K):
            raise InvalidArgumentError(f"tensors[{i}] has shape {tuple(t.shape)}, the layout entry {(N, K)}")
    for name, buf, need in (("q_buffer", q_buffer, layout.q_bytes), ("scale_buffer", scale_buffer,
                                                                        layout.scale_bytes)):
        if not isinstance(buf, torch.Tensor) or not buf.is_contiguous() or buf.dim() != 1:
            raise InvalidArgumentError(f"{name} must be a contiguous 1-D tensor")
        if buf.device != tensors[0].device:
            raise InvalidArgumentError(f"{name} is on {buf.device}, the tensors on {tensors[0].device}")
        if buf.numel() * buf.element_size() < need:
            raise InvalidArgumentError(f"{name} has {buf.numel() * buf.element_size()} bytes, the layout needs {need}")
    if scale_buffer.data_ptr() % 4:
        raise InvalidArgumentError("scale_buffer must be 4-byte aligned")
    return tensors, eps


def fp8_group_quant(x: torch.Tensor, group: int = 128, scale_layout: str = "row", scale: str = "fp32",
                    eps: float = 1e-10):
    """1 x 128 per-token-group FP8 quant of bf16 activations [..., K] (K % 128 == 0).

    Returns (q, scale): q float8_e4m3fn with x's shape; scale over M = prod(leading dims) tokens:
      scale_layout "row":      float32 [M, K/128] contiguous;
      scale_layout "mn_major": float32 logical [M, K/128] with strides (1, align(M, 4)) (DeepGEMM SFA);
      scale "ue8m0_packed" (needs "mn_major"): int32 [M, ceil(K/512)], strides (1, align(M, 4)).
    """
    _check_tensor(x, "x", tuple(range(2, 9)))
    group = _checks.int_choice(group, "group", (128,))
    _check_fixed(scale_layout, "scale_layout", ("row", "mn_major"))
    scale, eps = _check_scale(scale), _check_eps(eps)
    K = x.shape[-1]
    if K == 0 or K % group:
        raise InvalidArgumentError(f"x has shape {tuple(x.shape)}: its last dimension must be a positive multiple "
                                   f"of the group size {group}")
    if scale == "ue8m0_packed" and scale_layout != "mn_major":
        raise InvalidArgumentError("packed UE8M0 scales are MN-major by definition: pass scale_layout='mn_major'")
    x2 = x.reshape(-1, K)
    if x.device.type == "cpu":
        q, s = _ref.fp8_group_quant(x2, group, scale_layout, scale, eps)
    else:
        q, s = _cuda.fp8_group_quant(x2, scale_layout, scale, eps)
    return q.view(x.shape), s


def fp8_block_dequant(q: torch.Tensor, scale: torch.Tensor, block: int = 128, *,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 = RNbf16(RN32(float(q) * s)) for block-quantized weights: q float8_e4m3fn [(E,) N, K], scale float32
    [(E,) ceil(N/128), ceil(K/128)] (fp32 or UE8M0 values; unpack packed UE8M0 with reference.ue8m0_unpack).
    ``out`` (bf16, q's shape and device): written in place and returned, the same bits (a receiver dequantizes
    straight into its parameter: no temporary, no second copy); on CUDA it must be contiguous."""
    _checks.tensor(q, "q", (2, 3), torch.float8_e4m3fn, why="fp8_block_quant's q [N, K] or [E, N, K]")
    block = _checks.int_choice(block, "block", (128,))
    want = (*q.shape[:-2], -(-q.shape[-2] // 128), -(-q.shape[-1] // 128))
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or tuple(scale.shape) != want:
        got = (scale.dtype, tuple(scale.shape)) if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise InvalidArgumentError(f"scale must be float32 of shape {want}, got {got}")
    if scale.device != q.device:
        raise InvalidArgumentError(f"q is on {q.device} but scale on {scale.device}")
    if out is not None:
        if (not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16 or out.shape != q.shape
                or out.device != q.device or (q.device.type == "cuda" and not out.is_contiguous())):
            got = (f"{out.dtype} {tuple(out.shape)} on {out.device}, contiguous {out.is_contiguous()}"
                   if isinstance(out, torch.Tensor) else type(out).__name__)
            raise InvalidArgumentError(f"out must be bfloat16 of shape {tuple(q.shape)} on {q.device} (contiguous "
                                       f"on CUDA), got {got}")
    if q.device.type == "cpu":
        ref = _ref.fp8_block_dequant(q, scale, block)
        return ref if out is None else out.copy_(ref)
    return _cuda.fp8_block_dequant(q.contiguous(), scale.contiguous(), out)


# ---- INT4 ----------------------------------------------------------------------------------------------------
def _check_int4(w, group, divisor, eps) -> float:
    _check_tensor(w, "w", (2,))
    _checks.int_choice(group, "group", (32, 64, 128))
    _check_fixed(divisor, "divisor", (7, 7.5))
    if w.shape[1] % group:
        raise InvalidArgumentError(f"w has shape {tuple(w.shape)}: its last dimension (K) must be a multiple of "
                                   f"the group size {group}")
    return _check_eps(eps)


def _int4_quant(w, group, divisor, eps, *, fake_quant: bool, pack: bool):
    """(fake_quant bf16 | None, packed int32 | None, scale bf16) — the one path both QAT and export take."""
    if w.device.type == "cpu":
        q, s_bits = _ref.int4_quant(w, group, divisor, eps)
        fq = _ref.int4_dequant(q, s_bits, group) if fake_quant else None
        packed = _ref.int4_pack(q) if pack else None
        return fq, packed, _ref.bf16_from_bits(s_bits)
    return _cuda.int4_quant(w, group, divisor, eps, fake_quant=fake_quant, pack=pack)


class _Int4FakeQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, group, divisor, eps, clip_ste):
        fq, _, s = _int4_quant(w.detach(), group, divisor, eps, fake_quant=True, pack=False)
        ctx.clip_ste = clip_ste
        if clip_ste:
            ctx.save_for_backward(w, s)
            ctx.group, ctx.divisor = group, divisor
        return fq

    @staticmethod
    def backward(ctx, grad):
        if not ctx.clip_ste:
            return grad, None, None, None, None
        w, s = ctx.saved_tensors
        qmin, qmax = _ref.int4_qrange(ctx.divisor)
        r = w.float() / s.float().repeat_interleave(ctx.group, dim=1)
        keep = (r >= qmin - 0.5) & (r <= qmax + 0.5)
        return grad * keep.to(grad.dtype), None, None, None, None


def int4_fake_quant(w: torch.Tensor, group: int = 128, divisor: float = 7, eps: float = 1e-5,
                    clip_ste: bool = False) -> torch.Tensor:
    """INT4 QAT fake-quant of a bf16 weight [N, K]: forward RNbf16(q * s) with s rounded to bf16 first —
    bitwise equal to the weight the server dequantizes from int4_pack(w). Backward: straight-through (identity),
    or with clip_ste=True zero where x/s falls outside [qmin - 0.5, qmax + 0.5]; never changes forward bits."""
    eps = _check_int4(w, group, divisor, eps)
    return _Int4FakeQuant.apply(w, int(group), divisor, eps, _checks.flag(clip_ste, "clip_ste"))


def int4_pack(w: torch.Tensor, group: int = 128, divisor: float = 7, eps: float = 1e-5) -> dict:
    """Export a bf16 weight [N, K] in compressed-tensors `pack-quantized` form (what SGLang/vLLM load and serve
    through Marlin): {"weight_packed": int32 [N, K/8] (element 8j+i in bits 4i..4i+3 of word j, stored q + 8),
    "weight_scale": bf16 [N, K/group], "weight_shape": int32 [2] (on the CPU)}. Same kernel as int4_fake_quant."""
    eps = _check_int4(w, group, divisor, eps)
    _, packed, s = _int4_quant(w, int(group), divisor, eps, fake_quant=False, pack=True)
    return {"weight_packed": packed, "weight_scale": s,
            "weight_shape": torch.tensor(list(w.shape), dtype=torch.int32)}


def int4_unpack(weight_packed, weight_scale: torch.Tensor | None = None, weight_shape=None, *,
                return_q: bool = False):
    """The served weight RNbf16(q * s) (Marlin's dequant) from int4_pack's output (a dict, or its three entries).
    With return_q=True returns (weight, q int8 [N, K])."""
    weight_packed, weight_scale, N, K, group = _checks.int4_unpack_args(weight_packed, weight_scale, weight_shape)
    _checks.flag(return_q, "return_q")
    if weight_packed.device.type == "cpu":
        q = _ref.int4_unpack_q(weight_packed, K)
        out = _ref.int4_dequant(q, _ref.bf16_bits(weight_scale), group)
        return (out, torch.from_numpy(q)) if return_q else out
    out, q = _cuda.int4_unpack(weight_packed.contiguous(), weight_scale.contiguous(), N, K, group, want_q=return_q)
    return (out, q) if return_q else out
