"""The AVX-512 kernels bit for bit against the scalar kernel at every tail length.

The AVX-512 kernels step full 16-lane vectors with plain loads/stores and the last partial vector with masked
ones; both must give the scalar kernel's bits (state, master weights, bf16 copy-out, non-finite scan) for tails of
1..15 elements, exact multiples of 16, unaligned tensors, and both modes."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from ebbtide.optim import CPUAdam, available_isas  # noqa: E402
from ebbtide.testing.bits import bits_equal, describe_mismatch  # noqa: E402

AVX512_ISAS = [isa for isa in ("avx512", "avx512_bf16") if isa in available_isas()]
pytestmark = pytest.mark.skipif(not AVX512_ISAS, reason="this CPU has no AVX-512 (no AVX-512 kernel to force)")

# 1..15: a tail alone; 16/32/48/64/256: full vectors only; the rest: full vectors and a tail.
LENGTHS = list(range(1, 50)) + [63, 64, 65, 79, 80, 255, 256, 257]
STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _make(n: int, offset: int, seed: int) -> torch.Tensor:
    """An n-element fp32 tensor starting `offset` floats into its storage (offset 1: every load unaligned)."""
    buf = torch.randn(n + offset, generator=torch.Generator().manual_seed(seed))
    return buf[offset:]


def _run(isa: str, mode: str, *, offset: int, threads: int, bf16_grads: bool, amsgrad: bool, steps: int = 3):
    params = [_make(n, offset, n) for n in LENGTHS]
    outs = [torch.full((n + 16,), 7, dtype=torch.bfloat16)[offset:offset + n] for n in LENGTHS]
    opt = CPUAdam(params, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, mode=mode, isa=isa, threads=threads)
    for p, out in zip(params, outs):
        opt.attach_bf16_copy(p, out)
    for step in range(steps):
        grads = {}
        for p in params:
            g = torch.randn(p.numel(), generator=torch.Generator().manual_seed(1000 * step + p.numel()))
            g[-1] = g[-1] * 1e-40 if step == 1 else g[-1]  # a subnormal in the last (tail) lane
            grads[p] = g.to(torch.bfloat16) if bf16_grads else g
        opt.step(grads=grads)
    return params, outs, opt


@pytest.mark.parametrize("isa", AVX512_ISAS)
@pytest.mark.parametrize("mode", ["exact", "fast"])
@pytest.mark.parametrize("offset,threads,bf16_grads,amsgrad",
                         [(0, 1, False, False), (1, 1, True, True), (0, 2, True, False), (1, 2, False, True)])
def test_avx512_equals_scalar_at_every_tail(isa, mode, offset, threads, bf16_grads, amsgrad):
    kw = dict(offset=offset, threads=threads, bf16_grads=bf16_grads, amsgrad=amsgrad)
    ps, outs, opt = _run(isa, mode, **kw)
    ref_ps, ref_outs, ref_opt = _run("scalar", mode, **kw)
    assert opt.engine.isa == isa and ref_opt.engine.isa == "scalar"
    for p, ref_p, out, ref_out in zip(ps, ref_ps, outs, ref_outs):
        n = p.numel()
        assert bits_equal(p, ref_p), f"n={n} p: {describe_mismatch(p, ref_p)}"
        for key in STATE_KEYS:
            if key in ref_opt.state[ref_p]:
                a, b = opt.state[p][key], ref_opt.state[ref_p][key]
                assert bits_equal(a, b), f"n={n} {key}: {describe_mismatch(a, b)}"
        assert torch.equal(out.view(torch.int16), ref_out.view(torch.int16)), f"n={n} bf16 copy-out"
        assert torch.equal(out.view(torch.int16), p.to(torch.bfloat16).view(torch.int16)), f"n={n} copy-out vs p"


@pytest.mark.parametrize("isa", AVX512_ISAS + ["scalar"])
@pytest.mark.parametrize("bf16_grads", [False, True])
def test_non_finite_scan_sees_every_lane(isa, bf16_grads):
    for n in (1, 15, 16, 17, 31, 32, 33, 47):
        p = torch.randn(n)
        opt = CPUAdam([p], mode="fast", isa=isa, threads=1)
        for pos in range(n):  # an Inf in each lane: the full-vector and the tail path
            g = torch.ones(n)
            g[pos] = float("inf") if pos % 2 else float("nan")
            opt.step(grads={p: g.to(torch.bfloat16) if bf16_grads else g}, skip_non_finite=True)
            assert opt.last_step_applied == [False], (isa, n, pos)
        big = torch.ones(n)
        big[n - 1] = 3e38  # finite, but overflows once scaled
        opt.step(grads={p: big.to(torch.bfloat16) if bf16_grads else big}, grad_scale=10.0, skip_non_finite=True)
        assert opt.last_step_applied == [False], (isa, n, "overflow")
        opt.step(grads={p: torch.ones(n).to(torch.bfloat16) if bf16_grads else torch.ones(n)}, skip_non_finite=True)
        assert opt.last_step_applied == [True], (isa, n, "finite")
