"""Optimizer input checks (ebbtide.optim._validate) on CPUAdam and OffloadedAdam: a tensor passed twice or
overlapping another, hyper-parameters of the wrong type or range in any group (checked before any group steps),
and loaded state of the wrong shape are refused with InvalidArgumentError, and nothing changes."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from ebbtide import InvalidArgumentError as E  # noqa: E402
from ebbtide.optim import CPUAdam, OffloadedAdam  # noqa: E402


def _bf16_params(*shapes):
    return [torch.nn.Parameter(torch.randn(*s).to(torch.bfloat16)) for s in shapes]


@pytest.mark.parametrize("make", [
    lambda a, b: [a, a],
    lambda a, b: [{"params": [a]}, {"params": [a]}],
    lambda a, b: [{"params": [a, b, a]}],
])
def test_cpu_adam_rejects_a_param_passed_twice(make):
    a, b = torch.randn(10), torch.randn(10)
    with pytest.raises(E, match="same tensor"):
        CPUAdam(make(a, b))


def test_cpu_adam_rejects_overlapping_views_but_not_neighbours():
    base = torch.randn(100)
    with pytest.raises(E, match="overlaps"):
        CPUAdam([base[:60], base[40:]])
    with pytest.raises(E, match="overlaps"):
        CPUAdam([base, base[10:20]])
    CPUAdam([base[:50], base[50:]])  # adjacent views of one storage do not overlap


def test_add_param_group_refuses_a_held_param_and_adds_nothing():
    a, b = torch.randn(4), torch.randn(4)
    opt = CPUAdam([a])
    with pytest.raises(E, match="same tensor"):
        opt.add_param_group({"params": [b, a]})
    with pytest.raises(E, match="lr"):
        opt.add_param_group({"params": [b], "lr": "0.1"})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": b, "lr": 0.5})
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == 0.5


@pytest.mark.parametrize("key,value,match", [
    ("lr", "0.1", r"lr must be a number \(got '0.1' \(str\)\)"),
    ("lr", float("inf"), "lr"),
    ("lr", torch.tensor([1e-3, 1e-3]), "one-element"),
    ("lr", torch.tensor(1), "floating-point"),
    ("lr", True, "lr"),
    ("betas", (0.9,), "pair"),
    ("betas", "ab", "pair"),
    ("betas", (0.9, 1.0), r"betas\[1\]"),
    ("betas", (0.9, "0.99"), r"betas\[1\]"),
    ("eps", "1e-8", "eps"),
    ("eps", -1e-8, "eps"),
    ("weight_decay", None, "weight_decay"),
    ("weight_decay", float("nan"), "weight_decay"),
    ("amsgrad", "yes", "amsgrad"),
    ("maximize", 2, "maximize"),
    ("mode", "quick", "mode"),
])
def test_bad_hyper_parameter_in_any_group_fails_before_any_group_steps(key, value, match):
    a, b = torch.randn(1000), torch.randn(1000)
    opt = CPUAdam([{"params": [a]}, {"params": [b]}], lr=1e-2)
    a0, b0 = a.clone(), b.clone()
    opt.param_groups[1][key] = value
    with pytest.raises(E, match=match):
        opt.step(grads={a: torch.randn(1000), b: torch.randn(1000)})
    assert torch.equal(a, a0) and torch.equal(b, b0) and len(opt.state) == 0
    with pytest.raises(E, match=match):
        CPUAdam([torch.randn(3)], **({key: value} if key != "mode" else {"mode": value}))


def test_constructor_and_step_argument_types():
    with pytest.raises(E, match="lr"):
        CPUAdam([torch.randn(3)], lr="0.1")
    with pytest.raises(E, match="threads"):
        CPUAdam([torch.randn(3)], threads=True)
    with pytest.raises(E, match="isa"):
        CPUAdam([torch.randn(3)], isa=3)
    with pytest.raises(E, match="empty"):
        CPUAdam([])
    p = torch.randn(3)
    opt = CPUAdam([p])
    with pytest.raises(E, match="grad_scale"):
        opt.step(grads={p: torch.randn(3)}, grad_scale="2")
    with pytest.raises(E, match="not a param"):
        opt.step(grads={torch.randn(3): torch.randn(3)})
    with pytest.raises(E, match="grads must map"):
        opt.step(grads=[torch.randn(3)])
    assert len(opt.state) == 0


def _stepped_cpu_adam(shape=(2, 3)):
    p = torch.randn(*shape)
    opt = CPUAdam([p], lr=1e-2)
    opt.step(grads={p: torch.randn(*shape)})
    return p, opt


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
def test_cpu_adam_load_state_dict_rejects_wrong_shape_state(key):
    p, opt = _stepped_cpu_adam()
    sd = copy.deepcopy(opt.state_dict())  # torch's state_dict shares the live per-param dicts
    good = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
    sd["state"][0][key] = sd["state"][0][key].reshape(6)  # same numel, other shape: was silently reshaped
    with pytest.raises(E, match=rf"'{key}'\] has shape \(6,\) but its param has shape \(2, 3\)"):
        opt.load_state_dict(sd)
    for k, v in good.items():
        assert torch.equal(opt.state[p][k], v)


def test_cpu_adam_load_state_dict_rejects_bad_groups_and_steps():
    p, opt = _stepped_cpu_adam()
    for mutate, match in [
        (lambda sd: sd["param_groups"][0].__setitem__("lr", "0.1"), "lr"),
        (lambda sd: sd["state"][0].__setitem__("step", torch.tensor(float("nan"))), "step"),
        (lambda sd: sd["state"][0].__setitem__("exp_avg", [0.0] * 6), "floating-point tensor"),
        (lambda sd: sd.pop("param_groups"), "param_groups"),
    ]:
        sd = copy.deepcopy(opt.state_dict())
        mutate(sd)
        with pytest.raises(E, match=match):
            opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 1e-2
    with pytest.raises(E, match="mapping"):
        opt.load_state_dict([1, 2])


def test_state_set_behind_the_optimizer_with_another_shape_is_refused_at_step():
    p, opt = _stepped_cpu_adam()
    opt.state[p]["exp_avg"] = torch.zeros(6)
    p0 = p.clone()
    with pytest.raises(E, match="exp_avg"):
        opt.step(grads={p: torch.randn(2, 3)})
    assert torch.equal(p, p0)


def test_offloaded_rejects_duplicates_bad_groups_and_bad_state():
    a, b = _bf16_params((4, 4), (8,))
    with pytest.raises(E, match="same tensor"):
        OffloadedAdam([a, b, a])
    with pytest.raises(E, match="same tensor"):
        OffloadedAdam([{"params": [a]}, {"params": [a, b]}])
    with pytest.raises(E, match="lr"):
        OffloadedAdam([a], lr="0.1")
    opt = OffloadedAdam([{"params": [a]}, {"params": [b]}], lr=1e-2)
    for p in (a, b):
        p.grad.copy_(torch.randn(p.shape).to(torch.bfloat16))
    opt.step()
    before = [a.detach().clone(), b.detach().clone()]
    opt.param_groups[1]["lr"] = "0.1"
    with pytest.raises(E, match=r"param_groups\[1\]: lr"):
        opt.step()
    opt.param_groups[1]["lr"] = 1e-2
    assert torch.equal(a.detach(), before[0]) and torch.equal(b.detach(), before[1])
    with pytest.raises(E, match="grad_scale"):
        opt.step(grad_scale="0.5")
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["master_param"] = sd["state"][0]["master_param"].reshape(2, 8)
    with pytest.raises(E, match="master_param"):
        opt.load_state_dict(sd)
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["betas"] = (0.9, 1.5)
    with pytest.raises(E, match="betas"):
        opt.load_state_dict(sd)
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)


@pytest.mark.parametrize("cls", [CPUAdam, OffloadedAdam])
@pytest.mark.parametrize("params,match", [([], "empty parameter list"), (iter(()), "empty parameter list"),
                                          (torch.zeros(2), "not a tensor"), (3, "iterable")])
def test_constructor_refuses_empty_or_non_iterable_params_with_a_typed_error(cls, params, match):
    with pytest.raises(E, match=match):
        cls(params)
