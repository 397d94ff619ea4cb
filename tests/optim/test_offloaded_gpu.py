"""OffloadedAdam on a CUDA device: exact equality with torch's CPU AdamW stepping the fp32 masters, closeness to
a GPU AdamW reference, stream ordering (the upload and download races), and hook-started downloads."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from ebbtide.optim import OffloadedAdam  # noqa: E402
from ebbtide.optim._testing import round_moments_to_bf16  # noqa: E402
from ebbtide.testing.bits import bits_equal  # noqa: E402

pytestmark = pytest.mark.gpu

HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time queued before the write that a racing copy would miss


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).to(
        device="cuda", dtype=torch.bfloat16)


def batch(step):
    g = torch.Generator(device="cuda").manual_seed(1000 + step)
    x = torch.randn(64, 256, device="cuda", generator=g).to(torch.bfloat16)
    return x, torch.randn(64, 256, device="cuda", generator=g).to(torch.bfloat16)


def backward(model, step):
    x, y = batch(step)
    torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()


class CpuReference:
    """torch AdamW (foreach=False) on CPU fp32 masters, fed the bf16 grads the GPU model produced."""

    def __init__(self, model, **hyper):
        self.params = list(model.parameters())
        self.masters = [p.detach().float().cpu() for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, foreach=False, **hyper)

    def step(self):
        for m, p in zip(self.masters, self.params):
            m.grad = p.grad.detach().float().cpu()
        self.opt.step()


@pytest.mark.parametrize("overlap", [False, True])
def test_exact_mode_matches_torch_cpu_adamw(overlap):
    model = make_model()
    ref = CpuReference(model, **HYPER)
    opt = OffloadedAdam(model.parameters(), mode="exact", bucket_numel=64 * 1024, slots=2,
                        overlap_with_backward=overlap, **HYPER)
    assert len(opt.buckets) > 2
    for step in range(5):
        opt.zero_grad()
        backward(model, step)
        ref.step()
        opt.step()
        for m, p in zip(ref.masters, model.parameters()):
            assert bits_equal(opt.state[p]["master_param"], m)
            assert bits_equal(p.detach().cpu(), m.to(torch.bfloat16))


def test_close_to_gpu_adamw_within_fp32_rounding():
    model = make_model(1)
    masters = [p.detach().float().clone() for p in model.parameters()]
    ref = torch.optim.AdamW(masters, foreach=False, **HYPER)
    opt = OffloadedAdam(model.parameters(), mode="fast", bucket_numel=100_000, slots=3, **HYPER)
    for step in range(5):
        opt.zero_grad()
        backward(model, step)
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()
        ref.step()
        opt.step()
    for m, p in zip(masters, model.parameters()):
        # fp32 rounding over 5 steps (different op order on each side): 16 ulps of the value, 1e-3 of an lr step.
        torch.testing.assert_close(opt.state[p]["master_param"], m.cpu(), rtol=2e-6, atol=1e-6)
        # bf16 params: at most one bf16 ulp apart where the fp32 masters straddle a rounding boundary.
        torch.testing.assert_close(p.detach().float(), m.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-6)


def test_upload_is_ordered_after_writes_queued_before_step():
    """Poison the GPU params behind a long kernel, then step: the upload must land after the poison."""
    model = make_model(2)
    ref = CpuReference(model, **HYPER)
    opt = OffloadedAdam(model.parameters(), mode="exact", bucket_numel=64 * 1024, slots=2, **HYPER)
    for step in range(3):
        opt.zero_grad()
        backward(model, step)
        ref.step()
        torch.cuda._sleep(SLEEP_CYCLES)
        for p in model.parameters():
            p.data.fill_(float("nan"))
        opt.step()
        # Read on the current stream, no explicit synchronization: the next reader must see the new values.
        for m, p in zip(ref.masters, model.parameters()):
            got = p.detach().cpu()
            assert not torch.isnan(got).any(), "a poisoned param survived the step: the upload raced the poison"
            assert bits_equal(got, m.to(torch.bfloat16))


def test_download_is_ordered_after_grad_writes_queued_before_step():
    """Rescale the grads in place behind a long kernel; a download racing it would read the old grads."""
    model = make_model(3)
    ref = CpuReference(model, **HYPER)
    opt = OffloadedAdam(model.parameters(), mode="exact", bucket_numel=64 * 1024, slots=2, **HYPER)
    for step in range(3):
        opt.zero_grad()
        backward(model, step)
        ref.step()  # reads the grads before the rescale
        torch.cuda._sleep(SLEEP_CYCLES)
        for p in model.parameters():
            p.grad.mul_(2.0)  # exact in bf16
        opt.step(grad_scale=0.5)
        for m, p in zip(ref.masters, model.parameters()):
            assert bits_equal(opt.state[p]["master_param"], m)


def test_hooks_start_downloads_during_backward():
    model = make_model(4)
    opt = OffloadedAdam(model.parameters(), bucket_numel=64 * 1024, slots=2, overlap_with_backward=True, **HYPER)
    opt.zero_grad()
    backward(model, 0)
    assert sorted(opt._pending) == [0, 1], "the first `slots` buckets should already be downloading"
    opt.step()
    assert not opt._pending


def test_state_dict_round_trip_on_gpu():
    a, b = make_model(5), make_model(5)
    oa = OffloadedAdam(a.parameters(), mode="exact", **HYPER)
    ob = OffloadedAdam(b.parameters(), mode="exact", bucket_numel=64 * 1024, **HYPER)
    for step in range(2):
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            backward(m, step)
            o.step()
    c = make_model(6)
    oc = OffloadedAdam(c.parameters(), mode="exact", **HYPER)
    oc.load_state_dict(oa.state_dict())
    with torch.no_grad():
        for p, q in zip(c.parameters(), a.parameters()):
            p.copy_(q)
    for step in range(2, 4):
        for m, o in ((a, oa), (c, oc)):
            o.zero_grad()
            backward(m, step)
            o.step()
    for p, q in zip(a.parameters(), c.parameters()):
        assert bits_equal(p.detach(), q.detach())


def test_cpu_adam_refuses_cuda_tensors():
    import ebbtide
    from ebbtide.optim import CPUAdam

    with pytest.raises(ebbtide.InvalidArgumentError, match="CPU"):
        CPUAdam([torch.zeros(4, device="cuda")])
    p = torch.zeros(4)
    opt = CPUAdam([p])
    with pytest.raises(ebbtide.InvalidArgumentError, match="CPU"):
        opt.step(grads={p: torch.zeros(4, device="cuda")})


@pytest.mark.parametrize("overlap", [False, True])
def test_bf16_moments_exact_matches_torch_cpu_adamw_with_rounded_moments(overlap):
    """moments_dtype=torch.bfloat16 through the CUDA pipeline: master, GPU params and the bf16 host moments equal
    torch's CPU AdamW on fp32 copies of the moments, rounded to bf16 after every step."""
    model = make_model(3)
    ref = CpuReference(model, **HYPER)
    opt = OffloadedAdam(model.parameters(), mode="exact", bucket_numel=64 * 1024, slots=2,
                        overlap_with_backward=overlap, moments_dtype=torch.bfloat16, **HYPER)
    assert len(opt.buckets) > 2
    for step in range(5):
        opt.zero_grad()
        backward(model, step)
        ref.step()
        round_moments_to_bf16(ref.opt)
        opt.step()
        for m, p in zip(ref.masters, model.parameters()):
            assert bits_equal(opt.state[p]["master_param"], m)
            assert bits_equal(p.detach().cpu(), m.to(torch.bfloat16))
            for key in ("exp_avg", "exp_avg_sq"):
                assert bits_equal(opt.state[p][key], ref.opt.state[m][key].to(torch.bfloat16))


@pytest.mark.parametrize("overlap,mirror", [(False, False), (True, True)])
def test_a_step_interrupted_on_the_device_is_made_whole(overlap, mirror):
    """The CUDA pipeline (streams, copies in flight, hook-started downloads) interrupted by a kernel failure at a
    middle bucket: finished and raised, then bit-identical to an uninterrupted twin (params, master, moments)."""
    import ebbtide  # noqa: PLC0415
    from test_offloaded_interrupted import Inject  # noqa: PLC0415

    models = [make_model(), make_model()]
    opts = [OffloadedAdam(m.parameters(), mode="exact", bucket_numel=1 << 15, slots=2,
                          overlap_with_backward=overlap, **HYPER) for m in models]
    assert len(opts[0].buckets) >= 8
    if mirror:
        for o in opts:
            o.enable_param_mirror()
    for step in range(3):
        for m, o in zip(models, opts):
            o.zero_grad()
            backward(m, step)
        if step == 1:
            Inject(opts[0], at=4)
            with pytest.raises(ebbtide.StepError) as info:
                opts[0].step()
            assert info.value.completed and info.value.bucket == 4
        else:
            opts[0].step()
        opts[1].step()
        torch.cuda.synchronize()
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            assert bits_equal(p.detach(), q.detach())
            for key in ("master_param", "exp_avg", "exp_avg_sq"):
                assert bits_equal(opts[0].state[p][key], opts[1].state[q][key])
    if mirror:
        assert bits_equal(opts[0].param_mirror, opts[0].flat_params.cpu())
