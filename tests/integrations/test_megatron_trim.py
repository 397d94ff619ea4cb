"""TrainingState.trim_cache's bookkeeping (CPU: torch.cuda.empty_cache stood in by a recorder; the real trim runs in
tests/integrations/test_megatron_gpu.py): a background trim while the last one runs is a no-op, one that ended is
collected before the next starts (so a hook on every optimizer step never trips over the last step's trim), its
failure is raised as StateError by the next trim or the offload's join, and the trims' seconds add up."""
import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from ebbtide.errors import StateError  # noqa: E402
from ebbtide.integrations.megatron._memory import TrainingState  # noqa: E402


@pytest.fixture
def state(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(threading.get_ident()))
    st = object.__new__(TrainingState)  # the trim's own fields only: no model, no GPU
    st._offloaded, st._trim, st._trim_s, st._trimmed = False, None, 0.0, False
    st.calls = calls
    return st


def test_a_trim_per_step_collects_the_last_one(state):
    for _ in range(3):
        state.trim_cache(background=True)
        state._trim[0].join()  # the step's trim ended before the next step's hook
    state._join_trim()
    assert len(state.calls) == 3 and threading.get_ident() not in state.calls
    assert state._trimmed and state._trim is None and state._trim_s >= 0


def test_a_trim_while_the_last_one_runs_is_a_no_op(state, monkeypatch):
    gate, started = threading.Event(), threading.Event()

    def slow():
        started.set()
        gate.wait(10)
        state.calls.append("slow")

    monkeypatch.setattr(torch.cuda, "empty_cache", slow)
    state.trim_cache(background=True)
    assert started.wait(10)
    first = state._trim
    state.trim_cache(background=True)
    assert state._trim is first  # not a second thread
    gate.set()
    state._join_trim()
    assert state.calls == ["slow"]


def test_a_failed_trim_is_raised_by_the_next_call_and_a_foreground_trim_runs_here(state, monkeypatch):
    def boom():
        raise RuntimeError("CUDA error: an illegal memory access")

    monkeypatch.setattr(torch.cuda, "empty_cache", boom)
    state.trim_cache(background=True)
    state._trim[0].join()
    with pytest.raises(StateError, match="background trim_cache\\(\\) failed: CUDA error"):
        state.trim_cache(background=True)
    assert state._trim is None  # collected: the next call starts afresh
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: state.calls.append(threading.get_ident()))
    state.trim_cache()
    assert state.calls == [threading.get_ident()]


def test_no_trim_while_offloaded(state):
    state._offloaded = True
    with pytest.raises(StateError, match="while offloaded"):
        state.trim_cache(background=True)
