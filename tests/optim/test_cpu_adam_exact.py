"""CPUAdam exact mode: bit-identical to torch.optim.AdamW / Adam (foreach=False, fp32) for p, m, v.

Covers the matrix: sizes {1, 15, 16, 17, 127, 128, 129, 2^20+37}, misaligned views, threads {1, 3, all},
weight decay on/off, 100+ steps, amsgrad, maximize, NaN/Inf/subnormal gradients, float and tensor lr, bf16 grads,
and every kernel ISA this CPU can run, each forced in turn. Comparison is bitwise (NaN positions must match).
"""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from ebbtide.optim import CPUAdam, available_isas  # noqa: E402

from ebbtide.optim._testing import grads_for, offset_view  # noqa: E402
from ebbtide.testing import spawn  # noqa: E402
from ebbtide.testing.bits import bits_equal, describe_mismatch  # noqa: E402

SIZES = [1, 15, 16, 17, 127, 128, 129, 2**20 + 37]


def test_torch_sqrt_flavor_is_known_here():
    # Exact mode needs to know how this torch computes Tensor.sqrt (optim/adam_kernel.h, Note [torch's sqrt]).
    from ebbtide.optim.cpu_adam import probe_torch_sqrt_flavor

    flavor = probe_torch_sqrt_flavor()
    assert flavor is not None, (
        f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}) computes sqrt as none of "
        "the flavors exact mode knows (IEEE, MKL's AVX-512 and generic SSE2 vsSqrt): exact mode cannot match it bit "
        "for bit on this machine")
ALL = os.cpu_count() or 1


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="MKL's sqrt flavors exist on x86-64 only")
def test_mkl_sse_flavor_is_within_an_ulp_and_ieee_off_its_fast_range():
    # Flavor 2 (MKL's generic SSE2 kernel, adam_kernel.h Note [torch's sqrt]) is an rsqrt + Newton result: never
    # more than one ulp from IEEE, and IEEE exactly where MKL leaves its fast range (zero, subnormal, huge).
    from ebbtide import _native
    from ebbtide.optim.cpu_adam import _sqrt_probes

    x = _sqrt_probes()
    out = torch.empty_like(x)
    _native.load().optim.sqrt_flavor_eval(2, x.data_ptr(), out.data_ptr(), x.numel())
    ulps = (out.view(torch.int32).long() - x.sqrt().view(torch.int32).long()).abs()
    assert int(ulps.max()) <= 1
    off_range = (x < 2.0**-126) | (x.view(torch.int32) > 0x7F7FF000)
    assert off_range.sum() >= 5 and int(ulps[off_range].max()) == 0


def run_pair(n, steps, *, adamw=True, wd=0.1, amsgrad=False, maximize=False, threads=3, isa=None, lr=1e-3,
             betas=(0.9, 0.999), eps=1e-8, offset=0, grad_offset=0, bf16_grads=False, special=False, seed=0):
    gen = torch.Generator().manual_seed(seed + n)
    init = torch.randn(n, generator=gen)
    ref = init.clone().requires_grad_(False)
    ours = offset_view(n, offset, fill=init)
    tcls = torch.optim.AdamW if adamw else torch.optim.Adam
    t_opt = tcls([ref], lr=lr, betas=betas, eps=eps, weight_decay=wd, amsgrad=amsgrad, maximize=maximize,
                 foreach=False)
    o_opt = CPUAdam([ours], lr=lr, betas=betas, eps=eps, weight_decay=wd, adamw=adamw, amsgrad=amsgrad,
                    maximize=maximize, mode="exact", threads=threads, isa=isa)
    for g in grads_for(n, steps, seed, special=special):
        if bf16_grads:
            g = g.to(torch.bfloat16)
        ref.grad = g.float()
        ours_g = offset_view(n, grad_offset, dtype=g.dtype, fill=g)
        t_opt.step()
        o_opt.step(grads={ours: ours_g})
    ts, os_ = t_opt.state[ref], o_opt.state[ours]
    pairs = [("p", ours, ref), ("exp_avg", os_["exp_avg"], ts["exp_avg"]),
             ("exp_avg_sq", os_["exp_avg_sq"], ts["exp_avg_sq"])]
    if amsgrad:
        pairs.append(("max_exp_avg_sq", os_["max_exp_avg_sq"], ts["max_exp_avg_sq"]))
    for name, a, b in pairs:
        assert bits_equal(a, b), f"{name}: {describe_mismatch(a, b)}"
    assert torch.equal(os_["step"], ts["step"]) and os_["step"].dtype == torch.float32


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("adamw", [True, False])
def test_sizes_adamw_and_adam(n, adamw):
    run_pair(n, 12 if n > 4096 else 40, adamw=adamw, wd=0.1, offset=n % 7, grad_offset=3)


@pytest.mark.parametrize("threads", sorted({1, 3, ALL}))
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_threads_and_weight_decay(threads, wd):
    run_pair(2**20 + 37, 6, threads=threads, wd=wd, offset=1, grad_offset=5)


def test_many_steps():
    run_pair(129, 150, wd=0.01, betas=(0.9, 0.95), lr=3e-4)
    run_pair(1000, 120, adamw=False, wd=0.05)


@pytest.mark.parametrize("amsgrad,maximize", [(True, False), (False, True), (True, True)])
def test_amsgrad_maximize(amsgrad, maximize):
    run_pair(1000, 30, amsgrad=amsgrad, maximize=maximize)
    run_pair(17, 30, amsgrad=amsgrad, maximize=maximize, adamw=False)


def test_nan_inf_subnormal_propagate():
    run_pair(300, 10, special=True)
    run_pair(300, 10, special=True, amsgrad=True, adamw=False)


def test_bf16_grads_are_widened_exactly():
    run_pair(4099, 20, bf16_grads=True, grad_offset=1)


def test_large_beta1_lerp_branch():
    # 1 - beta1 >= 0.5 takes ATen's other lerp formula.
    run_pair(333, 20, betas=(0.3, 0.999))


def test_tensor_lr_matches_torch():
    for lr in (torch.tensor(1e-3), torch.tensor(3.3e-4, dtype=torch.float64)):
        run_pair(1000, 8, lr=lr)
        run_pair(100, 8, lr=lr, adamw=False)


@pytest.mark.parametrize("isa", available_isas())
def test_every_isa_forced(isa):
    for n in (1, 17, 129, 70001):
        run_pair(n, 8, isa=isa, offset=n % 5, grad_offset=1)
        run_pair(n, 8, isa=isa, amsgrad=True, bf16_grads=True, special=n > 8)


def test_env_var_lowers_isa_and_omp_num_threads_is_ignored():
    code = ("import os; from ebbtide.optim import CPUAdam; import torch; o = CPUAdam([torch.zeros(1)]); "
            "print(o.isa, o.threads == len(os.sched_getaffinity(0)))")
    for isa in {available_isas()[0], "scalar"}:  # the best and the lowest: one subprocess each
        env = {**os.environ, "EBBTIDE_CPU_ISA": isa, "OMP_NUM_THREADS": "1"}  # Ray sets OMP_NUM_THREADS=1
        out = spawn.python(code, env=env).stdout.strip()
        assert out == f"{isa} True"


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without MKL: Tensor.sqrt is ATen's own")
def test_exact_when_mkl_takes_its_avx2_path():
    # On AVX2-only Intel hosts MKL runs its AVX2 vsSqrt, which is correctly rounded (flavor 0);
    # MKL_ENABLE_INSTRUCTIONS=AVX2 reproduces that host on an AVX-512 Intel CPU. On other vendors MKL ignores the
    # variable and runs its generic SSE2 kernel (flavor 2). Either way exact mode must find the flavor and match.
    code = (
        "import torch; from ebbtide.optim import CPUAdam; from ebbtide.optim.cpu_adam import probe_torch_sqrt_flavor;"
        "from ebbtide.optim._testing import grads_for; from ebbtide.testing.bits import bits_equal\n"
        "a = torch.randn(100003); b = a.clone()\n"
        "t = torch.optim.AdamW([a], weight_decay=0.1, foreach=False); o = CPUAdam([b], weight_decay=0.1, mode='exact')\n"
        "for g in grads_for(100003, 5, 7):\n"
        "    a.grad = g; t.step(); o.step(grads={b: g})\n"
        "print(probe_torch_sqrt_flavor(), bits_equal(a, b))\n")
    env = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    out = spawn.python(code, env=env)
    from ebbtide.info import _cpuinfo_field

    expected = "0" if _cpuinfo_field("vendor_id") == "GenuineIntel" else "2"
    assert out.stdout.split()[-2:] == [expected, "True"], out.stdout + out.stderr
