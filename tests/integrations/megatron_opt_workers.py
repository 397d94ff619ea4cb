"""Rank bodies for the optimizer adapter on CPU tensors (Gloo). A torch module with bf16 params stands in for a model
chunk (Megatron's DDP needs CUDA); ``param.main_grad`` is filled as DDP would (fp32, averaged over DP), so the
adapter's main-grad path, Megatron's param groups, the grad-stats group and Megatron's own Float16 optimizer
state_dict code all run for real. The reference is torch AdamW (foreach=False) on fp32 masters."""
from __future__ import annotations

import datetime
import io
import types
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.optimizer import OptimizerConfig  # noqa: E402
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params  # noqa: E402

import ebbtide.integrations.megatron as ebt  # noqa: E402
from ebbtide.testing.spawn import join_store  # noqa: E402
from ebbtide.errors import InvalidArgumentError, UnsupportedError  # noqa: E402
from ebbtide.optim._testing import round_moments_to_bf16  # noqa: E402

WD = 0.1


def _setup(rank, world, init):
    dist.init_process_group("gloo", store=join_store(init), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    ps.initialize_model_parallel()  # DP = world


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(29, 48), torch.nn.LayerNorm(48), torch.nn.GELU(),
                            torch.nn.Linear(48, 11))
    return m.to(torch.bfloat16)


def _config(**kw):
    base = dict(lr=1e-2, weight_decay=WD, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, bf16=True,
                clip_grad=0.0)
    base.update(kw)
    return OptimizerConfig(**base)


def _apply_schedule(groups):
    """What Megatron's OptimizerParamScheduler writes into the groups: weight_decay * wd_mult (0 for biases and
    norms), lr * lr_mult."""
    for g in groups:
        g["weight_decay"] = WD * g["wd_mult"]
        g["lr"] = 1e-2 * g["lr_mult"]


def _fill_main_grads(model, step, rank, world):
    """Backward on this rank's batch, then main_grad = DP average in fp32 (what DDP's buffer holds)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 29, generator=g).bfloat16()
    y = torch.randn(8, 11, generator=g)
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    for p, gr in zip(model.parameters(), grads):
        t = gr.float()
        dist.all_reduce(t)
        p.main_grad = t / world


class _Reference:
    """Megatron's Float16OptimizerWithFloat16Params logic on CPU: torch AdamW (foreach=False) over fp32 copies of
    the params in the same param groups; grads = main_grad rounded to bf16 (what crosses PCIe on our path), times
    the clip coefficient."""

    def __init__(self, opt):
        self.groups_params = [list(g["params"]) for g in opt.param_groups]
        self.masters = [[p.detach().float().clone() for p in g] for g in self.groups_params]
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": ms}
                  for g, ms in zip(opt.param_groups, self.masters)]
        self.opt = torch.optim.AdamW(groups, foreach=False)

    def step(self, clip_coeff=1.0):
        for g, ms in zip(self.groups_params, self.masters):
            for p, m in zip(g, ms):
                m.grad = p.main_grad.to(torch.bfloat16).float()
                if clip_coeff != 1.0:
                    m.grad = m.grad * clip_coeff
        self.opt.step()

    def megatron_view(self, config):
        """A Float16OptimizerWithFloat16Params holding this state, built without its CUDA-only constructor, so
        Megatron's own state_dict/load_state_dict code runs on it."""
        meg = Float16OptimizerWithFloat16Params.__new__(Float16OptimizerWithFloat16Params)
        meg.optimizer, meg.config, meg.grad_scaler = self.opt, config, None
        meg.init_state_fn = lambda *a, **k: None
        meg.is_stub_optimizer = False
        meg.fp32_from_float16_groups = self.masters
        return meg


def _assert_masters(opt, ref):
    for g, ms in zip(ref.groups_params, ref.masters):
        for p, m in zip(g, ms):
            got = opt.optimizer.state[p]["master_param"]
            assert torch.equal(got.view(torch.int32), m.detach().view(torch.int32)), "master differs"
            assert torch.equal(p.detach(), m.detach().to(torch.bfloat16)), "bf16 param differs"


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _resumed(model, cfg, sd):
    """A copy of ``model`` with an exact-mode ebbtide optimizer that loaded ``sd`` (through torch.save/load):
    (model, optimizer), to continue beside the original."""
    m2 = _model()
    with torch.no_grad():
        for p, q in zip(m2.parameters(), model.parameters()):
            p.copy_(q)
    o2 = ebt.get_optimizer(cfg, [m2], mode="exact", bucket_numel=512)
    o2.load_state_dict(_roundtrip(sd))
    return m2, o2


def exact_steps(rank, world, init, steps=4):
    """Exact mode equals the reference bit for bit, with and without clipping; the step reports Megatron's tuple."""
    _setup(rank, world, init)
    out = {}
    for clip in (0.0, 0.05):
        model = _model()
        opt = ebt.get_optimizer(_config(clip_grad=clip), [model], mode="exact", bucket_numel=256)
        assert all(p.grad is None for p in model.parameters())
        _apply_schedule(opt.param_groups)
        wd_mults = sorted({g["wd_mult"] for g in opt.param_groups})
        assert wd_mults == [0.0, 1.0], wd_mults  # Megatron's groups: no decay on biases and norms
        ref = _Reference(opt)
        norms = []
        for step in range(steps):
            _fill_main_grads(model, step, rank, world)
            ok, norm, zeros = opt.step()
            assert ok and zeros == 0
            assert set(opt.last_step_times) == {"prepare_s", "norm_s", "hooks_s", "update_s"}  # where the step went
            assert all(x >= 0 for x in opt.last_step_times.values()), opt.last_step_times
            coeff = 1.0
            if clip:
                want = torch.sqrt(sum((p.main_grad.to(torch.bfloat16).float() ** 2).sum()
                                      for p in model.parameters())).item()
                assert abs(norm - want) <= 1e-5 * want, (norm, want)
                coeff = min(1.0, clip / (norm + 1e-6))
                norms.append(norm)
            ref.step(coeff)
            assert all(p.grad is None for p in model.parameters())
            _assert_masters(opt, ref)
        out[f"clip{clip}"] = norms
    return out


def state_dicts(rank, world, init):
    """ours -> ours, ours -> Megatron's Float16 optimizer and back, Megatron's -> ours: every load continues
    training bit for bit like the optimizer that was never saved."""
    _setup(rank, world, init)
    cfg = _config()
    model = _model()
    opt = ebt.get_optimizer(cfg, [model], mode="exact", bucket_numel=256)
    _apply_schedule(opt.param_groups)
    ref = _Reference(opt)
    for step in range(3):
        _fill_main_grads(model, step, rank, world)
        opt.step()
        ref.step()
    sd = _roundtrip(opt.state_dict())
    assert set(sd) == {"optimizer", "fp32_from_fp16_params"}
    assert all("master_param" not in s for s in sd["optimizer"]["state"].values())
    assert "master_param" in opt.optimizer.state[next(iter(model.parameters()))]  # the live state is intact
    meg_sd = _roundtrip(ref.megatron_view(cfg).state_dict())
    assert set(meg_sd) == set(sd) and set(meg_sd["optimizer"]["state"]) == set(sd["optimizer"]["state"])

    # Megatron's Float16 optimizer loads ours and holds the same state as the reference.
    other = _Reference(opt)
    other.megatron_view(cfg).load_state_dict(_roundtrip(sd))
    for a, b in zip(other.masters, ref.masters):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    for a, b in zip(other.masters, ref.masters):
        for x, y in zip(a, b):
            st, st2 = other.opt.state[x], ref.opt.state[y]
            assert torch.equal(st["exp_avg"], st2["exp_avg"]) and torch.equal(st["exp_avg_sq"], st2["exp_avg_sq"])
            assert float(st["step"]) == float(st2["step"]) == 3.0

    # Ours loads ours, and ours loads Megatron's: both continue exactly like the uninterrupted pair.
    loaded = []
    for src in (sd, meg_sd):
        loaded.append(_resumed(model, cfg, src))
    for step in range(3, 5):
        _fill_main_grads(model, step, rank, world)
        opt.step()
        ref.step()
        for m2, o2 in loaded:
            for p, q in zip(m2.parameters(), model.parameters()):
                p.main_grad = q.main_grad.clone()
            o2.step()
    _assert_masters(opt, ref)
    for m2, o2 in loaded:
        for p, q in zip(m2.parameters(), model.parameters()):
            assert torch.equal(p, q)
        assert all(torch.equal(o2.optimizer.state[p]["master_param"], opt.optimizer.state[q]["master_param"])
                   for p, q in zip(m2.parameters(), model.parameters()))

    # A state dict of another model is refused and changes nothing.
    before = [p.detach().clone() for p in model.parameters()]
    bad = _roundtrip(sd)
    bad["fp32_from_fp16_params"][0] = bad["fp32_from_fp16_params"][0][:-1]
    try:
        opt.load_state_dict(bad)
    except InvalidArgumentError as e:
        msg = str(e)
    else:
        raise AssertionError("a mismatched state dict was accepted")
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    return {"refused": msg}


def bad_configs(rank, world, init):
    """Every refused setting raises UnsupportedError naming it, before anything is built."""
    _setup(rank, world, init)
    msgs = {}
    cases = {
        "fp16": dict(fp16=True, bf16=False),
        "bf16=False": dict(bf16=False),
        "optimizer_cpu_offload": dict(optimizer_cpu_offload=True),
        "optimizer='sgd'": dict(optimizer="sgd"),
        # Megatron's own config validation needs Transformer Engine for the precision-aware optimizer: the
        # fields are set after construction, as a config built on a TE machine carries them.
        "exp_avg_dtype": dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.float32),
        "main_params_dtype": dict(main_params_dtype=torch.float16),
    }
    for key, kw in cases.items():
        model = _model()
        ptrs = [p.data_ptr() for p in model.parameters()]
        cfg = _config(**{k: v for k, v in kw.items() if not k.endswith("_dtype")})
        for k, v in kw.items():
            if k.endswith("_dtype"):
                setattr(cfg, k, v)
                cfg.use_precision_aware_optimizer = True
        try:
            ebt.get_optimizer(cfg, [model])
        except UnsupportedError as e:
            assert key in str(e), (key, str(e))
            msgs[key] = str(e)
        else:
            raise AssertionError(f"{key} was accepted")
        assert ptrs == [p.data_ptr() for p in model.parameters()]  # params untouched
    try:  # the sharded form needs Megatron's DDP built for it too
        ebt.get_optimizer(_config(use_distributed_optimizer=True), [_model()])
    except InvalidArgumentError as e:
        msgs["use_distributed_optimizer"] = str(e)
    else:
        raise AssertionError("use_distributed_optimizer=True with a plain model was accepted")
    fp8 = _model()
    fp8.config = types.SimpleNamespace(fp8="hybrid", fp8_param=True, virtual_pipeline_model_parallel_size=None)
    for key, chunks in (("pipeline interleaving", [_model(), _model()]), ("fp8='hybrid'", [fp8])):
        ptrs = [p.data_ptr() for c in chunks for p in c.parameters()]
        try:
            ebt.get_optimizer(_config(), chunks)
        except UnsupportedError as e:
            assert key in str(e), (key, str(e))
            msgs[key] = str(e)
        else:
            raise AssertionError(f"{key} was accepted")
        assert ptrs == [p.data_ptr() for c in chunks for p in c.parameters()]  # params untouched
    fp32 = _model().float()
    try:
        ebt.get_optimizer(_config(), [fp32])
    except UnsupportedError as e:
        msgs["fp32 params"] = str(e)
    else:
        raise AssertionError("fp32 params were accepted")
    try:
        ebt.TrainingState([_model()])
    except (UnsupportedError, InvalidArgumentError) as e:
        msgs["training_state"] = f"{type(e).__name__}: {e}"
    else:
        raise AssertionError("TrainingState accepted a plain module")
    return msgs


def _precision_aware_config(**kw):
    """exp_avg/exp_avg_sq in bf16 as Megatron carries them: Megatron's own config validation needs Transformer Engine
    for the precision-aware optimizer (and demands use_distributed_optimizer=True), so the fields are set after
    construction, as a config built on a TE machine carries them."""
    cfg = _config(**kw)
    cfg.use_precision_aware_optimizer = True
    cfg.use_distributed_optimizer = True
    cfg.exp_avg_dtype = cfg.exp_avg_sq_dtype = torch.bfloat16
    return cfg


def bf16_moments(rank, world, init, steps=3):
    """Precision-aware bf16 moments: exact steps equal torch AdamW on fp32 copies of the moments rounded to bf16
    after every step; Megatron's Float16 optimizer loads the checkpoint (moments upcast, exactly) and ours loads it
    back and continues bit for bit."""
    _setup(rank, world, init)
    cfg = _precision_aware_config(clip_grad=0.05)
    model = _model()
    opt = ebt.get_optimizer(cfg, [model], mode="exact", bucket_numel=256)
    assert opt.optimizer.moments_dtype == torch.bfloat16
    _apply_schedule(opt.param_groups)
    ref = _Reference(opt)
    for step in range(steps):
        _fill_main_grads(model, step, rank, world)
        ok, norm, _ = opt.step()
        assert ok
        ref.step(min(1.0, 0.05 / (norm + 1e-6)))
        round_moments_to_bf16(ref.opt)
        _assert_masters(opt, ref)
    for g, ms in zip(ref.groups_params, ref.masters):
        for p, m in zip(g, ms):
            for key in ("exp_avg", "exp_avg_sq"):
                got = opt.optimizer.state[p][key]
                assert got.dtype == torch.bfloat16 and torch.equal(got, ref.opt.state[m][key].to(torch.bfloat16))
    sd = _roundtrip(opt.state_dict())
    other = _Reference(opt)
    other.megatron_view(cfg).load_state_dict(_roundtrip(sd))
    for a, b in zip(other.masters, ref.masters):
        for x, y in zip(a, b):
            assert other.opt.state[x]["exp_avg_sq"].dtype == torch.float32
            assert torch.equal(other.opt.state[x]["exp_avg_sq"], ref.opt.state[y]["exp_avg_sq"])
    m2, o2 = _resumed(model, cfg, sd)
    for step in range(steps, steps + 2):
        _fill_main_grads(model, step, rank, world)
        opt.step()
        for p, q in zip(m2.parameters(), model.parameters()):
            p.main_grad = q.main_grad.clone()
        o2.step()
    assert all(torch.equal(p, q) for p, q in zip(m2.parameters(), model.parameters()))
    return {"steps": steps}
