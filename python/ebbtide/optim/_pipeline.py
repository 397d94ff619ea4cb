"""The device side of OffloadedAdam's pipeline: the copies between the GPU buffers and the host slots on
runtime-owned streams (``_Transport``), the step's loop over its units with what happens when it is interrupted
(``run_step``, Note [A step is whole]; ``Whole`` keeps the verdict), and the handles of its bucket hooks
(``_HookHandle``). OffloadedAdam and ShardedAdam both step through it.

Note [A step is whole]: a step changes the master, the moments and the GPU params from version k to k+1 unit by unit
(a unit: one bucket or shard run; its CPU kernel call is atomic, since the native kernel validates and allocates
before it writes an element). Whatever interrupts the loop after the first unit was stepped (a kernel or copy error,
a bucket hook raising, KeyboardInterrupt) must not leave units of both versions, and nothing can roll a unit back
bit for bit (the previous master and moments are overwritten in place: keeping them would cost a second full copy of
the host state), so the step is finished instead: the loop stops calling hooks, waits for its copies in flight,
uploads what was stepped but not uploaded, and steps every remaining unit on a plain synchronous path from the
gradients still in the device buffer (its inputs: nothing of the step's input is consumed). Then the caller counts
the step and raises ``StepError(completed=True)`` (KeyboardInterrupt and other non-``Exception`` errors are raised
as they are, after the step is whole). A unit of several kernel calls (a ShardedAdam bucket over param groups)
records how many ran and the finishing resumes it in its own slots, so no call runs twice; Ctrl-C is held for the
step's length
(``_HeldInterrupt``: Python's default handler, main thread) because a KeyboardInterrupt raised just after a kernel
returned, before its progress is recorded, would make the finishing run it again. A bucket hook's error is recovered
without the plain path: the pipeline goes on without hooks. If the finishing itself fails (the same kernel error
again, a lost device), the state is a mix that cannot be repaired here: ``StepError(completed=False)`` is raised and
the optimizer refuses every further step and state read until a checkpoint is loaded. A failure before any kernel
call ran changes nothing and is raised as it is."""
from __future__ import annotations

import signal
import threading
import time

import torch

from ..errors import StateError, StepError
from ._validate import check_grad_scale, check_groups
from .cpu_adam import make_hyper


class Whole:
    """Whether an optimizer's host state and params hold one version (Note [A step is whole]): ``torn`` says why
    not (set by ``run_step`` when a step could not be finished; cleared by the owner once a checkpoint loads)."""

    def __init__(self, owner: str, remedy: str):
        self.owner, self.remedy = owner, remedy  # the class name; what the user does to go on
        self.torn: str | None = None

    def check(self) -> None:
        """StateError while the state mixes two versions."""
        if self.torn is not None:
            raise StateError(f"{self.owner}: an earlier step could not be finished, the state mixes two versions "
                             f"({self.torn}); {self.remedy}")


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


class Pipelined:
    """What OffloadedAdam and ShardedAdam share above the pipeline: a step's start, their buckets (``_buckets``
    with ``start``/``end``), timings (``_transport``), host mirror (``_mirror``, ``numel``, ``_device``;
    ``_copy_params_to(host)`` fills it) and state in torch's format (``_host``: a ``HostState``, ``_positions()``:
    each param and its offset in it, ``_step_count``, ``sync_master_from_params``)."""

    def state_dict(self):
        """torch's format (``step``, ``exp_avg``, ``exp_avg_sq`` per param, plus ``master_param``)."""
        self._whole.check()
        self._host.fill_steps(self.state, self._step_count)
        return super().state_dict()

    @torch.no_grad()
    def load_state_dict(self, state_dict):
        """This optimizer's state dict, torch AdamW's over the same params, or one with an empty ``state``
        (masters from the params, moments zeroed); validated before anything changes."""
        positions = self._positions()
        self._step_count = self._host.load(state_dict, self.param_groups, positions, self.sync_master_from_params,
                                           type(self).__name__, self.defaults)
        self._whole.torn = None
        self._host.publish(self.state, positions, self._step_count)

    def _begin_step(self, closure, grad_scale) -> tuple:
        """Refused while the state is torn; the closure run; every group checked before any bucket is stepped.
        Returns ``(loss, the gradient scale, the native hyper-parameters of each group)``."""
        self._whole.check()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scale = check_grad_scale(grad_scale)
        check_groups(self.param_groups)
        return loss, scale, [make_hyper(g, grad_scale=scale) for g in self.param_groups]

    @torch.no_grad()
    def enable_param_mirror(self) -> torch.Tensor:
        """Keep a pinned bf16 host copy of the params this optimizer steps that every step writes in place of its
        upload slots (see the class's module doc); filled from the params now. Idempotent; returns it."""
        if self._mirror is None:
            mirror = torch.empty(self.numel, dtype=torch.bfloat16, pin_memory=self._device.type == "cuda")
            self._copy_params_to(mirror)
            self._mirror = mirror
        return self._mirror

    @property
    def param_mirror(self) -> torch.Tensor | None:
        """The pinned host copy (None unless enabled)."""
        return self._mirror

    @property
    def device(self) -> torch.device:
        """Where the params are."""
        return self._device

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """Element ranges of the buckets (of the flat buffers, of the host state), in pipeline order."""
        return [(b.start, b.end) for b in self._buckets]

    @property
    def last_step_times(self) -> dict:
        """Where the last step's time went: ``seconds`` (the whole pipeline), ``kernel_s`` (the CPU kernel),
        ``wait_s`` (the host waiting for copies), ``elements`` stepped; ``{}`` before the first step."""
        return dict(self._transport.times)


class _HeldInterrupt:
    """Ctrl-C held while a step changes state: in the main thread, where Python's default SIGINT handler is
    installed, a SIGINT only records itself until the block ends (otherwise KeyboardInterrupt could land between a
    unit's native kernel returning and its progress being recorded, and the unit would be stepped twice). Another
    handler the user installed is left alone."""

    def __enter__(self):
        self.interrupted, self._old = False, None
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._old = signal.signal(signal.SIGINT, self._record)
        return self

    def _record(self, signum, frame) -> None:
        self.interrupted = True

    def __exit__(self, *exc) -> bool:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        return False


def run_step(t: _Transport, n: int, slots: int, *, download, compute, upload, notify=None, first=None,
             changed=None, elements: int, step: int, whole: Whole | None = None):
    """One pipelined step over ``n`` units with ``slots`` in flight (Note [A step is whole]). Callbacks:
    ``download(i, slot)`` -> event of unit i's gradient copy into ``slot``; ``compute(i, slot, up)`` -> the host
    tensor holding unit i's new bf16 params (it runs the CPU kernel last, after any wait for ``up[i - slots]``; a
    unit of several kernel calls records its own progress and, called again for the same unit and slot, resumes
    after the calls that ran); ``upload(i, out)`` -> event; ``notify(i, event)`` the bucket hooks (their
    ``Exception`` is recovered); ``first(i)`` -> an already started download of unit i or None; ``changed()`` ->
    whether any kernel call ran (default: a whole unit was stepped). Returns None, or the error to raise once the
    caller has counted the step (a Ctrl-C held during the step: KeyboardInterrupt); raises
    ``StepError(completed=False)`` when the step could not be made whole, recording why in ``whole``."""
    down, up, outs = [None] * n, [None] * n, [None] * n
    stepped, uploaded, started, failure, hook_failure = 0, 0, -1, None, None
    with _HeldInterrupt() as held:
        t.begin()
        try:
            for i in range(min(slots, n)):
                ev = first(i) if first is not None else None
                down[i] = ev if ev is not None else download(i, i % slots)
            for i in range(n):
                t.wait(down[i])
                started = i  # its gradient is in slot i % slots from here on
                outs[i] = compute(i, i % slots, up)
                stepped = i + 1
                up[i] = upload(i, outs[i])
                uploaded = i + 1
                if notify is not None and hook_failure is None:
                    try:
                        notify(i, up[i])
                    except Exception as e:  # noqa: BLE001  (raised after the step, wrapped)
                        hook_failure = (i, e)
                if i + slots < n:
                    down[i + slots] = download(i + slots, (i + slots) % slots)
            t.end(elements)
        except BaseException as e:  # noqa: BLE001  (raised after the step is made whole)
            failure = e
        if failure is not None:
            if not (stepped > 0 or (changed is not None and changed())):
                _drain(t, down + up)
                raise failure
            try:
                _drain(t, down + up, strict=True)
                for i in range(uploaded, stepped):  # stepped, its new params still in its slot: not uploaded yet
                    t.wait(upload(i, outs[i]))
                for i in range(stepped, n):
                    if i == started:  # interrupted inside: its gradient and any finished part are in its slot
                        out = compute(i, i % slots, up)
                    else:
                        t.wait(download(i, 0))
                        out = compute(i, 0, up)
                    t.wait(upload(i, out))
                t.end(elements)
            except BaseException as e2:  # noqa: BLE001
                err = StepError(f"step {step} was interrupted at unit {stepped} of {n} ({type(failure).__name__}: "
                                f"{failure}) and could not be finished ({type(e2).__name__}: {e2}): units before "
                                f"{stepped} hold step {step}, the rest step {step - 1} or a part of it; load a "
                                "checkpoint to go on", completed=False, step=step, bucket=stepped, buckets=n)
                if whole is not None:
                    whole.torn = str(err)
                raise err from failure
    result = None
    if failure is not None and not isinstance(failure, Exception):
        result = failure  # KeyboardInterrupt and the like: raised as they are, after the step is whole
    elif failure is not None:
        result = StepError(f"step {step} was interrupted at unit {stepped} of {n} ({type(failure).__name__}: "
                           f"{failure}); it was finished on the plain path (master, moments and params hold step "
                           f"{step})", completed=True, step=step, bucket=stepped, buckets=n)
        result.__cause__ = failure
    elif hook_failure is not None:
        i, e = hook_failure
        result = StepError(f"step {step}: a bucket hook raised at unit {i} of {n} ({type(e).__name__}: {e}); the "
                           f"step was finished without hooks (master, moments and params hold step {step}; the "
                           f"hooks saw units 0-{i})", completed=True, step=step, bucket=i, buckets=n)
        result.__cause__ = e
    if held.interrupted and not isinstance(result, KeyboardInterrupt):
        interrupt = KeyboardInterrupt()
        interrupt.__context__ = result
        return interrupt
    return result


def _drain(t: _Transport, events, strict: bool = False) -> None:
    """Wait for every copy in flight; ``strict=False`` swallows their errors (the first failure is raised)."""
    for ev in events:
        try:
            t.wait(ev)
        except BaseException:  # noqa: BLE001
            if strict:
                raise
    try:
        t.end()
    except BaseException:  # noqa: BLE001
        if strict:
            raise


class _HookHandle:
    """What ``add_bucket_hook`` returns: ``remove()`` takes the hook out (twice is harmless)."""

    _next = 0

    def __init__(self, hooks: dict):
        _HookHandle._next += 1
        self.id, self._hooks = _HookHandle._next, hooks

    def remove(self) -> None:
        self._hooks.pop(self.id, None)
