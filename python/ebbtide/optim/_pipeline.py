"""The device side of OffloadedAdam's pipeline: the copies between the GPU buffers and the host slots on
runtime-owned streams (``_Transport``) and the handles of its bucket hooks (``_HookHandle``)."""
from __future__ import annotations

import time

import torch


class _Transport:
    """D2H / H2D copies on runtime-owned CUDA streams with events, or synchronous copies for CPU params. It also
    keeps where one step's time went (``times``: the host's waits on copies, the CPU kernel, the whole pipeline),
    so a slow step says whether the copies or the host's memory bound it."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.times = {}
        self._t0, self._wait_s, self._kernel_s = time.perf_counter(), 0.0, 0.0  # waits may come before a begin()
        if self.cuda:
            self.d2h = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)

    def begin(self):
        """Order both streams after everything already queued on the caller's current stream."""
        self._t0, self._wait_s, self._kernel_s = time.perf_counter(), 0.0, 0.0
        if self.cuda:
            ev = torch.cuda.current_stream(self.device).record_event()
            self.d2h.wait_event(ev)
            self.h2d.wait_event(ev)

    def download(self, dst: torch.Tensor, src: torch.Tensor, after_current: bool = False):
        if not self.cuda:
            dst.copy_(src)
            return None
        if after_current:  # launched from a grad hook: after the accumulation on the hook's stream
            self.d2h.wait_event(torch.cuda.current_stream(self.device).record_event())
        with torch.cuda.stream(self.d2h):
            dst.copy_(src, non_blocking=True)
            return self.d2h.record_event()

    def upload(self, dst: torch.Tensor, src: torch.Tensor):
        if not self.cuda:
            dst.copy_(src)
            return None
        with torch.cuda.stream(self.h2d):
            dst.copy_(src, non_blocking=True)
            return self.h2d.record_event()

    def wait(self, event):
        if event is not None:
            t0 = time.perf_counter()
            event.synchronize()
            self._wait_s += time.perf_counter() - t0

    def kernel(self, step, *args):
        """One CPU kernel call (``step(*args)``), timed."""
        t0 = time.perf_counter()
        step(*args)
        self._kernel_s += time.perf_counter() - t0

    def end(self, elements: int | None = None):
        """Order the caller's current stream after the uploads; a step (``elements`` stepped) books its times."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.h2d)
        if elements is not None:
            self.times = {"seconds": time.perf_counter() - self._t0, "kernel_s": self._kernel_s,
                          "wait_s": self._wait_s, "elements": elements}


class _HookHandle:
    """What ``add_bucket_hook`` returns: ``remove()`` takes the hook out (twice is harmless)."""

    _next = 0

    def __init__(self, hooks: dict):
        _HookHandle._next += 1
        self.id, self._hooks = _HookHandle._next, hooks

    def remove(self) -> None:
        self._hooks.pop(self.id, None)
