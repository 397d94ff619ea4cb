"""The portable kernel variant on the GPU, beside the sm90 one: for every quant kernel (block FP8 with fp32, UE8M0
and packed UE8M0 scales, MoE, the bucket list and its prepared replay, group FP8 in every scale layout, dequant,
INT4 fake-quant / pack / unpack) each variant this GPU runs, forced as ``EBBTIDE_QUANT_KERNELS`` would force it,
gives the reference's bits, so the two give each other's; and the software e4m3 conversion equals the hardware
instruction on every fp32 bit pattern. On an H100/H200 both variants run; on a GPU or build without the sm90
variant (an A100, or a build for 80-virtual only, whose compute_80 PTX the driver compiles for the GPU at hand) the
portable variant is checked against the reference and torch's cast alone."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ebbtide.quant as Q
from ebbtide import settings
from ebbtide.quant import _cuda, _dispatch
from ebbtide.quant import reference as R
from quant_oracle import every_finite_bf16_in_groups, heavy_tailed
from test_quant_kernels_gpu import assert_same, flat, poison_cache, random_bit_patterns, special_bf16, with_nonfinite

pytestmark = pytest.mark.gpu
DEV = "cuda"


def variants_here() -> list:
    d = _dispatch._device_facts(torch.cuda.current_device())
    return (["sm90"] if _dispatch.sm90_loadable(d) else []) + ["portable"]


def each_variant(fn):
    """{variant: fn()'s outputs (tensors, on the CPU)} for every variant this GPU runs."""
    out = {}
    for v in variants_here():
        with _dispatch.forced(v):
            poison_cache()
            res = fn()
        torch.cuda.synchronize()
        res = res if isinstance(res, (tuple, list)) else (res,)
        out[v] = [t.cpu() for t in res]
    return out


def check(outs: dict, want: list, what: str):
    for v, got in outs.items():
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{what} [{v}] output {i}")


def inputs(shape, seed):
    """(kind, bf16 CPU tensor): special values, uniformly random bit patterns (2-D), non-finite values."""
    yield "special", special_bf16(shape, seed=seed)
    if len(shape) == 2:
        yield "bits", random_bit_patterns(shape[0], shape[1], seed)
    yield "nonfinite", with_nonfinite(heavy_tailed(shape, seed=seed + 1))


def test_variants_and_the_setting():
    """The GPU runs what the rules say, and the setting picks the variant end to end."""
    d = _dispatch._device_facts(torch.cuda.current_device())
    rep = Q.kernels()
    assert rep["fp8"] == ("sm90" if _dispatch.sm90_loadable(d) else "portable") and rep["int4"] == "portable"
    mp = pytest.MonkeyPatch()
    try:
        mp.setenv("EBBTIDE_QUANT_KERNELS", "portable")
        settings.reset("EBBTIDE_QUANT_KERNELS")
        assert _dispatch.select("fp8_block_quant", torch.device(DEV, d.index)) == _dispatch.CODES["portable"]
        assert Q.kernels()["fp8"] == "portable"
    finally:
        mp.undo()
        settings.reset("EBBTIDE_QUANT_KERNELS")


# ---- the conversion itself ---------------------------------------------------------------------------------
def all_patterns(lo: int, n: int) -> torch.Tensor:
    u = torch.arange(lo, lo + n, dtype=torch.int64, device=DEV)
    return torch.where(u >= 1 << 31, u - (1 << 32), u).to(torch.int32)


def test_software_e4m3_equals_the_instruction_on_every_fp32_pattern():
    """All 2^32 patterns: the portable variant's conversion against the sm90 variant's cvt.rn.satfinite (where this
    GPU runs it), against torch's cast for |v| <= 448, and the satfinite / NaN rules beyond; then the device code
    against the host build of the same function on a sample."""
    here = variants_here()
    n = 1 << 30
    for lo in range(0, 1 << 32, n):
        u = all_patterns(lo, n)
        f = u.view(torch.float32)
        enc = {}
        for v in here:
            with _dispatch.forced(v):
                enc[v] = _cuda.fp8_encode(f)
        sw = enc["portable"]
        if "sm90" in enc:
            bad = (sw != enc["sm90"]).sum().item()
            assert bad == 0, f"{bad} patterns in [{lo:#x}, {lo + n:#x}) differ between software and instruction"
        a = u & 0x7FFFFFFF
        inside = a <= 0x43E00000
        want = torch.empty_like(sw)
        want[inside] = f[inside].to(torch.float8_e4m3fn).view(torch.uint8)
        nan = a > 0x7F800000
        want[~inside] = torch.where(u[~inside] < 0, 0xFE, 0x7E).to(torch.uint8)
        want[nan] = 0x7F
        bad = (sw != want).sum().item()
        assert bad == 0, f"{bad} patterns in [{lo:#x}, {lo + n:#x}) differ from RN-satfinite"
        del u, f, enc, sw, a, inside, want, nan
    g = np.random.default_rng(0)
    sample = g.integers(0, 1 << 32, size=1 << 24, dtype=np.uint64).astype(np.uint32)
    host = np.empty(sample.size, dtype=np.uint8)
    _cuda._q().e4m3_encode_host(src=sample.ctypes.data, n=sample.size, dst=host.ctypes.data)
    with _dispatch.forced("portable"):
        dev = _cuda.fp8_encode(torch.from_numpy(sample.view(np.int32)).to(DEV).view(torch.float32)).cpu().numpy()
    assert np.array_equal(dev, host)


# ---- every kernel, each variant against the reference ---------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 1), (127, 129), (129, 303), (1000, 520), (3, 200, 300)])
@pytest.mark.parametrize("scale", ["fp32", "ue8m0", "ue8m0_packed"])
def test_block_quant(shape, scale):
    for kind, w in inputs(shape, seed=sum(shape)):
        wd = w.to(DEV)
        outs = each_variant(lambda: [flat(t) if i else t for i, t in enumerate(Q.fp8_block_quant(wd, scale=scale))])
        qr, sr = R.fp8_block_quant(w, scale=scale)
        check(outs, [qr, flat(sr)], f"block {kind} {shape} {scale}")


@pytest.mark.parametrize("offset", [8, 3])  # vector / scalar path
def test_block_quant_strided(offset):
    big = special_bf16((300, 1100), seed=13).to(DEV)
    view = big[:, offset:offset + 1000]
    outs = each_variant(lambda: Q.fp8_block_quant(view))
    check(outs, list(R.fp8_block_quant(view.cpu())), f"block strided {offset}")


@pytest.mark.parametrize("scale", ["fp32", "ue8m0"])
def test_block_list_and_its_prepared_replay(scale):
    g = torch.Generator().manual_seed(2)
    shapes = [(int(torch.randint(1, 400, (1,), generator=g)), int(torch.randint(1, 400, (1,), generator=g)))
              for _ in range(150)]  # > 128 entries: the device table path
    ts = [special_bf16(s, seed=i).to(DEV) for i, s in enumerate(shapes)]
    ts[4] = with_nonfinite(ts[4])
    want = [t for w in ts for t in R.fp8_block_quant(w.cpu(), scale=scale)]
    for sub in (ts, ts[:40]):  # the device table and the table inside the launch
        outs = each_variant(lambda: [t for pair in Q.fp8_block_quant_list(sub, scale=scale) for t in pair])
        check(outs, want[:2 * len(sub)], f"list of {len(sub)} {scale}")
    few = ts[:40]
    layout = Q.Fp8BucketLayout.packed([t.shape for t in few])
    run = Q.Fp8BucketQuant(layout, scale=scale)

    def buffers(device):  # padding bytes stay as they were: start from a pattern
        return (torch.full((layout.q_bytes,), 0x7B, dtype=torch.uint8, device=device),
                torch.full((layout.scale_bytes,), 0x7B, dtype=torch.uint8, device=device))

    def replay():
        q, s = buffers(DEV)
        run(few, q, s)  # builds the table
        run(few, q, s)  # replays it
        return q, s
    want_q, want_s = buffers("cpu")
    Q.fp8_block_quant_into([t.cpu() for t in few], layout, want_q, want_s, scale=scale)  # the reference
    check(each_variant(replay), [want_q, want_s], f"prepared bucket {scale}")


@pytest.mark.parametrize("M,K", [(1, 128), (37, 1664), (130, 7168)])
@pytest.mark.parametrize("layout,scale", [("row", "fp32"), ("mn_major", "fp32"), ("row", "ue8m0"),
                                          ("mn_major", "ue8m0"), ("mn_major", "ue8m0_packed")])
def test_group_quant(M, K, layout, scale):
    for kind, x in inputs((M, K), seed=M + K):
        xd = x.to(DEV)
        outs = each_variant(lambda: [flat(t) if i else t for i, t in
                                     enumerate(Q.fp8_group_quant(xd, scale_layout=layout, scale=scale))])
        qr, sr = R.fp8_group_quant(x, scale_layout=layout, scale=scale)
        check(outs, [qr, flat(sr)], f"group {kind} {M}x{K} {layout} {scale}")


def test_group_quant_every_bf16_value():
    for x in every_finite_bf16_in_groups():
        for scale in ("fp32", "ue8m0"):
            outs = each_variant(lambda: Q.fp8_group_quant(x.to(DEV), scale=scale))
            check(outs, list(R.fp8_group_quant(x, scale=scale)), f"every bf16 value {scale}")


@pytest.mark.parametrize("shape", [(127, 129), (256, 1024), (3, 200, 300)])  # scalar / vector / MoE scalar
def test_block_dequant(shape):
    w = with_nonfinite(special_bf16(shape, seed=31))
    for scale in ("fp32", "ue8m0"):
        qr, sr = R.fp8_block_quant(w, scale=scale)
        outs = each_variant(lambda: Q.fp8_block_dequant(qr.to(DEV), sr.to(DEV)))
        check(outs, [R.fp8_block_dequant(qr, sr)], f"dequant {shape} {scale}")


def test_every_e4m3_code_dequantizes_exactly():
    codes = torch.arange(256, dtype=torch.uint8).repeat(128, 1).reshape(128, 256)
    q = codes.view(torch.float8_e4m3fn)
    for sv in (1.0, 2.0 ** -20, 3.0e-3, 2.0 ** 100):
        s = torch.full((1, 2), sv, dtype=torch.float32)
        outs = each_variant(lambda: Q.fp8_block_dequant(q.to(DEV), s.to(DEV)))
        check(outs, [R.fp8_block_dequant(q, s)], f"codes x {sv}")


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("divisor", [7, 7.5])
def test_int4_fake_quant_pack_unpack(group, divisor):
    """One variant (no FP8 instruction): this checks the code compiled for this build's architectures (in the
    80-virtual build, compute_80 PTX compiled by the driver)."""
    for kind, w in inputs((300, 1024), seed=group):
        wd = w.to(DEV)

        def run():
            fq, packed, s = _cuda.int4_quant(wd, group, divisor, 1e-5, fake_quant=True, pack=True)
            out, q = Q.int4_unpack(packed, s, [300, 1024], return_q=True)
            return fq, packed, s, out, q
        q_ref, s_ref = R.int4_quant(w, group, divisor)
        served = R.int4_dequant(q_ref, s_ref, group)
        check(each_variant(run), [served, R.int4_pack(q_ref), R.bf16_from_bits(s_ref), served,
                                  torch.from_numpy(q_ref)], f"int4 {kind} g{group} D{divisor}")
