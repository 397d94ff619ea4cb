"""Reload's warm-up issues one collective per group: by default from the calling thread in sorted-name order (NCCL
forbids concurrent calls on independent communicators of one device from several threads); a thread per group
only with EBBTIDE_COMM_WARMUP=concurrent; nothing with "off"; a failing group is logged and skipped. CPU: the CUDA
stream and the collective stood in by recorders (the real path runs in the GPU reload tests)."""
import contextlib
import threading
import types

import pytest

torch = pytest.importorskip("torch")

from ebbtide import settings  # noqa: E402
from ebbtide.comm import _backend as B  # noqa: E402


EVENTS = []  # ("issue" | "sync", group name) in the order they happened


class _Stream:
    current = None

    def __init__(self, dev):
        self.dev, self.name = dev, None

    def synchronize(self):
        EVENTS.append(("sync", self.name))


@pytest.fixture
def recorder(monkeypatch):
    calls = []
    EVENTS.clear()

    def stream(s):
        _Stream.current = s
        return contextlib.nullcontext()

    def all_reduce(x, group=None, async_op=False):
        if group._ebt_name == "bad":
            raise RuntimeError("connect failed")
        calls.append((group._ebt_name, threading.get_ident()))
        _Stream.current.name = group._ebt_name
        EVENTS.append(("issue", group._ebt_name))
        return types.SimpleNamespace(wait=lambda: None)

    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: None)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: None)
    monkeypatch.setattr(B.c10d, "all_reduce", all_reduce)
    yield calls
    settings.reset()


def _groups(*names):
    return [types.SimpleNamespace(_ebt_name=n, bound_device_id=None) for n in names]


def test_serial_by_default_in_sorted_order_on_the_calling_thread(recorder, monkeypatch):
    monkeypatch.delenv("EBBTIDE_COMM_WARMUP", raising=False)
    settings.reset()
    B.warm_up(_groups("7", "12", "3", "bad", "WORLD"), 0)
    names = [n for n, _ in recorder]
    assert names == sorted(["7", "12", "3", "WORLD"]), names
    assert {t for _, t in recorder} == {threading.get_ident()}
    # every collective issued before any host wait, then each group's stream synchronised once
    assert EVENTS == [("issue", n) for n in names] + [("sync", n) for n in names], EVENTS


def test_concurrent_uses_a_thread_per_group(recorder, monkeypatch):
    monkeypatch.setenv("EBBTIDE_COMM_WARMUP", "concurrent")
    settings.reset()
    B.warm_up(_groups("a", "b", "c"), 0)
    assert sorted(n for n, _ in recorder) == ["a", "b", "c"]
    assert threading.get_ident() not in {t for _, t in recorder}


def test_off_connects_nothing_and_a_bad_value_is_an_error(recorder, monkeypatch):
    monkeypatch.setenv("EBBTIDE_COMM_WARMUP", "off")
    settings.reset()
    assert B.warm_up(_groups("a"), 0) == 0.0 and recorder == []
    monkeypatch.setenv("EBBTIDE_COMM_WARMUP", "threads")
    settings.reset()
    with pytest.raises(Exception, match="EBBTIDE_COMM_WARMUP"):
        B.warm_up(_groups("a"), 0)
