"""The quant kernels (the variant EBBTIDE_QUANT_KERNELS selects; test_portable_gpu.py runs both) against the CPU
reference: zero mismatching bytes, scales and padding, on random, heavy-tailed, all-zero, subnormal, +-0, 448-tie,
NaN/Inf, ragged, strided and misaligned inputs; plus the INT4 QAT contract (fake_quant(W) == dequant(pack(W)) bit
for bit) and that QAT and export run the same kernel."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ebbtide.quant as Q
from ebbtide.quant import _cuda
from ebbtide.quant import reference as R
from quant_oracle import every_finite_bf16_in_groups, heavy_tailed

pytestmark = pytest.mark.gpu
DEV = "cuda"


def poison_cache():
    """Fill freed device memory with a non-zero pattern so outputs the kernels fail to write cannot pass as 0."""
    x = torch.full((256 << 20,), 0x7B, dtype=torch.uint8, device=DEV)
    del x


def flat(view: torch.Tensor) -> torch.Tensor:
    """The whole buffer under an as_strided scale view (padding included), as int32 bits."""
    n = view.untyped_storage().nbytes() // view.element_size()
    buf = view.as_strided((n,), (1,), 0)
    return buf.view(torch.int32).cpu() if buf.dtype in (torch.float32, torch.int32) else buf.cpu()


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.cpu().contiguous()
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    if t.dtype in (torch.bfloat16,):
        return t.view(torch.int16)
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    return t


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str):
    g, w = bits(got), bits(want)
    assert g.shape == w.shape, f"{what}: shape {tuple(g.shape)} != {tuple(w.shape)}"
    bad = (g != w).sum().item()
    assert bad == 0, f"{what}: {bad} mismatches of {g.numel()}"


def special_bf16(shape, seed) -> torch.Tensor:
    """Heavy-tailed values with zero blocks, +-0, bf16 subnormals, and exact 448-boundary elements."""
    w = heavy_tailed(shape, seed=seed)
    flatw = w.view(-1)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, flatw.numel(), (max(1, flatw.numel() // 50),), generator=g)
    sub = torch.tensor([2.0 ** -130, -(2.0 ** -133), 2.0 ** -126, -0.0, 0.0], dtype=torch.bfloat16)
    flatw[idx] = sub[torch.arange(idx.numel()) % sub.numel()]
    if w.shape[-2] >= 128 and w.shape[-1] >= 128:
        w[..., :128, :128] = 0  # an all-zero block
        w[..., 0, 1] = -0.0
    return w


def random_bit_patterns(rows, cols, seed) -> torch.Tensor:
    """Finite bf16 values with uniformly random bit patterns (every exponent equally likely)."""
    g = np.random.default_rng(seed)
    u = g.integers(0, 1 << 16, size=(rows, cols), dtype=np.uint32).astype(np.uint16)
    u = np.where((u & 0x7F80) == 0x7F80, u & 0x807F, u).astype(np.uint16)
    return torch.from_numpy(u.view(np.int16)).view(torch.bfloat16)


def with_nonfinite(w: torch.Tensor) -> torch.Tensor:
    w = w.clone()
    w.view(-1)[min(3, w.numel() - 1)] = float("nan")
    w.view(-1)[-1] = float("inf")
    if w.shape[-2] > 200:
        w[..., 200, 0] = float("-inf")
    return w


# ---- FP8 block -----------------------------------------------------------------------------------------------
SHAPES = [(1, 1), (1, 8), (127, 129), (128, 128), (129, 303), (303, 7), (256, 1024), (1000, 520)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scale", ["fp32", "ue8m0", "ue8m0_packed"])
def test_block_quant_matches_reference(shape, scale):
    for kind, w in (("special", special_bf16(shape, seed=sum(shape))),
                    ("bits", random_bit_patterns(*shape, seed=7)),
                    ("nonfinite", with_nonfinite(heavy_tailed(shape, seed=3)))):
        poison_cache()
        q, s = Q.fp8_block_quant(w.to(DEV), scale=scale)
        qr, sr = R.fp8_block_quant(w, scale=scale)
        assert_same(q, qr, f"{kind} q")
        assert_same(flat(s), flat(sr), f"{kind} scale")


@pytest.mark.parametrize("scale", ["fp32", "ue8m0_packed"])
def test_block_quant_moe_one_launch_ragged_experts(scale):
    w = special_bf16((5, 200, 300), seed=11)
    w[2] = 0
    poison_cache()
    q, s = Q.fp8_block_quant(w.to(DEV), scale=scale)
    qr, sr = R.fp8_block_quant(w, scale=scale)
    assert_same(q, qr, "moe q")
    assert_same(flat(s), flat(sr), "moe scale")
    # a strided expert batch (a slice of a larger buffer)
    big = heavy_tailed((3, 256, 640), seed=12).to(DEV)
    view = big[:, :200, 8:520]
    q2, s2 = Q.fp8_block_quant(view, scale=scale)
    qr2, sr2 = R.fp8_block_quant(view.cpu(), scale=scale)
    assert_same(q2, qr2, "strided moe q")
    assert_same(flat(s2), flat(sr2), "strided moe scale")


@pytest.mark.parametrize("offset", [8, 3])  # 16-byte aligned (vector path) / misaligned (scalar path)
def test_block_quant_any_row_stride(offset):
    big = special_bf16((300, 1100), seed=13).to(DEV)
    view = big[:, offset:offset + 1000]
    q, s = Q.fp8_block_quant(view)
    qr, sr = R.fp8_block_quant(view.cpu())
    assert_same(q, qr, "q")
    assert_same(s, sr, "scale")


def test_block_list_one_launch_matches_reference():
    g = torch.Generator().manual_seed(0)
    shapes = [(int(torch.randint(1, 700, (1,), generator=g)), int(torch.randint(1, 700, (1,), generator=g)))
              for _ in range(100)] + [(7168, 512), (128, 128), (129, 300), (300, 1000)]
    ts = [special_bf16(s, seed=i).to(DEV) for i, s in enumerate(shapes)]
    ts[5] = torch.zeros(130, 260, dtype=torch.bfloat16, device=DEV)
    ts[6] = with_nonfinite(ts[6])
    big = heavy_tailed((300, 900), seed=99).to(DEV)
    ts += [big[:, 3:803], big[:, 8:808]]  # misaligned and aligned strided views
    for scale in ("fp32", "ue8m0"):
        poison_cache()
        b = Q.fp8_block_quant_list(ts, scale=scale)
        for i, (t, (q, s)) in enumerate(zip(ts, b)):
            qr, sr = R.fp8_block_quant(t.cpu(), scale=scale)
            assert_same(q, qr, f"list[{i}] {tuple(t.shape)} q")
            assert_same(s, sr, f"list[{i}] scale")


def test_block_list_longer_than_the_parameter_table():
    """Past 128 entries the kernel reads a device copy of the table instead of its launch parameters."""
    g = torch.Generator().manual_seed(1)
    shapes = [(int(torch.randint(1, 300, (1,), generator=g)), int(torch.randint(1, 300, (1,), generator=g)))
              for _ in range(150)]
    ts = [special_bf16(s, seed=i).to(DEV) for i, s in enumerate(shapes)]
    poison_cache()
    b = Q.fp8_block_quant_list(ts)
    for i, (t, (q, s)) in enumerate(zip(ts, b)):
        qr, sr = R.fp8_block_quant(t.cpu())
        assert_same(q, qr, f"list[{i}] {tuple(t.shape)} q")
        assert_same(s, sr, f"list[{i}] scale")


# ---- FP8 group -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("M,K", [(1, 128), (5, 256), (37, 1664), (130, 7168), (2048, 1024)])
@pytest.mark.parametrize("layout,scale", [("row", "fp32"), ("mn_major", "fp32"), ("row", "ue8m0"),
                                          ("mn_major", "ue8m0"), ("mn_major", "ue8m0_packed")])
def test_group_quant_matches_reference(M, K, layout, scale):
    for kind, x in (("special", special_bf16((M, K), seed=M + K)), ("bits", random_bit_patterns(M, K, seed=M)),
                    ("nonfinite", with_nonfinite(heavy_tailed((M, K), seed=5)))):
        poison_cache()
        q, s = Q.fp8_group_quant(x.to(DEV), scale_layout=layout, scale=scale)
        qr, sr = R.fp8_group_quant(x, scale_layout=layout, scale=scale)
        assert_same(q, qr, f"{kind} q")
        assert s.shape == sr.shape and s.stride() == sr.stride()
        assert_same(flat(s), flat(sr), f"{kind} scale")


def test_group_quant_every_bf16_value():
    """All 65,280 finite bf16 values, sorted into groups (narrow ranges) and shuffled (wide ranges)."""
    for x in every_finite_bf16_in_groups():
        for scale in ("fp32", "ue8m0"):
            q, s = Q.fp8_group_quant(x.to(DEV), scale=scale)
            qr, sr = R.fp8_group_quant(x, scale=scale)
            assert_same(q, qr, "q")
            assert_same(s, sr, "scale")


@pytest.mark.parametrize("offset", [8, 3])
def test_group_quant_strided(offset):
    big = special_bf16((257, 1300), seed=21).to(DEV)
    view = big[:, offset:offset + 1024]
    q, s = Q.fp8_group_quant(view, scale_layout="mn_major")
    qr, sr = R.fp8_group_quant(view.cpu(), scale_layout="mn_major")
    assert_same(q, qr, "q")
    assert_same(flat(s), flat(sr), "scale")


# ---- FP8 dequant ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 1), (127, 129), (256, 1024), (3, 200, 300)])
def test_block_dequant_matches_reference(shape):
    w = with_nonfinite(special_bf16(shape, seed=31))
    for scale in ("fp32", "ue8m0"):
        qr, sr = R.fp8_block_quant(w, scale=scale)
        poison_cache()
        d = Q.fp8_block_dequant(qr.to(DEV), sr.to(DEV))
        assert_same(d, R.fp8_block_dequant(qr, sr), f"dequant {scale}")
        out = torch.full(shape, 7.0, dtype=torch.bfloat16, device=DEV)  # into a given tensor: the same bits
        assert Q.fp8_block_dequant(qr.to(DEV), sr.to(DEV), out=out) is out
        assert_same(out, R.fp8_block_dequant(qr, sr), f"dequant {scale} into out")


def test_every_e4m3_code_dequantizes_exactly():
    codes = torch.arange(256, dtype=torch.uint8).repeat(128, 1).reshape(128, 256)
    q = codes.view(torch.float8_e4m3fn)
    for sv in (1.0, 2.0 ** -20, 3.0e-3, 2.0 ** 100):
        s = torch.full((1, 2), sv, dtype=torch.float32)
        assert_same(Q.fp8_block_dequant(q.to(DEV), s.to(DEV)), R.fp8_block_dequant(q, s), f"codes x {sv}")


# ---- INT4 ----------------------------------------------------------------------------------------------------
INT4_SHAPES = [(1, 128), (7, 256), (300, 1024), (512, 7168)]


@pytest.mark.parametrize("shape", INT4_SHAPES)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("divisor", [7, 7.5])
def test_int4_quant_matches_reference(shape, group, divisor):
    for kind, w in (("special", special_bf16(shape, seed=shape[0])),
                    ("std0.02", (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 0.02).bfloat16()),
                    ("nonfinite", with_nonfinite(heavy_tailed(shape, seed=2)))):
        poison_cache()
        fq, packed, s = _cuda.int4_quant(w.to(DEV), group, divisor, 1e-5, fake_quant=True, pack=True)
        q_ref, s_ref = R.int4_quant(w, group, divisor)
        assert_same(s, R.bf16_from_bits(s_ref), f"{kind} scale")
        assert_same(packed, R.int4_pack(q_ref), f"{kind} packed")
        assert_same(fq, R.int4_dequant(q_ref, s_ref, group), f"{kind} fake-quant")
        out, q = Q.int4_unpack(packed, s, list(shape), return_q=True)
        assert_same(q, torch.from_numpy(q_ref), f"{kind} unpacked q")


@pytest.mark.parametrize("offset", [8, 3])  # 16-byte aligned rows / misaligned (element loads)
def test_int4_quant_strided(offset):
    big = special_bf16((257, 1300), seed=23).to(DEV)
    view = big[:, offset:offset + 1024]
    fq, packed, s = _cuda.int4_quant(view, 128, 7, 1e-5, fake_quant=True, pack=True)
    q_ref, s_ref = R.int4_quant(view.cpu(), 128, 7)
    assert_same(s, R.bf16_from_bits(s_ref), "scale")
    assert_same(packed, R.int4_pack(q_ref), "packed")
    assert_same(fq, R.int4_dequant(q_ref, s_ref, 128), "fake-quant")


@pytest.mark.parametrize("divisor", [7, 7.5])
def test_int4_quant_every_bf16_ratio(divisor):
    """The kernel rounds x/s without a division (see int4_round): every finite bf16 |x| <= amax, both signs, in
    groups whose amax runs over all 128 bf16 mantissas (every x/s ratio pattern, every tie), against IEEE division
    in the reference."""
    rows = []
    for m in range(128):
        amax_bits = 0x3F80 | m
        mags = np.arange(0, amax_bits + 1, dtype=np.uint16)
        vals = np.concatenate([mags, mags | 0x8000])
        vals = np.concatenate([vals, np.zeros((-vals.size) % 127, np.uint16)]).reshape(-1, 127)
        rows.append(np.concatenate([np.full((vals.shape[0], 1), amax_bits, np.uint16), vals], axis=1))
    u = np.concatenate(rows).reshape(-1)
    u = np.concatenate([u, np.zeros((-u.size) % 1024, np.uint16)])
    w = torch.from_numpy(u.view(np.int16)).view(torch.bfloat16).reshape(-1, 1024)
    fq, packed, s = _cuda.int4_quant(w.to(DEV), 128, divisor, 1e-5, fake_quant=True, pack=True)
    q_ref, s_ref = R.int4_quant(w, 128, divisor)
    assert_same(s, R.bf16_from_bits(s_ref), "scale")
    assert_same(packed, R.int4_pack(q_ref), "packed")
    assert_same(fq, R.int4_dequant(q_ref, s_ref, 128), "fake-quant")


@pytest.mark.parametrize("group", [32, 128])
def test_int4_qat_contract_bitwise(group):
    """fake_quant(W) == RNbf16(float(unpack(pack(W))) * float(weight_scale)) on random, heavy-tailed, zero groups."""
    g = torch.Generator().manual_seed(group)
    cases = {
        "random": (torch.randn(1024, 4096, generator=g) * 0.02).bfloat16(),
        "heavy": heavy_tailed((1024, 4096), seed=4, spread=(-40, 30), block=group),
        "zero": torch.zeros(64, 4096, dtype=torch.bfloat16),
    }
    cases["mixed"] = cases["random"].clone()
    cases["mixed"][:, :group] = 0
    for name, w in cases.items():
        w = w.to(DEV)
        fq = Q.int4_fake_quant(w, group=group)
        packed = Q.int4_pack(w, group=group)
        served_kernel = Q.int4_unpack(packed)
        q = torch.from_numpy(R.int4_unpack_q(packed["weight_packed"].cpu(), w.shape[1]))
        served_formula = (q.float() * packed["weight_scale"].cpu().float().repeat_interleave(group, 1)).bfloat16()
        assert_same(fq, served_kernel, f"{name}: fake-quant vs kernel dequant")
        assert_same(fq, served_formula, f"{name}: fake-quant vs Marlin formula")


def test_int4_qat_and_export_call_the_same_kernel(monkeypatch):
    calls = []
    real = _cuda.int4_quant

    def spy(w, group, divisor, eps, *, fake_quant, pack):
        calls.append((fake_quant, pack))
        return real(w, group, divisor, eps, fake_quant=fake_quant, pack=pack)

    monkeypatch.setattr(_cuda, "int4_quant", spy)
    w = heavy_tailed((256, 512), seed=8).to(DEV).requires_grad_()
    fq = Q.int4_fake_quant(w, group=64)
    packed = Q.int4_pack(w.detach(), group=64)
    out, _ = Q.export_int4({"layer.weight": w.detach()}, group=64)
    assert calls == [(True, False), (False, True), (False, True)]
    # one launch producing both outputs gives the same bits as the two separate paths
    fq2, packed2, s2 = real(w.detach(), 64, 7, 1e-5, fake_quant=True, pack=True)
    assert_same(fq2, fq.detach(), "fused fake-quant")
    assert_same(packed2, packed["weight_packed"], "fused packed")
    assert_same(out["layer.weight_packed"], packed2, "export packed")
    fq.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))


def test_kernels_are_deterministic_and_stream_ordered():
    w = heavy_tailed((4096, 4096), seed=9).to(DEV)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        w2 = w * 1  # produced on the side stream; the quant call must follow it there
        q1, s1 = Q.fp8_block_quant(w2)
    s.synchronize()
    q2, s2 = Q.fp8_block_quant(w)
    assert_same(q1, q2, "q")
    assert_same(s1, s2, "scale")
