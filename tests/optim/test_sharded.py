"""ShardedAdam on CPU shards (the same pipeline with synchronous copies): a set of shards cut from several tensors,
ranges of flat buffers with gaps between them and separate tensors of ragged sizes, gradients that stay put and
gradients handed over anew each step (FSDP2's), two param groups interleaved; exact mode against torch AdamW on
fp32 copies of each shard, bit for bit; bf16 moments; a step interrupted and made whole; state round trips; the
hooks; bad input. The CUDA path (streams, pinned slots, the host mirror on the device) is test_sharded_gpu.py."""
from __future__ import annotations

import copy
import dataclasses
import math

import pytest

torch = pytest.importorskip("torch")

import ebbtide  # noqa: E402
from ebbtide.optim import Shard, ShardedAdam  # noqa: E402
from ebbtide.optim._testing import round_moments_to_bf16  # noqa: E402
from ebbtide.testing.bits import bits_equal, describe_mismatch  # noqa: E402
from test_offloaded_interrupted import Inject  # noqa: E402  (the pipeline's kernel failing at a chosen call)

SIZES = [129, 1, 17, 0, 1000, 15, 127, 64, 300, 2]  # elements of each shard
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
GROUPS = [{}, {"weight_decay": 0.0, "lr": 3e-3}]
SENTINEL = 7.0  # what the gaps between a flat buffer's shards hold: never written by the optimizer


class Model:
    """The shards one rank owns: the first five are ranges of one flat param buffer with a gap after every second
    one (their gradients ranges of a flat grad buffer laid out the same way: some adjacent, some not); the rest
    separate tensors (2-D where the size allows) whose gradients a function returns, a new tensor every step,
    fp32 for one of them."""

    def __init__(self, seed=0, device="cpu", fp32_grad=True):
        g = torch.Generator().manual_seed(seed)
        self.device = device
        flat_n = sum(SIZES[:5]) + 3 * 5
        self.pflat = torch.full((flat_n,), SENTINEL, dtype=torch.bfloat16, device=device)
        self.gflat = torch.full((flat_n,), SENTINEL, dtype=torch.bfloat16, device=device)
        self.params, self.fixed_grads, off = [], [], 0
        for k, n in enumerate(SIZES[:5]):
            self.params.append(self.pflat[off:off + n])
            self.fixed_grads.append(self.gflat[off:off + n])
            off += n + (3 if k % 2 else 0)
        for n in SIZES[5:]:
            shape = (n // 5, 5) if n % 5 == 0 and n > 5 else (n,)
            self.params.append(torch.empty(shape, dtype=torch.bfloat16, device=device))
        with torch.no_grad():
            for p in self.params:
                p.copy_(torch.randn(p.shape, generator=g).to(torch.bfloat16))
        self.fp32 = {7} if fp32_grad else set()
        self.fresh: dict = {}  # shard -> this step's gradient tensor
        self.none: set = set()  # shards whose gradient is None this step

    def shards(self):
        out = []
        for i, p in enumerate(self.params):
            grad = self.fixed_grads[i] if i < 5 else (lambda i=i: None if i in self.none else self.fresh[i])
            out.append(Shard(p, grad, group=i % 2, counts_for_norm=i != 2,
                             grad_dtype=torch.float32 if i in self.fp32 else None))
        return out

    def set_grads(self, step):
        g = torch.Generator().manual_seed(1000 + step)
        for i, p in enumerate(self.params):
            x = (torch.randn(p.numel(), generator=g) * (10.0 ** (step % 3 - 2)))
            if i < 5:
                self.fixed_grads[i].copy_(x.to(torch.bfloat16))
            else:
                dt = torch.float32 if i in self.fp32 else torch.bfloat16
                self.fresh[i] = x.to(dt).reshape(p.shape).to(self.device)

    def grad(self, i):
        if i in self.none:
            return torch.zeros(self.params[i].shape)
        src = self.fixed_grads[i] if i < 5 else self.fresh[i]
        return src.detach().float().cpu().reshape(self.params[i].shape)

    def gaps_untouched(self) -> bool:
        owned = torch.zeros(self.pflat.numel(), dtype=torch.bool, device=self.device)
        for p in self.params[:5]:
            owned[p.storage_offset():p.storage_offset() + p.numel()] = True
        return bool((self.pflat[~owned].float() == SENTINEL).all())


class Reference:
    """torch AdamW (foreach=False) over an fp32 copy of each shard."""

    def __init__(self, model, moments_bf16=False):
        self.model = model
        self.masters = [p.detach().float().cpu().clone() for p in model.params]
        groups = [{"params": [m for i, m in enumerate(self.masters) if i % 2 == gi], **kw} for gi, kw in
                  enumerate(GROUPS)]
        self.opt = torch.optim.AdamW(groups, foreach=False, **HYPER)
        self.moments_bf16 = moments_bf16

    def step(self, scale=1.0):
        for i, m in enumerate(self.masters):
            m.grad = self.model.grad(i) * scale if scale != 1.0 else self.model.grad(i)
        self.opt.step()
        if self.moments_bf16:
            round_moments_to_bf16(self.opt)

    def check(self, opt):
        by_param = {id(p): i for i, p in enumerate(self.model.params)}
        for s in opt.shards:
            i = by_param[id(s.param)]
            m = self.masters[i]
            got = opt.state[s.param]["master_param"]
            assert bits_equal(got, m), (i, describe_mismatch(got, m))
            assert bits_equal(s.param.detach().cpu(), m.to(torch.bfloat16)), i
            for key in ("exp_avg", "exp_avg_sq"):
                want = self.opt.state[m][key]
                if self.moments_bf16:
                    want = want.to(torch.bfloat16)
                assert bits_equal(opt.state[s.param][key], want), (i, key)
        assert self.model.gaps_untouched()


def build(model, **kw):
    kw = {**HYPER, "mode": "exact", "bucket_numel": 64, "slots": 2, "threads": 2, **kw}
    return ShardedAdam(model.shards(), GROUPS, **kw)


@pytest.mark.parametrize("bucket_numel,slots", [(64, 1), (64, 2), (200, 3), (1 << 20, 2)])
def test_exact_mode_matches_torch_adamw_per_shard(bucket_numel, slots):
    model = Model()
    ref = Reference(model)
    opt = build(model, bucket_numel=bucket_numel, slots=slots)
    assert opt.numel == sum(SIZES) and opt.host_bytes == 12 * sum(SIZES)
    if bucket_numel == 64:
        assert len(opt.buckets) > slots and all(e - s <= 64 for s, e in opt.buckets)
    for step in range(5):
        model.set_grads(step)
        opt.step()
        ref.step()
        ref.check(opt)
    assert opt.step_count == 5 and opt.last_step_times["elements"] == opt.numel


def test_adjacent_shards_are_one_copy_and_groups_one_call_each():
    """Shards 0-1 and 2-3 are adjacent in the flat buffers (one copy each way per bucket they share); a bucket
    holding both groups makes one kernel call per group."""
    model = Model(fp32_grad=False)
    opt = build(model, bucket_numel=1 << 20)
    (bucket,) = opt._buckets
    assert [n for _, n, _ in bucket.uploads][:3] == [SIZES[0] + SIZES[1], SIZES[2] + SIZES[3], SIZES[4]]
    assert len(bucket.uploads) == 3 + len(SIZES) - 5
    assert sorted(gi for gi, *_ in bucket.calls) == [0, 1]
    model.set_grads(0)
    plan = opt._download_plan(opt._grads_now())  # the gradients handed over anew are a copy each
    assert [n for _, n, _ in plan[0]][:3] == [SIZES[0] + SIZES[1], SIZES[2] + SIZES[3], SIZES[4]]


@pytest.mark.parametrize("bucket_numel", [64, 1 << 20])
def test_bf16_moments_match_torch_adamw_with_rounded_moments(bucket_numel):
    model = Model(1)
    ref = Reference(model, moments_bf16=True)
    opt = build(model, bucket_numel=bucket_numel, moments_dtype=torch.bfloat16)
    assert opt.host_bytes == 8 * sum(SIZES) and opt.moments_dtype == torch.bfloat16
    for step in range(5):
        model.set_grads(step)
        opt.step()
        ref.step()
        ref.check(opt)


def test_a_gradient_of_none_is_a_zero_gradient_and_grad_scale_scales():
    model = Model(2)
    ref = Reference(model)
    opt = build(model)
    for step in range(3):
        model.set_grads(step)
        model.none = {6, 8} if step == 1 else set()
        opt.step(grad_scale=0.25)
        ref.step(scale=0.25)
        ref.check(opt)


def twins(**kw):
    models = [Model(3), Model(3)]
    seen = [[], []]
    opts = [build(m, after_step=lambda k=k: seen[k].append("gathered"), **kw) for k, m in enumerate(models)]
    return models, opts, seen


def assert_twins(opts):
    a, b = opts
    assert a.step_count == b.step_count
    for sa, sb in zip(a.shards, b.shards):
        assert bits_equal(sa.param, sb.param)
        for key in ("master_param", "exp_avg", "exp_avg_sq"):
            assert bits_equal(a.state[sa.param][key], b.state[sb.param][key]), key


@pytest.mark.parametrize("kw", [{}, {"moments_dtype": torch.bfloat16}], ids=["fp32", "bf16-moments"])
@pytest.mark.parametrize("mirror", [False, True], ids=["slots", "mirror"])
def test_a_kernel_error_inside_a_two_group_bucket_is_finished_then_raised(kw, mirror):
    """The failing call is the second (param group) of a bucket of two: its first call ran and must not run
    again when the step is finished; the hook still gathers, and the twins stay equal bit for bit."""
    models, opts, seen = twins(**kw)
    if mirror:
        for o in opts:
            o.enable_param_mirror()
    oa = opts[0]
    at = next(i for i, b in enumerate(oa._buckets) if len(b.calls) == 2)
    calls_before = sum(len(b.calls) for b in oa._buckets[:at]) + 1
    for step in range(4):
        for m in models:
            m.set_grads(step)
        if step == 1:
            Inject(oa, at=calls_before)
            with pytest.raises(ebbtide.StepError) as info:
                oa.step()
            e = info.value
            assert e.completed and e.bucket == at and e.buckets == len(oa.buckets) and e.step == 2, e
            assert isinstance(e.__cause__, RuntimeError) and "finished on the plain path" in str(e)
        else:
            oa.step()
        opts[1].step()
        assert_twins(opts)
        assert models[0].gaps_untouched()
    assert seen == [["gathered"] * 4] * 2  # after every whole step, the interrupted one too
    if mirror:
        for s in oa.shards:
            o = oa._offsets[oa.shards.index(s)]
            assert bits_equal(oa.param_mirror[o:o + s.param.numel()], s.param.reshape(-1))


def test_a_step_that_cannot_be_finished_refuses_until_a_checkpoint_loads():
    models, opts, seen = twins()
    oa, ob = opts
    for m in models:
        m.set_grads(0)
    oa.step()
    ob.step()
    checkpoint = ob.state_dict()
    params = [s.param.clone() for s in ob.shards]
    for m in models:
        m.set_grads(1)
    Inject(oa, at=2, times=10**6)  # the fault persists: the plain path fails too
    with pytest.raises(ebbtide.StepError) as info:
        oa.step()
    assert not info.value.completed and "could not be finished" in str(info.value)
    assert seen[0] == ["gathered"]  # no gather after a torn step
    with pytest.raises(ebbtide.StateError, match="mixes two versions"):
        oa.step()
    with pytest.raises(ebbtide.StateError):
        oa.state_dict()
    with pytest.raises(ebbtide.StateError):
        oa.local_shard(0, "exp_avg")
    oa._transport.kernel = oa._transport.kernel.kernel  # the fault is mended
    with torch.no_grad():
        for s, p in zip(oa.shards, params):
            s.param.copy_(p)
    oa.load_state_dict(checkpoint)
    for m in models:
        m.set_grads(1)
    oa.step()
    ob.step()
    assert_twins(opts)


def test_a_failure_before_any_kernel_call_changes_nothing():
    models, opts, seen = twins()
    oa = opts[0]
    models[0].set_grads(0)
    before = [oa.local_shard(i, "master_param") for i in range(len(SIZES))]
    Inject(oa, at=0)
    with pytest.raises(RuntimeError, match="injected"):
        oa.step()
    assert oa.step_count == 0 and seen[0] == []
    assert all(bits_equal(oa.local_shard(i, "master_param"), b) for i, b in enumerate(before))
    oa.step()  # and the next one runs
    assert oa.step_count == 1


def test_keyboard_interrupt_is_raised_as_is_after_the_step_is_whole():
    models, opts, seen = twins()
    for m in models:
        m.set_grads(0)
    Inject(opts[0], at=4, exc=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        opts[0].step()
    opts[1].step()
    assert_twins(opts)
    assert seen == [["gathered"], ["gathered"]]


def test_state_dict_round_trip_into_another_layout_and_into_torch_adamw():
    a = Model(4)
    oa = build(a, bucket_numel=64)
    for step in range(3):
        a.set_grads(step)
        oa.step()
    sd = oa.state_dict()
    assert float(sd["state"][0]["step"]) == 3.0 and set(sd["state"][0]) >= {"exp_avg", "exp_avg_sq", "master_param"}
    b = Model(9)
    with torch.no_grad():
        for p, q in zip(b.params, a.params):
            p.copy_(q)
    ob = build(b, bucket_numel=256, slots=3, lr=0.5)
    ob.load_state_dict(sd)
    assert ob.param_groups[1]["lr"] == 3e-3 and ob.step_count == 3
    # torch's AdamW over fp32 copies of the shards takes the same state dict (torch's format, params group by group)
    ref = Reference(a)
    ref.opt.load_state_dict(copy.deepcopy(sd))  # (the state dict holds views of oa's live state)
    for m, p in zip(ref.masters, a.params):
        m.copy_(oa.state[p]["master_param"])
    for step in range(3, 6):
        for m in (a, b):
            m.set_grads(step)
        oa.step()
        ob.step()
        ref.step()
        ref.check(oa)
    assert_twins([oa, ob])


def test_local_shards_round_trip_with_the_step_count():
    a, c = Model(5), Model(6)
    oa, oc = build(a), build(c, bucket_numel=100)
    for step in range(2):
        a.set_grads(step)
        oa.step()
    for i in range(len(SIZES)):
        for key in ("master_param", "exp_avg", "exp_avg_sq"):
            t = oa.local_shard(i, key)
            assert t.dtype == torch.float32 and t.shape == a.params[i].shape
            oc.set_local_shard(i, key, t)
    oc.set_step_count(oa.step_count)
    oc.upload_params_from_master()
    for step in range(2, 4):
        for m in (a, c):
            m.set_grads(step)
        oa.step()
        oc.step()
    assert_twins([oa, oc])
    with pytest.raises(ebbtide.InvalidArgumentError, match="elements"):
        oc.set_local_shard(0, "exp_avg", torch.zeros(3))
    with pytest.raises(ebbtide.InvalidArgumentError, match="key must be one of"):
        oc.local_shard(0, "max_exp_avg_sq")
    with pytest.raises(ebbtide.InvalidArgumentError, match="shard index"):
        oc.local_shard(len(SIZES), "exp_avg")


def test_param_mirror_follows_every_step_and_rebuilds_the_shards():
    model = Model(7)
    ref = Reference(model)
    opt = build(model)
    mirror = opt.enable_param_mirror()
    assert opt.enable_param_mirror() is mirror and mirror.numel() == opt.numel
    for step in range(3):
        model.set_grads(step)
        opt.step()
        ref.step()
    with torch.no_grad():
        for p in model.params:
            p.fill_(float("nan"))  # dropped
    opt.upload_params_from_mirror()
    ref.check(opt)


def test_the_hooks_reduce_the_norm_and_the_non_finite_check():
    """``all_reduce`` stands for a second rank holding the same gradients: the norm's squares and the check's
    verdict go through it; the shard that does not count for the norm is left out of it."""
    model = Model(8)
    calls = []

    def all_reduce(t, op):
        calls.append(op)
        return t * 2 if op == torch.distributed.ReduceOp.SUM else t

    opt = build(model, all_reduce=all_reduce)
    model.set_grads(0)
    want = math.sqrt(2 * sum(float((model.grad(i).double() ** 2).sum()) for i in range(len(SIZES)) if i != 2))
    got = opt.grad_norm()
    assert abs(got - want) <= 1e-5 * want, (got, want)
    assert not opt.has_non_finite_grad()
    model.fixed_grads[2][3] = float("inf")  # in the shard that does not count for the norm
    assert opt.has_non_finite_grad()
    model.fixed_grads[2][3] = 0.0
    model.fresh[9][0] = float("nan")
    assert opt.has_non_finite_grad()
    assert calls == [torch.distributed.ReduceOp.SUM] + [torch.distributed.ReduceOp.MAX] * 3


def test_bad_input_is_refused_and_changes_nothing():
    model = Model(9)
    shards = model.shards()
    p, g = shards[5].param, torch.zeros(shards[5].param.numel(), dtype=torch.bfloat16)
    bad = {
        "bf16 tensor": [Shard(p.float(), g)],
        "overlaps": [Shard(model.pflat[0:10], g[:10]), Shard(model.pflat[5:15], g[:10])],
        "elements on": [Shard(p, g[:-1])],
        "names group 2": [Shard(p, g, group=2)],
        "function returning one": [Shard(p, "grad")],
        "grad_dtype": [Shard(p, g, grad_dtype=torch.float16)],
        "no shards": [],
    }
    for match, sh in bad.items():
        with pytest.raises(ebbtide.InvalidArgumentError, match=match):
            ShardedAdam(sh, GROUPS)
    with pytest.raises(ebbtide.InvalidArgumentError, match="without 'params'"):
        ShardedAdam(shards, [{"params": [p]}])
    with pytest.raises(ebbtide.InvalidArgumentError, match="bucket_numel"):
        ShardedAdam(shards, GROUPS, bucket_numel=8)
    with pytest.raises(ebbtide.InvalidArgumentError, match="after_step"):
        ShardedAdam(shards, GROUPS, after_step=3)
    with pytest.raises(ebbtide.InvalidArgumentError, match="amsgrad needs fp32 moments"):
        ShardedAdam(shards, GROUPS, amsgrad=True, moments_dtype=torch.bfloat16)
    with pytest.raises(ebbtide.InvalidArgumentError, match="lr"):
        ShardedAdam(shards, [{}, {"lr": -1.0}])
    opt = build(model)
    model.set_grads(0)
    before = [opt.local_shard(i, "master_param") for i in range(len(SIZES))]
    model.fresh[6] = model.fresh[6].float()  # a gradient of the wrong dtype this step
    with pytest.raises(ebbtide.InvalidArgumentError, match="shard 6"):
        opt.step()
    model.set_grads(0)
    model.fresh[8] = model.fresh[8][:-1]  # of the wrong size
    with pytest.raises(ebbtide.InvalidArgumentError, match="shard 8"):
        opt.step()
    opt.param_groups[1]["betas"] = (0.9, 1.5)
    model.set_grads(0)
    with pytest.raises(ebbtide.InvalidArgumentError, match="betas"):
        opt.step()
    assert opt.step_count == 0
    assert all(bits_equal(opt.local_shard(i, "master_param"), b) for i, b in enumerate(before))
    with pytest.raises(ebbtide.StateError):
        opt.add_param_group({"params": []})


def test_a_shard_moved_to_another_storage_is_refused_by_name_before_anything_changes():
    """The optimizer's views of a shard read the storage it had at construction: a param (or a gradient that stays
    put) ``set_`` onto another storage is refused at ``step`` and at the mirror's and masters' uploads, naming the
    shard; put back, the step runs. A storage resized in place (the views' own storage, as ebbtide.memory and
    Megatron's offload re-back it) passes."""
    model = Model(5)
    shards = [dataclasses.replace(s, name=f"layer{i}.weight") for i, s in enumerate(model.shards())]
    opt = ShardedAdam(shards, GROUPS, **{**HYPER, "mode": "exact", "bucket_numel": 64, "slots": 2, "threads": 2})
    opt.enable_param_mirror()
    model.set_grads(0)
    opt.step()
    grad, alias = model.fixed_grads[1], model.fixed_grads[1].view(-1)
    grad.set_(grad.clone())
    with pytest.raises(ebbtide.StateError, match=r"gradient of shard 1 \(layer1.weight\) was moved"):
        opt.step()
    grad.set_(alias.untyped_storage(), alias.storage_offset(), grad.shape, grad.stride())
    moved = model.params[6]
    kept = moved.detach().clone()
    masters = [opt.local_shard(i, "master_param") for i in range(len(SIZES))]
    moved.set_(moved.detach().clone())  # another storage, the same values: the views still read the old one
    for call in (opt.step, opt.upload_params_from_mirror, opt.upload_params_from_master):
        model.set_grads(1)
        with pytest.raises(ebbtide.StateError, match=r"param of shard 6 \(layer6.weight\) was moved"):
            call()
    assert opt.step_count == 1 and bits_equal(moved, kept)
    assert all(bits_equal(opt.local_shard(i, "master_param"), m) for i, m in enumerate(masters))
    model = Model(6)
    opt = build(model)
    ref = Reference(model)
    st = model.params[7].untyped_storage()
    saved, n = model.params[7].detach().clone(), st.nbytes()
    st.resize_(0)  # the storage itself re-allocated: every view of it follows
    st.resize_(n)
    model.params[7].copy_(saved)
    model.set_grads(0)
    opt.step()
    ref.step()
    ref.check(opt)


def test_amsgrad_and_maximize_match_torch():
    model = Model(10)
    masters = [p.detach().float().clone() for p in model.params]
    ref = torch.optim.AdamW(masters, foreach=False, amsgrad=True, maximize=True, **HYPER)
    opt = ShardedAdam(model.shards(), [{}, {}], amsgrad=True, maximize=True, mode="exact", bucket_numel=64, **HYPER)
    assert opt.host_bytes == 16 * sum(SIZES)
    for step in range(3):
        model.set_grads(step)
        for i, m in enumerate(masters):
            m.grad = model.grad(i)
        opt.step()
        ref.step()
    for s, m in zip(opt.shards, masters):
        assert bits_equal(opt.state[s.param]["master_param"], m)
        assert bits_equal(opt.state[s.param]["max_exp_avg_sq"], ref.state[m]["max_exp_avg_sq"])
