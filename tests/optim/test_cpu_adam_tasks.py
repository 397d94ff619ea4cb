"""The engine's task split: claimed ranges (tasks_per_thread > 1) give the same bits as the static split, for every
thread count, both modes and both moment dtypes; the setting is strict."""
import os

import pytest
import torch

import ebbtide
from ebbtide import _native
from ebbtide.optim.cpu_adam import make_hyper
from ebbtide.testing import spawn

BF16 = torch.bfloat16
N = 3 * 2**20 + 37  # several grains per task at every split below, plus a ragged tail


def _state(moments):
    g = torch.Generator().manual_seed(5)
    p = torch.randn(N, generator=g)
    m = (torch.randn(N, generator=g) * 1e-2).to(moments)
    v = (torch.rand(N, generator=g) * 1e-4).to(moments)
    grad = (torch.randn(N, generator=g) * 1e-2).to(BF16)
    return p, m, v, grad


def _step(eng, mode, moments, steps=3):
    p, m, v, grad = _state(moments)
    out = torch.empty(N, dtype=BF16)
    hyper = make_hyper(dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, mode=mode))
    for t in range(1, steps + 1):
        assert eng.step(hyper, [p.data_ptr()], [m.data_ptr()], [v.data_ptr()], [], [grad.data_ptr()], [True],
                        [out.data_ptr()], [N], [], [float(t)], [moments == BF16])
    return p, m, v, out


@pytest.mark.parametrize("mode", ["exact", "fast"])
@pytest.mark.parametrize("moments", [torch.float32, BF16])
def test_claimed_tasks_give_the_static_split_bits(mode, moments):
    C = _native.load()
    ref = _step(C.optim.AdamEngine(1, "", 1), mode, moments)
    for threads, tasks in [(2, 1), (2, 16), (3, 7), (4, 256)]:
        eng = C.optim.AdamEngine(threads, "", tasks)
        assert (eng.threads, eng.tasks_per_thread) == (threads, tasks)
        got = _step(eng, mode, moments)
        for a, b in zip(ref, got):
            assert torch.equal(a.view(torch.int16) if a.dtype == BF16 else a.view(torch.int32),
                               b.view(torch.int16) if b.dtype == BF16 else b.view(torch.int32)), (threads, tasks)


def test_tasks_per_thread_out_of_range_is_refused():
    C = _native.load()
    for bad in (0, -1, 257):
        with pytest.raises(ebbtide.InvalidArgumentError, match="tasks_per_thread"):
            C.optim.AdamEngine(2, "", bad)


def _engine_in_child(value):
    env = dict(os.environ, EBBTIDE_ADAM_TASKS_PER_THREAD=value)
    code = ("try:\n    from ebbtide.optim.cpu_adam import shared_engine\n"  # a bad value fails at the import
            "    print(shared_engine(2, None).tasks_per_thread)\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    return spawn.python(code, env=env, timeout=120, check=False).stdout.strip()


def test_the_setting_reaches_the_shared_engine():
    assert _engine_in_child("") == "16"
    assert _engine_in_child(" 4 ") == "4"
    for bad in ("0", "300", "many"):
        got = _engine_in_child(bad)
        assert got.startswith("SettingError EBBTIDE_ADAM_TASKS_PER_THREAD=") and "[1, 256]" in got, got


def test_a_non_finite_gradient_in_a_late_claimed_task_skips_every_span():
    """skip_non_finite with claimed tasks: a NaN in the last range (and in a ragged second span whose start is not
    a multiple of 16) is found whichever thread claims it, and nothing changes anywhere."""
    C = _native.load()
    eng = C.optim.AdamEngine(4, "", 64)
    hyper = make_hyper(dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, mode="fast"),
                       skip_non_finite=True)
    n0, n1 = 2**20 + 5, 2**19 + 3
    for where in (n0 - 1, n0 + n1 - 7):
        p = torch.ones(n0 + n1)
        m, v = torch.zeros(n0 + n1), torch.zeros(n0 + n1)
        g = torch.full((n0 + n1,), 1e-3)
        g[where] = float("nan")
        before = p.clone()
        spans = [(0, n0), (n0, n1)]  # the second span starts at an odd element: unaligned pointers

        def ptr(t, off):
            return t.data_ptr() + off * t.element_size()

        applied = eng.step(hyper, [ptr(p, o) for o, _ in spans], [ptr(m, o) for o, _ in spans],
                           [ptr(v, o) for o, _ in spans], [], [ptr(g, o) for o, _ in spans], [False, False], [],
                           [n for _, n in spans], [], [1.0, 1.0], [])
        assert applied is False and torch.equal(p, before) and not m.any() and not v.any(), where


def test_ragged_spans_give_the_static_split_bits():
    """Several spans of odd lengths at odd offsets, cut into claimed ranges: bit-equal to one thread."""
    C = _native.load()
    lengths = [1, 15, 33, 4099, 2**18 + 17, 2**20 + 31]
    total = sum(lengths)

    def run(eng):
        g = torch.Generator().manual_seed(11)
        p, grad = torch.randn(total, generator=g), torch.randn(total, generator=g) * 1e-2
        m, v = torch.zeros(total), torch.zeros(total)
        out = torch.empty(total, dtype=BF16)
        offs = [sum(lengths[:i]) for i in range(len(lengths))]
        hyper = make_hyper(dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, mode="exact"))
        for t in (1, 2):
            assert eng.step(hyper, [p.data_ptr() + 4 * o for o in offs], [m.data_ptr() + 4 * o for o in offs],
                            [v.data_ptr() + 4 * o for o in offs], [], [grad.data_ptr() + 4 * o for o in offs],
                            [False] * len(offs), [out.data_ptr() + 2 * o for o in offs], lengths, [],
                            [float(t)] * len(offs), [])
        return p, m, v, out.view(torch.int16)

    ref = run(C.optim.AdamEngine(1, "", 1))
    for threads, tasks in [(3, 16), (4, 256)]:
        got = run(C.optim.AdamEngine(threads, "", tasks))
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), (threads, tasks)
