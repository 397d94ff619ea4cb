"""OffloadedAdam: bf16 params on the GPU, fp32 master + Adam state in host memory, one bucketed pipeline per step.

Policies:
- Layout. At construction every param is moved into one flat bf16 buffer on its device (params become views of
  it, laid out in reverse registration order so backward fills buckets front to back) and gets a ``.grad`` view
  of one flat gradient buffer of the param dtype. Host memory holds flat fp32 master / exp_avg / exp_avg_sq
  (pageable) plus ``slots`` pinned gradient slots and ``slots`` pinned bf16 upload slots of ``bucket_numel``
  elements each: host RAM is 12 B/param (16 with amsgrad; 8 with ``moments_dtype=torch.bfloat16``) + O(bucket),
  never a full-size pinned mirror.
- Pipeline (``step``). Buckets are contiguous ranges of the flat buffers (never crossing param groups). On
  runtime-owned streams: gradient D2H of bucket i into slot i % slots; the CPU kernel (one native call per bucket,
  GIL released) updates master/m/v and writes the new bf16 params straight into the pinned upload slot; H2D of
  that slot into the flat param buffer. D2H of bucket i + slots starts as soon as the kernel is done with slot
  i % slots; the kernel waits for H2D of bucket i - slots before reusing its upload slot. Everything queued on the
  caller's current stream before ``step`` (backward, grad clipping, even writes to the params) is ordered before
  the transfers, and the current stream waits for the last upload, so the next forward sees the new values.
- Overlap with backward (optional, ``overlap_with_backward=True``): a post-accumulate-grad hook counts ready params
  per bucket; the first ``slots`` buckets start downloading during backward. Then gradients must not be modified
  after backward (pass a clip coefficient as ``grad_scale`` instead). Hooks are always installed to keep
  ``.grad`` pointing into the flat buffer (``model.zero_grad()`` setting grads to None is repaired on the next
  accumulation); ``OffloadedAdam.zero_grad`` zeroes the buffer.
- Numerics: the CPU kernel of CPUAdam (``mode="exact"``: the fp32 master is bit-identical to torch's CPU
  AdamW/Adam stepping the same master with the same gradients; the GPU param is exactly ``master.to(bf16)``).
  ``moments_dtype=torch.bfloat16`` keeps exp_avg and exp_avg_sq as bf16 in host memory (CPUAdam's bf16 moments:
  the kernel moves 20 instead of 28 bytes per param; not with amsgrad). One step count for the optimizer; every
  param is stepped every step (a param without a gradient this step gets a zero gradient, as in Megatron's
  distributed optimizer).
- State: ``state_dict`` is torch's format (``step``, ``exp_avg``, ``exp_avg_sq`` per param, in ``moments_dtype``)
  plus ``master_param`` (fp32); loaded moments of another dtype are converted (to bf16: round to nearest even).
  ``load_state_dict`` accepts it, torch AdamW's (masters then come from the model's current params), or one with
  an empty ``state``: masters are taken from the model (not reset, not left stale), moments zeroed.
  Call ``sync_master_from_params()`` after loading model weights in place.
- Params may also live on the CPU (bf16): the same pipeline with synchronous copies (used by the CPU tests).
- Host mirror (``enable_param_mirror()``): a pinned bf16 copy of the flat params, full size (2 B/param of host
  memory), which the kernel writes in place of the upload slots, so after every step it equals the GPU params
  (``sync_master_from_params`` refreshes it too). The GPU params can then be dropped and rebuilt from it
  (``upload_params_from_mirror``): how ``TrainingState(weights="discard")`` offloads them without a D2H copy.
  Writes to the params outside this optimizer after its last step are not in the mirror (call
  ``sync_master_from_params()`` after them, as for the masters).
- Placement hooks. ``buffer_factory(kind, numel, dtype, device)`` allocates the two device buffers (kind "params"
  or "grads"; default ``torch.zeros``), e.g. inside a memory region so the flat params can be paused with a CPU
  backup and the flat gradient discarded; ``rebind_buffers(factory)`` moves them after construction (content
  copied, every param and grad view re-pointed). ``flat_params``, ``flat_grad``, ``param_offsets`` and
  ``grad_view``/``param_view`` expose the layout.
- Bucket hooks (``add_bucket_hook(fn)``): after each bucket's new params are queued for upload, the stepping
  thread calls ``fn(begin, end, event)``: the byte addresses ``[begin, end)`` of the flat param buffer hold the
  new values once ``event`` (a ``torch.cuda.Event`` on the upload stream; None for CPU params: already there) has
  completed. Buckets come in address order, each once per step. A hook must return fast (it runs between CPU
  kernel calls; hand real work to another thread); if it raises, the step goes on without hooks and then raises
  ``StepError(completed=True)`` (the hooks saw the buckets up to the failing one).
- Interrupted steps (``_pipeline`` Note [A step is whole]): whatever fails after the first bucket was stepped (a
  kernel or copy error, a hook, KeyboardInterrupt; Ctrl-C is held until the step is whole), the step is finished
  on a plain path, counted, and then
  ``StepError(completed=True)`` is raised (KeyboardInterrupt as it is): master, moments and params never hold two
  versions. If it cannot be finished, ``StepError(completed=False)``, and ``step``/``state_dict`` raise StateError
  until ``load_state_dict`` loads a checkpoint.
  ``add_bucket_hook`` returns a handle whose ``remove()`` takes the hook out.
- Gradients. ``attach_grads=True`` (default): each param's ``.grad`` is its view of the flat gradient, kept so
  by the hooks above. ``attach_grads=False``: no ``.grad`` is touched and no hook installed; the caller writes the
  gradient into ``flat_grad`` (or ``grad_view(p)``) before ``step`` -- how a trainer with its own gradient
  buffers (Megatron-core's DDP ``main_grad``) feeds the pipeline.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InvalidArgumentError, StateError
from ._host_state import HostState
from ._validate import check_bucketing, check_distinct, check_group, param_list
from ._pipeline import Pipelined, Whole, _HookHandle, _Transport, run_step
from .cpu_adam import KernelViews, _check_hyper, _check_threads_isa, check_moments_dtype, shared_engine

__all__ = ["OffloadedAdam"]

_ALIGN = 64  # elements: param starts in the flat buffers are 128-byte aligned for bf16


@dataclass
class _Bucket:
    group: int
    start: int  # flat element range [start, end)
    end: int
    n_params: int  # params overlapping this bucket (the hook's readiness target)


def _zeros(kind: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype, device=device)


def _allocate(factory, kind: str, numel: int, device: torch.device) -> torch.Tensor:
    t = factory(kind, numel, torch.bfloat16, device)
    if (not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16 or t.device != device or t.dim() != 1
            or t.numel() != numel or not t.is_contiguous()):
        got = (f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__)
        raise InvalidArgumentError(f"buffer_factory({kind!r}) must return a contiguous 1-D bfloat16 tensor of "
                                   f"{numel} elements on {device} (got {got})")
    return t


class OffloadedAdam(Pipelined, KernelViews, torch.optim.Optimizer):
    """Adam/AdamW for bf16 params on one device with fp32 master weights and state in host memory."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=True,
                 amsgrad=False, maximize=False, mode="fast", threads=None, bucket_numel=16 * 2**20, slots=3,
                 overlap_with_backward=False, isa=None, buffer_factory=None, attach_grads=True,
                 moments_dtype=torch.float32):
        _check_hyper(lr, betas, eps, weight_decay, mode, "OffloadedAdam", amsgrad=amsgrad, maximize=maximize,
                     decoupled_weight_decay=adamw)
        _check_threads_isa(threads, isa)
        self._moments_dtype = check_moments_dtype(moments_dtype, amsgrad, "OffloadedAdam")
        check_bucketing(bucket_numel, slots, _ALIGN)
        if buffer_factory is not None and not callable(buffer_factory):
            raise InvalidArgumentError(f"buffer_factory must be callable or None (got {buffer_factory!r})")
        if not attach_grads and overlap_with_backward:
            raise InvalidArgumentError("overlap_with_backward needs attach_grads=True (it is driven by .grad hooks)")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=bool(amsgrad),
                        maximize=bool(maximize), decoupled_weight_decay=bool(adamw), mode=mode)
        super().__init__(param_list(params, "OffloadedAdam"), defaults)
        self.overlap_with_backward = bool(overlap_with_backward)
        self.attach_grads = bool(attach_grads)
        self._engine = shared_engine(threads, isa)
        self._bucket_numel = (bucket_numel // _ALIGN) * _ALIGN
        self._slots = slots
        self._step_count = 0
        self._mirror = None  # pinned bf16 host copy of the flat params (enable_param_mirror)
        self._mirror_upload = None  # the last event of an unwaited mirror upload (upload_params_from_mirror)
        self._build_layout()
        self._build_buffers(buffer_factory or _zeros)
        self._transport = _Transport(self._device)
        self._ready = [0] * len(self._buckets)
        self._pending = {}  # bucket -> download event launched by a hook, not yet consumed
        self._hooks = ([p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._params]
                       if self.attach_grads else [])
        self.last_step_applied = True
        self._whole = Whole("OffloadedAdam", "load_state_dict() a checkpoint first")
        self._bucket_hooks: dict = {}  # handle id -> fn(begin, end, event), called per uploaded bucket

    def add_bucket_hook(self, fn) -> "_HookHandle":
        """Call ``fn(begin, end, event)`` after each bucket's upload is queued (see the module policies)."""
        if not callable(fn):
            raise InvalidArgumentError(f"a bucket hook must be callable, got {fn!r}")
        handle = _HookHandle(self._bucket_hooks)
        self._bucket_hooks[handle.id] = fn
        return handle

    # ---- construction ------------------------------------------------------------------------------------------
    def _build_layout(self):
        params = [(gi, p) for gi, g in enumerate(self.param_groups) for p in g["params"]]
        if not params:
            raise InvalidArgumentError("OffloadedAdam got no params")
        devices = {p.device for _, p in params}
        if len(devices) != 1:
            raise InvalidArgumentError(f"all params must be on one device (got {sorted(map(str, devices))})")
        self._device = devices.pop()
        for _, p in params:
            if p.dtype != torch.bfloat16:
                raise InvalidArgumentError(f"OffloadedAdam params must be bfloat16 (got {p.dtype})")
            if not p.is_leaf or not p.requires_grad:
                raise InvalidArgumentError("OffloadedAdam params must be leaf tensors that require grad")
        if len({id(p) for _, p in params}) != len(params):
            raise InvalidArgumentError("a param appears twice")
        # Reverse order within each group (backward produces the last params first); groups stay contiguous.
        order = []
        for gi in range(len(self.param_groups)):
            order += [p for g, p in params if g == gi][::-1]
        self._params = order
        self._group_of = {id(p): g for g, p in params}
        self._offsets, self._buckets, self._param_buckets = [], [], []
        off = 0
        for gi in range(len(self.param_groups)):
            g_start = off
            members = [p for p in order if self._group_of[id(p)] == gi]
            spans = []
            for p in members:
                self._offsets.append(off)
                spans.append((off, off + p.numel()))
                off += -(-p.numel() // _ALIGN) * _ALIGN
            for b0 in range(g_start, off, self._bucket_numel):
                b1 = min(off, b0 + self._bucket_numel)
                n_in = sum(1 for s, e in spans if s < b1 and e > b0 and e > s)
                self._buckets.append(_Bucket(gi, b0, b1, n_in))
        self._total = off
        for p, o in zip(self._params, self._offsets):
            self._param_buckets.append([i for i, b in enumerate(self._buckets)
                                        if p.numel() > 0 and b.start < o + p.numel() and o < b.end])

    def _build_buffers(self, factory):
        dev, total = self._device, self._total
        pin = dev.type == "cuda"
        self._pflat = _allocate(factory, "params", total, dev)
        self._gflat = _allocate(factory, "grads", total, dev)
        self._pflat.zero_()
        self._gflat.zero_()
        amsgrad = any(g["amsgrad"] for g in self.param_groups)
        if amsgrad and self._moments_dtype != torch.float32:
            raise InvalidArgumentError("OffloadedAdam: amsgrad needs fp32 moments (moments_dtype=torch.bfloat16 "
                                       "given)")
        self._host = HostState(total, self._moments_dtype, amsgrad)
        slot = min(self._bucket_numel, total)
        self._gslots = [torch.empty(slot, dtype=torch.bfloat16, pin_memory=pin) for _ in range(self._slots)]
        self._oslots = [torch.empty(slot, dtype=torch.bfloat16, pin_memory=pin) for _ in range(self._slots)]
        with torch.no_grad():
            for p, o in zip(self._params, self._offsets):
                self._pflat[o:o + p.numel()].view_as(p).copy_(p)
                if self.attach_grads and p.grad is not None:
                    self._gflat[o:o + p.numel()].view_as(p).copy_(p.grad)
        self._bind_views()
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self.sync_master_from_params()
        self._host.publish(self.state, self._positions(), self._step_count)

    def _bind_views(self):
        """Point every param (and, with attach_grads, its .grad) at its range of the flat buffers."""
        self._pviews, self._gviews = [], []
        with torch.no_grad():
            for p, o in zip(self._params, self._offsets):
                pv = self._pflat[o:o + p.numel()].view_as(p)
                gv = self._gflat[o:o + p.numel()].view_as(p)
                p.data = pv
                if self.attach_grads:
                    p.grad = gv
                self._pviews.append(pv)
                self._gviews.append(gv)

    # ---- public API (also: buckets, last_step_times, moments_dtype, threads, isa, engine) ----------------------
    @property
    def flat_params(self) -> torch.Tensor:
        """The flat bf16 param buffer on the params' device (every param is a view of it; padding between)."""
        return self._pflat

    @property
    def flat_grad(self) -> torch.Tensor:
        """The flat bf16 gradient buffer ``step`` reads (same layout as ``flat_params``)."""
        return self._gflat

    @property
    def numel(self) -> int:
        """Elements of each flat buffer, alignment padding included."""
        return self._total

    @property
    def param_offsets(self) -> list[tuple[torch.Tensor, int]]:
        """(param, element offset into the flat buffers) in layout order."""
        return list(zip(self._params, self._offsets))

    def param_view(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s range of ``flat_params``, shaped like ``p``."""
        return self._pviews[self._position(p)]

    def grad_view(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s range of ``flat_grad``, shaped like ``p`` (where to write its gradient with attach_grads=False)."""
        return self._gviews[self._position(p)]

    def _position(self, p) -> int:
        i = self._index.get(id(p))
        if i is None:
            raise InvalidArgumentError("the tensor is not a param of this optimizer")
        return i

    @torch.no_grad()
    def rebind_buffers(self, buffer_factory) -> None:
        """Move the flat param and gradient buffers into new tensors from ``buffer_factory(kind, numel, dtype,
        device)`` (kind "params" or "grads"); content is copied and every param/grad view re-pointed. Nothing
        changes if the factory fails or returns a tensor of the wrong size, dtype or device."""
        if not callable(buffer_factory):
            raise InvalidArgumentError(f"buffer_factory must be callable (got {buffer_factory!r})")
        self._reset_overlap()
        self._settle_mirror_upload()
        pflat = _allocate(buffer_factory, "params", self._total, self._device)
        gflat = _allocate(buffer_factory, "grads", self._total, self._device)
        pflat.copy_(self._pflat)
        gflat.copy_(self._gflat)
        self._pflat, self._gflat = pflat, gflat
        self._bind_views()

    @torch.no_grad()
    def sync_master_from_params(self):
        """Set every fp32 master (and the host mirror, if enabled) to the model's current (bf16) param value, e.g.
        after loading model weights."""
        self._settle_mirror_upload()
        for b in self._buckets:  # bucket by bucket: no full-size fp32 temporary on the device
            host = self._pflat[b.start:b.end].cpu()
            self._host.master[b.start:b.end].copy_(host)
            if self._mirror is not None:
                self._mirror[b.start:b.end].copy_(host)

    def _settle_mirror_upload(self) -> None:
        """Before anything reads the flat params or writes the mirror: an upload nobody waited for
        (``upload_params_from_mirror(wait=False)``) has finished reading the mirror (host wait) and the caller's
        stream is ordered after its writes into the params."""
        if self._mirror_upload is not None:
            self._transport.wait(self._mirror_upload)
            self._transport.end()
            self._mirror_upload = None

    def _copy_params_to(self, host: torch.Tensor) -> None:
        host.copy_(self._pflat)  # the mirror of the flat params (enable_param_mirror)

    @torch.no_grad()
    def upload_params_from_mirror(self, *, wait: bool = True) -> list:
        """Write the mirror back into the flat params, bucket by bucket on the upload stream. ``wait=True``: the
        caller's stream waits for all of it. ``wait=False``: nothing waits; returns ``[(start, end, event)]`` per
        bucket (elements of ``flat_params``; ``event`` recorded after that bucket's copy, ``None`` on a CPU), for a
        caller that waits per bucket (``TrainingState.restore(overlap_forward=True)``); the next ``step`` waits for
        the last one before it writes the mirror. StateError if the mirror is not enabled."""
        if self._mirror is None:
            raise StateError("upload_params_from_mirror(): the host mirror is not enabled (enable_param_mirror())")
        t = self._transport
        t.begin()
        out = []
        try:
            for b in self._buckets:
                out.append((b.start, b.end, t.upload(self._pflat[b.start:b.end], self._mirror[b.start:b.end])))
        finally:
            if wait:
                t.end()
        self._mirror_upload = None if wait or not out else out[-1][2]
        return out

    def zero_grad(self, set_to_none: bool = True):
        """Zero the flat gradient buffer (grads stay views of it whatever set_to_none says)."""
        self._gflat.zero_()
        if not self.attach_grads:
            return
        for p, gv in zip(self._params, self._gviews):
            if p.grad is None or p.grad.data_ptr() != gv.data_ptr():
                p.grad = gv

    def add_param_group(self, param_group):
        if getattr(self, "_buckets", None) is not None:
            raise StateError("OffloadedAdam lays out its buffers at construction: pass every param group there")
        if not isinstance(param_group, dict):
            raise InvalidArgumentError(f"a param group must be a dict (got {type(param_group).__name__})")
        params = param_group.get("params")
        params = [params] if isinstance(params, torch.Tensor) else list(params or ())
        check_distinct(params, [p for g in self.param_groups for p in g["params"]])
        check_group(param_group, f"param_groups[{len(self.param_groups)}]")
        super().add_param_group({**param_group, "params": params})

    # ---- hooks -------------------------------------------------------------------------------------------------
    def _on_grad_ready(self, p):
        i = self._index.get(id(p))
        if i is None:
            return
        gv = self._gviews[i]
        if p.grad is not None and p.grad.data_ptr() != gv.data_ptr():  # grads were set to None and re-created
            gv.copy_(p.grad)
            p.grad = gv
        if not self.overlap_with_backward:
            return
        for b in self._param_buckets[i]:
            self._ready[b] += 1
            if self._ready[b] % self._buckets[b].n_params == 0 and b < self._slots:  # again per micro-batch
                self._pending[b] = self._download(b, after_current=True)

    def _download(self, b: int, slot: int | None = None, after_current: bool = False):
        bk = self._buckets[b]
        n = bk.end - bk.start
        slot = b % self._slots if slot is None else slot
        return self._transport.download(self._gslots[slot][:n], self._gflat[bk.start:bk.end],
                                        after_current=after_current)

    # ---- the step ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float | None = None, skip_non_finite: bool = False):
        """One pipelined step over every bucket. Returns the closure's loss. With ``skip_non_finite``, a
        non-finite scaled gradient anywhere skips the step (``last_step_applied`` is then False)."""
        loss, scale, hypers = self._begin_step(closure, grad_scale)
        if self._repair_grad_views():
            self._reset_overlap()  # a hook-started download may predate the repaired gradient: download again
        if skip_non_finite:
            amax = torch.linalg.vector_norm(self._gflat, float("inf")).float().item() if self._total else 0.0
            if not math.isfinite(amax * scale):
                self._reset_overlap()
                self.last_step_applied = False
                return loss
        self._settle_mirror_upload()
        # Native validation fails on the first bucket, before any change, so the count moves only once a bucket is
        # stepped; after that the step is made whole whatever interrupts it (Note [A step is whole]).
        error = self._run_pipeline(hypers, float(self._step_count + 1))
        self._step_count += 1
        self.last_step_applied = True
        if error is not None:
            raise error
        return loss

    def _repair_grad_views(self) -> bool:
        """Grads replaced behind our back (e.g. assigned by the user) are copied into the flat buffer."""
        repaired = False
        if not self.attach_grads:
            return repaired
        for p, gv in zip(self._params, self._gviews):
            g = p.grad
            if g is None:
                p.grad = gv.zero_()
                repaired = True
            elif g.data_ptr() != gv.data_ptr():
                gv.copy_(g)
                p.grad = gv
                repaired = True
        return repaired

    def _reset_overlap(self):
        for ev in self._pending.values():
            self._transport.wait(ev)
        self._pending.clear()
        self._ready = [0] * len(self._buckets)

    def _run_pipeline(self, hypers, step_no: float):
        """The step's units are the buckets (``run_step``); returns the error to raise once the step is counted."""
        t, K = self._transport, self._slots
        h = self._host
        vmax_ptr = h.vmax.data_ptr() if h.vmax is not None else 0
        msize = h.m.element_size()
        mom_bf16 = [True] if self._moments_dtype == torch.bfloat16 else []
        pending, self._pending = self._pending, {}

        def compute(b, slot, up):
            bk = self._buckets[b]
            n = bk.end - bk.start
            # The new bf16 params go to the mirror (its own range per bucket) or to a reused upload slot.
            out = self._mirror[bk.start:bk.end] if self._mirror is not None else self._oslots[slot][:n]
            if b >= K and self._mirror is None:
                t.wait(up[b - K])  # its upload slot is free again
            off4, offm = bk.start * 4, bk.start * msize
            t.kernel(
                self._engine.step, hypers[bk.group],
                [h.master.data_ptr() + off4], [h.m.data_ptr() + offm], [h.v.data_ptr() + offm],
                [vmax_ptr + off4] if vmax_ptr else [], [self._gslots[slot].data_ptr()], [True],
                [out.data_ptr()], [n], [], [step_no], mom_bf16)
            return out

        def upload(b, out):
            bk = self._buckets[b]
            return t.upload(self._pflat[bk.start:bk.end], out)

        def notify(b, event):
            bk = self._buckets[b]
            base, size = self._pflat.data_ptr(), self._pflat.element_size()
            for fn in list(self._bucket_hooks.values()):
                fn(base + bk.start * size, base + bk.end * size, event)

        try:
            return run_step(t, len(self._buckets), K, download=self._download, compute=compute, upload=upload,
                            notify=notify if self._bucket_hooks else None, first=pending.get,
                            elements=self._total, step=int(step_no), whole=self._whole)
        finally:
            self._ready = [0] * len(self._buckets)

    # ---- state (state_dict, load_state_dict: Pipelined's) -------------------------------------------------------
    def _positions(self) -> list:
        return list(zip(self._params, self._offsets))
