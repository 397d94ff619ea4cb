"""The anchors' CPU-testable pieces: the torch formulas (the quant suite's anchor and the colocated loop's torch
codec), the torch CPU AdamW with plain copies, the torch codec through a host buffer."""
import pytest

torch = pytest.importorskip("torch")

from ebbtide.anchors.optim import TorchCpuAdamW  # noqa: E402
from ebbtide.anchors.quant import torch_block_dequant, torch_block_quant, torch_group_quant, torch_int4  # noqa: E402


def _bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_block_quant_scales_per_128x128_block_and_round_trips():
    x = _bf16(256, 384)
    q, s = torch_block_quant(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and s.shape == (2, 3) and s.dtype == torch.float32
    blk = x[128:256, 256:384].float().abs().amax()
    assert s[1, 2] == pytest.approx(float(blk) / 448.0, rel=1e-6)
    back = torch_block_dequant(q, s)
    assert back.dtype == torch.bfloat16 and (back.float() - x.float()).abs().max() <= 0.07 * x.float().abs().max()


def test_block_quant_pads_ragged_shapes_and_batches_leading_dims():
    x = _bf16(2, 200, 300, seed=1)
    q, s = torch_block_quant(x)
    assert q.shape == (2, 200, 300) and s.shape == (2, 2, 3)
    padded = torch.zeros(2, 256, 384, dtype=torch.bfloat16)
    padded[:, :200, :300] = x
    qp, sp = torch_block_quant(padded)  # the zero padding is what DeepGEMM's cast does
    assert torch.equal(sp, s) and torch.equal(qp[:, :200, :300].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(torch_block_quant(x[0])[1], s[0])


def test_group_quant_and_int4_formulas():
    x = _bf16(4, 256, seed=2)
    q, s = torch_group_quant(x)
    assert q.shape == (4, 256) and s.shape == (4, 2)
    assert s[3, 1] == pytest.approx(float(x[3, 128:].float().abs().amax()) / 448.0, rel=1e-6)
    q2, s2 = torch_group_quant(x, mn_major=True)
    assert torch.equal(s2, s) and s2.stride() == (1, 4)
    fq = torch_int4(x)
    assert fq.dtype == torch.bfloat16 and fq.shape == x.shape
    packed, scales = torch_int4(x, pack=True)
    assert packed.shape == (4, 32) and packed.dtype == torch.int32 and scales.shape == (4, 2)


def test_torch_cpu_adamw_steps_masters_and_copies_back():
    p = torch.nn.Parameter(_bf16(64, seed=3))
    ref = p.detach().float().clone().requires_grad_(True)
    opt = TorchCpuAdamW([p], lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1)
    for i in range(3):
        g = _bf16(64, seed=10 + i)
        p.grad = g.clone()
        sums = []
        opt.all_reduce_grads(lambda t: (sums.append(t.clone()), t.mul_(2)), world=2)  # two ranks, same grads
        assert torch.equal(p.grad, g) and len(sums) == 1  # one flat buffer, averaged back
        opt.step()
        ref.grad = g.float()
        ref_opt.step()
        assert p.grad is None and torch.equal(p.detach(), ref.detach().to(torch.bfloat16))
    assert opt.numel == 64


def test_torch_codec_through_a_payload():
    from ebbtide.anchors.sync import torch_load, torch_pack, torch_reference
    from ebbtide.sync import Plan

    src = {"a.weight": _bf16(256, 128, seed=4), "b.weight": _bf16(128, seed=5)}
    plan = Plan.of(src, ignore=())
    data = torch.full((plan.nbytes,), 0xA5, dtype=torch.uint8)
    torch_pack(plan, src, data)
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    torch_load(plan, dst, torch.empty(plan.nbytes, dtype=torch.uint8), data)
    ref = torch_reference(plan, src)
    assert all(torch.equal(dst[n], ref[n]) for n in src) and torch.equal(ref["b.weight"], src["b.weight"])


def test_areal_saver_sets_the_preload_hook_once_on_the_real_package(tmp_path):
    # the package's singleton refuses its hook after its first use: every offload after the first called saver()
    # again and failed there (AttributeError from the real entrypoint), so the hook is set on the first call only
    import os
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "memory"))
    import tms_reference  # noqa: PLC0415

    from ebbtide.testing import spawn  # noqa: PLC0415

    root = tms_reference.unpack(tmp_path / "tms")
    if root is None:
        pytest.skip("torch_memory_saver's wheel is not at hand (EBBTIDE_TMS_WHEEL or <repo>/.whl)")
    code = ("from ebbtide.anchors import areal\n"
            "t = areal.saver()\n"
            "assert t._impl_ctor_kwargs == {'hook_mode': 'preload'}, t._impl_ctor_kwargs\n"
            "t._impl = object(); del t._impl_ctor_kwargs  # what its first use does (_ensure_initialized)\n"
            "assert areal.saver() is t\n"
            "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    p = spawn.python(code, env=env, timeout=120, check=False)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout + p.stderr
