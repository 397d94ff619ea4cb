"""ShardedAdam on CUDA shards: the same set of shards as test_sharded.py (ranges of flat buffers with gaps, separate
tensors, gradients handed over anew each step) on the device, through the real pipeline (runtime-owned streams,
pinned slots, copies in flight): exact equality with torch's CPU AdamW per shard, the host mirror rebuilding the
shards, the stream ordering of uploads and downloads, and a step interrupted on the device made whole."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import ebbtide  # noqa: E402
from ebbtide.testing.bits import bits_equal  # noqa: E402
from test_offloaded_interrupted import Inject  # noqa: E402
from test_sharded import Model, Reference, assert_twins, build  # noqa: E402

pytestmark = pytest.mark.gpu

SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time queued before the write that a racing copy would miss


@pytest.mark.parametrize("mirror", [False, True], ids=["slots", "mirror"])
@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-moments"])
def test_exact_mode_matches_torch_cpu_adamw_per_shard(mirror, moments):
    model = Model(device="cuda")
    ref = Reference(model, moments_bf16=moments == torch.bfloat16)
    opt = build(model, moments_dtype=moments, slots=2)
    if mirror:
        opt.enable_param_mirror()
    assert opt._gslots[0].is_pinned() and opt._oslots[0].is_pinned()
    for step in range(4):
        model.set_grads(step)
        opt.step()
        ref.step()
        ref.check(opt)  # read on the caller's stream without a synchronize: it waits for the uploads
    if mirror:
        with torch.no_grad():
            for p in model.params:
                p.fill_(float("nan"))
        opt.upload_params_from_mirror()
        ref.check(opt)


def test_upload_is_ordered_after_writes_queued_before_step_and_download_after_grad_writes():
    """Behind a long kernel on the caller's stream: the params are poisoned (an upload racing it would be
    overwritten) and the gradients doubled (a download racing it would read the old ones)."""
    model = Model(1, device="cuda", fp32_grad=False)
    ref = Reference(model)
    opt = build(model, bucket_numel=256, slots=2)
    for step in range(3):
        model.set_grads(step)
        ref.step()  # reads the gradients before the doubling
        torch.cuda._sleep(SLEEP_CYCLES)
        with torch.no_grad():
            for p in model.params:
                p.fill_(float("nan"))
            for g in model.fixed_grads:
                g.mul_(2.0)  # exact in bf16
            for g in model.fresh.values():
                g.mul_(2.0)
        opt.step(grad_scale=0.5)
        ref.check(opt)


def test_a_step_interrupted_on_the_device_is_made_whole():
    models = [Model(3, device="cuda"), Model(3, device="cuda")]
    opts = [build(m, bucket_numel=128, slots=2) for m in models]
    at = next(i for i, b in enumerate(opts[0]._buckets) if len(b.calls) == 2 and i >= 2)
    for step in range(3):
        for m in models:
            m.set_grads(step)
        if step == 1:
            Inject(opts[0], at=sum(len(b.calls) for b in opts[0]._buckets[:at]) + 1)
            with pytest.raises(ebbtide.StepError) as info:
                opts[0].step()
            assert info.value.completed and info.value.bucket == at
        else:
            opts[0].step()
        opts[1].step()
        torch.cuda.synchronize()
        assert_twins(opts)
        assert models[0].gaps_untouched()
