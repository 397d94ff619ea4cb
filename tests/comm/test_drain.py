"""The release's drain is bounded: device work that never finishes (a collective whose peers never join) fails the
drain with StateError after the timeout instead of blocking forever (CPU: torch.cuda.synchronize stood in by a
blocking call)."""
import threading
import time
import types

import pytest

torch = pytest.importorskip("torch")

from ebbtide.comm import _backend as B  # noqa: E402
from ebbtide.errors import StateError  # noqa: E402


def test_a_drain_that_never_finishes_raises_within_the_bound(monkeypatch):
    release = threading.Event()
    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: (calls.append(dev), release.wait(30)))
    t0 = time.monotonic()
    with pytest.raises(StateError, match="did not finish within"):
        B.drain([types.SimpleNamespace(bound_device_id=torch.device("cuda", 1))], 0.3)
    assert time.monotonic() - t0 < 5
    release.set()  # the helper now syncs the other device and ends: wait for it before unpatching
    deadline = time.monotonic() + 5
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(map(str, calls)) == ["cuda:0", "cuda:1"]


def test_a_drain_that_finishes_returns(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: seen.append(str(dev)))
    B.drain([types.SimpleNamespace(bound_device_id=torch.device("cuda", 1))], 5)
    assert sorted(seen) == ["cuda:0", "cuda:1"]
    B.drain([], 0.1)  # nothing to drain: no thread, no wait
