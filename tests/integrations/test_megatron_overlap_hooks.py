"""Which upload each module's first forward waits for after TrainingState.restore(overlap_forward=True): the event
of the last bucket holding any of its parameters (CPU: the bookkeeping alone, with stand-in events; the waits
themselves run on the GPU in test_megatron_gpu.py)."""
import types

import pytest

torch = pytest.importorskip("torch")

from ebbtide.integrations.megatron._memory import TrainingState  # noqa: E402


def test_each_module_waits_for_the_bucket_of_its_last_parameter_byte():
    flat = torch.zeros(40)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(2, 2, bias=False)  # a: 16 + 4 elements, b: 4 elements
    for mod, (name, lo, shape) in ((a, ("weight", 0, (4, 4))), (a, ("bias", 16, (4,))), (b, ("weight", 30, (2, 2)))):
        setattr(mod, name, torch.nn.Parameter(flat[lo:lo + int(torch.tensor(shape).prod())].view(shape)))
    outside = torch.nn.Linear(1, 1)  # params in no flat buffer: restored by the engine, nothing to wait for
    model = torch.nn.Sequential(a, b, outside)
    opt = types.SimpleNamespace(flat_params=flat)
    buckets = [(0, 10, "ev0"), (10, 18, "ev1"), (18, 40, "ev2")]
    st = TrainingState.__new__(TrainingState)
    st.chunks, st._armed, st._uploads = [model], [], []
    st._arm_forward_waits([(opt, buckets)])
    waits = {m: [h.__defaults__[0] for h in m._forward_pre_hooks.values()] for m in (a, b, outside, model)}
    assert waits[a] == [("ev2",)]  # its bias ends at element 19: bucket 2
    assert waits[b] == [("ev2",)] and waits[outside] == [] and waits[model] == []
    assert st._uploads == ["ev2"] and len(st._armed) == 2
    a.weight.data = flat[0:16].view(4, 4)
    a.bias = torch.nn.Parameter(flat[10:14])  # now ends in bucket 1
    for h in st._armed:
        h.remove()
    st._armed = []
    st._arm_forward_waits([(opt, buckets)])
    assert [h.__defaults__[0] for h in a._forward_pre_hooks.values()] == [("ev1",)]
