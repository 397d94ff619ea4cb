"""ebbtide's kernel in Megatron-core's HybridDeviceOptimizer (ebbtide.integrations.megatron.hybrid_device):
MegatronCPUAdam accepts what HybridDeviceOptimizer passes its cpu_optimizer_cls, steps exactly like torch AdamW in
exact mode, and per-parameter instances share one thread pool."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import ebbtide  # noqa: E402
from ebbtide.integrations.megatron.hybrid_device import MegatronCPUAdam, install, uninstall  # noqa: E402
from ebbtide.testing.bits import bits_equal  # noqa: E402


class ExactAdapter(MegatronCPUAdam):
    mode = "exact"


def hdo_groups(params):
    # The keys Megatron's HybridDeviceOptimizer puts in each group it hands to cpu_optimizer_cls.
    extra = dict(offload_fraction=1.0, cpu_optimizer_cls=None, gpu_optimizer_cls=None, param_update_in_fp32=True,
                 pin_cpu_grads=True, pin_cpu_params=True, overlap_cpu_optimizer_d2h_h2d=True, lr=1e-3,
                 weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, bias_correction=True, fused=True)
    return [{"params": [p], **extra} for p in params]


def assert_steps_like_torch_adamw(opts, ours, steps):
    """``opts`` (one per param of ``ours``) stepped ``steps`` times with random gradients equal torch's AdamW
    (for-loop) stepping copies of the params with the same gradients, bit for bit."""
    ref = [t.clone() for t in ours]
    t_opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for _ in range(steps):
        for a, b in zip(ours, ref):
            g = torch.randn_like(a)
            a.grad, b.grad = g, g.clone()
        for o in opts:
            o.step()
        t_opt.step()
    for a, b in zip(ours, ref):
        assert bits_equal(a, b)


def test_per_parameter_instances_match_torch_and_share_a_pool():
    ours = [torch.randn(300), torch.randn(17, 5)]
    opts = [ExactAdapter([g]) for g in hdo_groups(ours)]
    assert_steps_like_torch_adamw(opts, ours, 4)
    assert opts[0].engine is opts[1].engine


def test_unsupported_options_and_a_megatron_without_cpu_adam(monkeypatch):
    with pytest.raises(ebbtide.UnsupportedError, match="bias_correction"):
        MegatronCPUAdam([torch.zeros(2)], bias_correction=False)
    with pytest.raises(ebbtide.UnsupportedError, match="capturable"):
        MegatronCPUAdam([torch.zeros(2)], capturable=True)
    import megatron.core.optimizer as mco  # noqa: PLC0415

    monkeypatch.delattr(mco, "CPUAdam")
    with pytest.raises(ebbtide.UnsupportedError, match="no megatron.core.optimizer.CPUAdam"):
        install()


def test_install_replaces_megatron_cpu_adam_and_hdo_builds_it():
    import megatron.core.optimizer as mco  # noqa: PLC0415
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer  # noqa: PLC0415

    original = mco.CPUAdam
    cls = install(mode="exact")
    try:
        assert mco.CPUAdam is cls and issubclass(cls, MegatronCPUAdam)
        ours = [torch.randn(64), torch.randn(8, 8)]
        opts = HybridDeviceOptimizer.build_cpu_optimizer_list(mco.CPUAdam, hdo_groups(ours))
        assert len(opts) == 2 and all(isinstance(o, cls) for o in opts)
        assert_steps_like_torch_adamw(opts, ours, 3)
    finally:
        uninstall()
    assert mco.CPUAdam is original
