"""A step interrupted in the middle (a CPU kernel error, a bucket hook raising, KeyboardInterrupt) never leaves the
master, the moments and the params at two versions: it is finished and a typed error raised, or, when it cannot
be finished, the optimizer refuses to go on until a checkpoint is loaded. Each case against an uninterrupted twin,
bit for bit (CPU params: the same pipeline with synchronous copies)."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import ebbtide  # noqa: E402
from ebbtide.optim import OffloadedAdam  # noqa: E402
from ebbtide.testing.bits import bits_equal  # noqa: E402
from test_offloaded_cpu import batch, make_model  # noqa: E402


class Inject:
    """Replaces the pipeline's kernel call: calls ``at`` .. ``at + times - 1`` raise ``exc`` (counting from the
    first call after construction), the others run the kernel."""

    def __init__(self, opt, at, times=1, exc=None):
        self.kernel, self.at, self.times, self.calls = opt._transport.kernel, at, times, 0
        self.exc = exc or RuntimeError("injected kernel failure")
        opt._transport.kernel = self

    def __call__(self, step, *args):
        i, self.calls = self.calls, self.calls + 1
        if self.at <= i < self.at + self.times:
            raise self.exc
        return self.kernel(step, *args)


def pair(**kw):
    models = [make_model(), make_model()]
    opts = [OffloadedAdam(m.parameters(), lr=1e-2, weight_decay=0.01, mode="exact", bucket_numel=256, slots=2, **kw)
            for m in models]
    assert len(opts[0].buckets) >= 8
    return models, opts


def backward(model, opt, step):
    x, y = batch(step)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()


def assert_same(a, oa, b, ob):
    assert oa._step_count == ob._step_count
    for p, q in zip(a.parameters(), b.parameters()):
        assert bits_equal(p.detach(), q.detach())
        for key in ("master_param", "exp_avg", "exp_avg_sq"):
            assert bits_equal(oa.state[p][key], ob.state[q][key]), key


@pytest.mark.parametrize("kw", [{}, {"moments_dtype": torch.bfloat16}], ids=["fp32", "bf16-moments"])
@pytest.mark.parametrize("mirror", [False, True], ids=["slots", "mirror"])
def test_a_kernel_error_mid_step_is_finished_then_raised(kw, mirror):
    (a, b), (oa, ob) = pair(**kw)
    if mirror:
        oa.enable_param_mirror()
        ob.enable_param_mirror()
    for step in range(4):
        for m, o in ((a, oa), (b, ob)):
            backward(m, o, step)
        if step == 1:
            Inject(oa, at=3)
            with pytest.raises(ebbtide.StepError) as info:
                oa.step()
            e = info.value
            assert e.completed and e.bucket == 3 and e.buckets == len(oa.buckets) and e.step == 2
            assert isinstance(e.__cause__, RuntimeError) and "injected" in str(e)
        else:
            oa.step()
        ob.step()
        assert_same(a, oa, b, ob)
    if mirror:
        assert bits_equal(oa.param_mirror, oa.flat_params)


def test_a_hook_error_finishes_the_step_without_hooks():
    (a, b), (oa, ob) = pair()
    seen = []

    def hook(begin, end, event):
        seen.append((begin, end))
        if len(seen) == 3:
            raise ValueError("the rollout went away")

    oa.add_bucket_hook(hook)
    backward(a, oa, 0)
    backward(b, ob, 0)
    with pytest.raises(ebbtide.StepError, match="bucket hook raised at unit 2") as info:
        oa.step()
    ob.step()
    assert info.value.completed and isinstance(info.value.__cause__, ValueError)
    assert len(seen) == 3  # no hook call after the failing one
    assert_same(a, oa, b, ob)
    backward(a, oa, 1)
    backward(b, ob, 1)
    oa.step()  # the next step calls the hooks again (each bucket once)
    ob.step()
    assert len(seen) == 3 + len(oa.buckets)
    assert_same(a, oa, b, ob)


def test_keyboard_interrupt_is_raised_as_is_after_the_step_is_whole():
    (a, b), (oa, ob) = pair()
    for m, o in ((a, oa), (b, ob)):
        backward(m, o, 0)
    Inject(oa, at=5, exc=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        oa.step()
    ob.step()
    assert_same(a, oa, b, ob)


def test_ctrl_c_during_a_kernel_is_held_until_the_step_is_whole():
    """A real SIGINT arriving while a kernel runs (here: sent from inside it) must not step its bucket twice: it is
    held, the step runs to its end, then KeyboardInterrupt is raised and the handler is Python's again."""
    import signal  # noqa: PLC0415

    (a, b), (oa, ob) = pair()
    for m, o in ((a, oa), (b, ob)):
        backward(m, o, 0)
    kernel, calls = oa._transport.kernel, [0]

    def kernel_then_sigint(step, *args):
        kernel(step, *args)
        calls[0] += 1
        if calls[0] == 3:  # to this thread: os.kill's process-directed signal may land on a pool thread, and
            signal.raise_signal(signal.SIGINT)  # the main thread would then see it only after the step had ended

    oa._transport.kernel = kernel_then_sigint
    with pytest.raises(KeyboardInterrupt):
        oa.step()
    ob.step()
    assert calls[0] == len(oa.buckets)  # every bucket once
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert_same(a, oa, b, ob)


def test_a_failure_at_the_first_bucket_changes_nothing():
    (a, b), (oa, ob) = pair()
    for m, o in ((a, oa), (b, ob)):
        backward(m, o, 0)
    Inject(oa, at=0, exc=ebbtide.InvalidArgumentError("refused before any element"))
    with pytest.raises(ebbtide.InvalidArgumentError, match="refused before"):  # raised as it is, not wrapped
        oa.step()
    assert oa._step_count == 0
    assert all(not oa.state[p]["exp_avg"].any() for p in a.parameters())
    oa.step()  # the same gradients: now the step runs
    ob.step()
    assert_same(a, oa, b, ob)


def test_a_step_that_cannot_be_finished_refuses_until_a_checkpoint_is_loaded():
    (a, b), (oa, ob) = pair()
    for m, o in ((a, oa), (b, ob)):
        backward(m, o, 0)
        o.step()
    saved = copy.deepcopy(oa.state_dict())  # torch's state_dict holds the live state tensors
    saved_params = [p.detach().clone() for p in a.parameters()]
    for m, o in ((a, oa), (b, ob)):
        backward(m, o, 1)
    Inject(oa, at=4, times=10**6)  # the kernel keeps failing: the step cannot be finished
    with pytest.raises(ebbtide.StepError, match="could not be finished") as info:
        oa.step()
    assert not info.value.completed and info.value.bucket == 4
    with pytest.raises(ebbtide.StateError, match="mixes two versions"):
        oa.step()
    with pytest.raises(ebbtide.StateError, match="mixes two versions"):
        oa.state_dict()
    oa._transport.kernel = oa._transport.kernel.kernel  # the fault is gone; the checkpoint brings the state back
    with torch.no_grad():
        for p, s in zip(a.parameters(), saved_params):
            p.copy_(s)
    oa.load_state_dict(saved)
    backward(a, oa, 1)
    oa.step()
    ob.step()
    assert_same(a, oa, b, ob)
