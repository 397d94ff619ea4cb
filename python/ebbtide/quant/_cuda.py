"""CUDA tensors -> the native quant kernels (ebbtide._C.quant). Arguments are validated by the caller (api.py) and
again natively; this module only allocates outputs, passes pointers/strides/the current stream, and shapes the
results. Every launch is asynchronous on torch's current stream of the tensor's device; which variant of a kernel
runs (sm90 or portable) is _dispatch.select's choice for the tensor's device."""
from __future__ import annotations

import torch

from . import _dispatch
from .layout import Fp8BucketLayout

MODES = {"fp32": 0, "ue8m0": 1, "ue8m0_packed": 2}
LAYOUTS = {"row": 0, "mn_major": 1}
PARAM_ENTRIES = 128  # quant/launchers.h kBlockListParamEntries: longer lists need a device copy of the table


def _q():
    return _dispatch.native()


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


def _align4(x: int) -> int:
    return (x + 3) // 4 * 4


def packed_scale_buffer(lead: int, mn: int, groups: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, logical view [lead, mn, ceil(groups/4)] with strides (W*A, 1, A)) for packed UE8M0 scales."""
    W, A = -(-groups // 4), _align4(mn)
    buf = torch.empty(lead * W * A, dtype=torch.int32, device=device)
    return buf, buf.as_strided((lead, mn, W), (W * A, 1, A))


def fp8_block_quant(w: torch.Tensor, scale: str, eps: float):
    squeeze = w.dim() == 2
    w3 = w.unsqueeze(0) if squeeze else w
    E, N, K = w3.shape
    nb, kb = -(-N // 128), -(-K // 128)
    q = torch.empty((E, N, K), dtype=torch.float8_e4m3fn, device=w.device)
    if scale == "ue8m0_packed":
        _, s = packed_scale_buffer(E, N, kb, w.device)
    else:
        s = torch.empty((E, nb, kb), dtype=torch.float32, device=w.device)
    with torch.cuda.device(w.device):
        _q().fp8_block_quant(src=w3.data_ptr(), experts=E, rows=N, cols=K, ld=w3.stride(1),
                             expert_stride=w3.stride(0), q=q.data_ptr(), scale=s.data_ptr(),
                             scale_mode=MODES[scale], eps=eps,
                             variant=_dispatch.select("fp8_block_quant", w.device), stream=_stream(w))
    return (q[0], s[0]) if squeeze else (q, s)


def fp8_block_quant_list(tensors: list[torch.Tensor], scale: str, eps: float):
    """All tensors (bf16 2D, same device) in one launch into two new buffers laid out by
    ``Fp8BucketLayout.packed``. Returns (q_buffer uint8, scale_buffer fp32, layout)."""
    layout = Fp8BucketLayout.packed([w.shape for w in tensors])
    device = tensors[0].device
    q_buf = torch.empty(layout.q_bytes, dtype=torch.uint8, device=device)
    s_buf = torch.empty(layout.scale_bytes // 4, dtype=torch.float32, device=device)
    fp8_block_quant_into(tensors, layout, q_buf, s_buf, scale, eps)
    return q_buf, s_buf, layout


def list_table(tensors: list[torch.Tensor], layout: Fp8BucketLayout, qp: int, sp: int, scale: str) -> torch.Tensor:
    """The list kernel's entry table (int64 [count, 8], CPU) for ``tensors`` at ``layout``'s offsets from the q and
    scale buffer addresses ``qp`` / ``sp``."""
    mode = MODES[scale]
    flat = []
    # BlockListEntry: src, q, scale, ld, rows, cols, tile_begin, mode
    for w, (a, b, N, K), t in zip(tensors, layout.entries, layout.tile_begin):
        flat += (w.data_ptr(), qp + a, sp + b, w.stride(0), N, K, t, mode)
    return torch.tensor(flat, dtype=torch.int64)


def launch_list(host: torch.Tensor, dev: torch.Tensor | None, count: int, eps: float, like: torch.Tensor) -> None:
    """One list-kernel launch on ``like``'s device and current stream: the table travels in the launch (up to
    PARAM_ENTRIES entries, ``dev`` None) or is read from ``dev``, a device copy of ``host``."""
    with torch.cuda.device(like.device):
        _q().fp8_block_quant_list(host_entries=host.data_ptr(), device_entries=0 if dev is None else dev.data_ptr(),
                                  count=count, eps=eps, variant=_dispatch.select("fp8_block_quant_list", like.device),
                                  stream=_stream(like))


def fp8_block_quant_into(tensors: list[torch.Tensor], layout: Fp8BucketLayout, q_buf: torch.Tensor,
                         s_buf: torch.Tensor, scale: str, eps: float) -> None:
    """One launch that quantizes ``tensors[i]`` to ``layout.entries[i]`` of ``q_buf`` / ``s_buf`` (which may be
    the same buffer). Host work per tensor is a few attribute reads and one table row; a caller that sends the
    same tensors again keeps the table (``prepared.Fp8BucketQuant``)."""
    table = list_table(tensors, layout, q_buf.data_ptr(), s_buf.data_ptr(), scale)
    # up to PARAM_ENTRIES the table travels inside the launch: no copy ahead of the kernel
    dev_table = upload(table.pin_memory(), tensors[0].device) if len(tensors) > PARAM_ENTRIES else None
    launch_list(table, dev_table, len(tensors), eps, tensors[0])


def upload(pinned: torch.Tensor, device) -> torch.Tensor:
    """A device copy of the pinned table ``pinned``, ordered on the current stream: pinned, so the copy is truly
    asynchronous (torch's host allocator keeps the block until it completed); the device block is released
    stream-ordered after the launch that reads it."""
    with torch.cuda.device(device):
        return pinned.to(device, non_blocking=True)


def segment_table(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> torch.Tensor:
    """The copy kernel's segment table (int64 [count, 4], CPU): dst, src, bytes, first chunk."""
    chunk = _q().COPY_SEGMENT_CHUNK
    flat, c = [], 0
    for d, s in zip(dsts, srcs):
        n = d.numel() * d.element_size()
        flat += (d.data_ptr(), s.data_ptr(), n, c)
        c += -(-n // chunk)
    return torch.tensor(flat, dtype=torch.int64)


def check_segments(device) -> None:
    """UnsupportedError where the copy kernel cannot run on ``device`` (SegmentCopy then copies per segment)."""
    _dispatch.select("copy_segments", torch.device(device))


def launch_segments(host: torch.Tensor, dev: torch.Tensor, count: int, device) -> None:
    check_segments(device)
    with torch.cuda.device(device):
        _q().copy_segments(host_segments=host.data_ptr(), device_segments=dev.data_ptr(), count=count,
                           stream=torch.cuda.current_stream(device).cuda_stream)


def fp8_block_dequant(q: torch.Tensor, s: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out``: a contiguous bf16 tensor of q's shape on q's device (checked by the caller), written in place."""
    squeeze = q.dim() == 2
    q3 = q.unsqueeze(0) if squeeze else q
    E, N, K = q3.shape
    if out is None:
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    with torch.cuda.device(q.device):
        fp8_block_dequant_at([(q3.data_ptr(), s.data_ptr(), E, N, K, out.data_ptr())], q.device)
    return out


def fp8_block_dequant_at(launches, device) -> None:
    """FP8 block dequant launches at raw addresses on ``device`` (torch's current stream there): each
    ``(q, scale, experts, rows, cols, out)`` as ``fp8_block_dequant`` passes them, unchecked (a receiver that
    validated its layout once launches these every update without rebuilding tensors)."""
    Q = _q()
    device = torch.device(device)
    variant = _dispatch.select("fp8_block_dequant", device)
    stream = torch.cuda.current_stream(device).cuda_stream
    for q, s, E, N, K, out in launches:
        Q.fp8_block_dequant(q=q, scale=s, experts=E, rows=N, cols=K, out=out, variant=variant, stream=stream)


def fp8_group_quant(x: torch.Tensor, scale_layout: str, scale: str, eps: float):
    M, K = x.shape
    G = K // 128
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    if scale == "ue8m0_packed":
        _, s3 = packed_scale_buffer(1, M, G, x.device)
        s = s3[0]
    elif scale_layout == "mn_major":
        A = _align4(M)
        s = torch.empty(G * A, dtype=torch.float32, device=x.device).as_strided((M, G), (1, A))
    else:
        s = torch.empty((M, G), dtype=torch.float32, device=x.device)
    with torch.cuda.device(x.device):
        _q().fp8_group_quant(src=x.data_ptr(), rows=M, cols=K, ld=x.stride(0), group=128, q=q.data_ptr(),
                             scale=s.data_ptr(), scale_mode=MODES[scale], scale_layout=LAYOUTS[scale_layout],
                             eps=eps, variant=_dispatch.select("fp8_group_quant", x.device), stream=_stream(x))
    return q, s


def int4_quant(w: torch.Tensor, group: int, divisor: float, eps: float, *, fake_quant: bool, pack: bool):
    """THE INT4 kernel call: the QAT forward (fake_quant=True) and the exporter (pack=True) both come here.
    Returns (fake_quant bf16 | None, packed int32 | None, scale bf16)."""
    N, K = w.shape
    fq = torch.empty((N, K), dtype=torch.bfloat16, device=w.device) if fake_quant else None
    packed = torch.empty((N, K // 8), dtype=torch.int32, device=w.device) if pack else None
    s = torch.empty((N, K // group), dtype=torch.bfloat16, device=w.device)
    _dispatch.select("int4_quant", w.device)  # raises where this GPU cannot run it
    with torch.cuda.device(w.device):
        _q().int4_quant(src=w.data_ptr(), rows=N, cols=K, ld=w.stride(0), group=group,
                        divisor_x2=int(round(divisor * 2)), eps=eps,
                        fake_quant=fq.data_ptr() if fq is not None else 0,
                        packed=packed.data_ptr() if packed is not None else 0, scale=s.data_ptr(),
                        stream=_stream(w))
    return fq, packed, s


def int4_unpack(packed: torch.Tensor, s: torch.Tensor, N: int, K: int, group: int, *, want_q: bool):
    out = torch.empty((N, K), dtype=torch.bfloat16, device=packed.device)
    q = torch.empty((N, K), dtype=torch.int8, device=packed.device) if want_q else None
    _dispatch.select("int4_unpack", packed.device)  # raises where this GPU cannot run it
    with torch.cuda.device(packed.device):
        _q().int4_unpack(packed=packed.data_ptr(), scale=s.data_ptr(), rows=N, cols=K, group=group,
                         out=out.data_ptr(), q=q.data_ptr() if q is not None else 0, stream=_stream(packed))
    return out, q


def fp8_encode(x: torch.Tensor) -> torch.Tensor:
    """E4M3 (satfinite) bytes of a contiguous fp32 CUDA tensor with the selected variant's conversion alone (the
    test that the portable software conversion equals the sm90 instruction; quant/f32_fp8_encode.cu)."""
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    with torch.cuda.device(x.device):
        _q().f32_fp8_encode(src=x.data_ptr(), n=x.numel(), dst=out.data_ptr(),
                            variant=_dispatch.select("fp8_encode", x.device), stream=_stream(x))
    return out
