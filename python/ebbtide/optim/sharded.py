"""ShardedAdam: Adam/AdamW over one rank's set of local shards, fp32 master and moments in host memory, the bf16 params
on the device, stepped through the same per-bucket pipeline as OffloadedAdam.

A data-parallel trainer that shards its optimizer state gives each rank some elements of the model to update: in
Megatron-core's distributed optimizer, ranges of the flat DDP param buffer (``param_data``) with their gradients in
``grad_data``; in FSDP2 (``fully_shard``), per parameter the DTensor's ``_local_tensor``, a view of its padded 1-D
``_sharded_param_data``, with the gradient a DTensor whose ``_local_tensor`` is a new view each step. ShardedAdam
steps such a set; an integration maps its framework's shards onto it and supplies the collectives around the step.

Policies:
- Shards. ``Shard(param, grad, group=0, counts_for_norm=True, grad_dtype=None, name="")``: ``param`` a contiguous
  bf16 tensor on the rank's device (any shape, all shards on one device, none overlapping another) that the step
  writes in place and that keeps its storage (the storage may be re-backed in place, as ``ebbtide.memory`` regions
  do: no device address is kept between calls); ``grad`` a tensor of as many elements (bf16 or fp32, contiguous, same
  device) that stays where it is, or a function returning this step's gradient (or None: the shard is then stepped
  with a zero gradient, one step count for all, as in OffloadedAdam and Megatron's distributed optimizer), called
  at the start of each step (``grad_dtype``: what it returns, default the param's dtype); ``group`` the index of its
  param group; ``counts_for_norm`` whether its gradient counts in ``grad_norm`` (Megatron: not a tensor-parallel
  duplicate, not shared); ``name`` what errors call it (the model's parameter name). Shards of zero elements
  (FSDP2's ranks past an uneven split) are held and never stepped.
- Storage kept: the optimizer keeps views of every shard's param (and of a gradient given as a tensor) from its
  construction, so a tensor whose storage is later swapped for another (``set_``, a framework moving it) would
  be stepped in its old memory while the model reads the new one. ``step``, ``upload_params_from_mirror`` and
  ``upload_params_from_master`` first compare each such tensor's address with its view's (an integer compare per
  shard) and raise StateError naming the shard, before anything changes. A storage resized in place (what
  ``ebbtide.memory`` and Megatron's offload do) is the views' storage too and passes.
- Param groups. ``param_groups`` is a list of dicts of hyper-parameters, one per group index (no ``"params"``: the
  shards name their group); the optimizer's ``param_groups`` are torch's, each listing its shards' ``param``
  tensors, so lr schedulers and ``state_dict`` work as with any torch optimizer.
- Layout. The host arrays hold the shards' elements in the order given (12 B per element; 8 with bf16 moments, 16
  with amsgrad), plus ``slots`` pinned gradient slots and ``slots`` pinned bf16 upload slots of ``bucket_numel``
  elements. That order, cut every ``bucket_numel`` elements (and where the gradient dtype changes), makes the
  buckets: a bucket may hold pieces of many shards and of several param groups. Give the shards in the order their
  memory lies (Megatron: a bucket's ranges in buffer order; FSDP2: the module's parameters in order): consecutive
  shards adjacent in device memory are one copy each way.
- Step. Per bucket, on runtime-owned streams: the gradients' D2H into a slot (one copy per run of adjacent shards),
  the CPU kernel (one native call per param group among the bucket's shards; GIL released) updating master and
  moments and writing the new bf16 params into a pinned upload slot, H2D into the shards' params; ``slots``
  buckets in flight. Everything queued on the caller's stream before ``step`` is ordered before the copies, and the
  caller's stream waits for the last upload. Whatever interrupts a step after its first kernel call, the step is
  finished and counted, then ``StepError(completed=True)`` is raised, or, if it cannot be finished,
  ``StepError(completed=False)`` and the optimizer refuses ``step`` and state reads until a checkpoint is loaded
  (``_pipeline`` Note [A step is whole]). Bad gradients (wrong size, dtype, device) raise InvalidArgumentError
  before anything changes.
- Numerics: the kernel of CPUAdam. ``mode="exact"``: every master bit-identical to torch's CPU AdamW/Adam
  (``foreach=False``) stepping an fp32 copy of the shard with the same gradients (a shard's elements are
  independent: how the set is cut into shards and buckets does not change a bit); the param is exactly
  ``master.to(bf16)``. ``moments_dtype=torch.bfloat16``: the moments are kept as bf16 (CPUAdam's bf16 moments).
- Hooks the integration supplies (constructor arguments, or set the attributes later): ``after_step()`` runs once
  a step is whole, also one that was interrupted and finished (before its StepError is raised), so every rank
  goes on to the same collectives (Megatron: the params' all-gather over the data-parallel group; FSDP2 needs
  none: the next forward all-gathers). ``all_reduce(tensor, op)`` returns a one-element tensor reduced
  (``torch.distributed.ReduceOp.SUM`` or ``MAX``) over every rank holding shards of the same model (Megatron: its
  Gloo twin of the distributed-optimizer group); default: this rank alone. ``grad_norm()`` and
  ``has_non_finite_grad()`` reduce through it.
- State: ``state[p]`` holds views of the host arrays per shard param (torch's keys plus ``master_param``), so
  ``state_dict`` is torch's format (shards numbered as torch numbers params, group by group) and
  ``load_state_dict`` takes it back (validated first; masters of shards without a saved ``master_param`` come from
  the params). ``local_shard(i, key)`` / ``set_local_shard(i, key, t)``: one shard's state by its index in the
  order given, for a framework's own checkpoint layout (Megatron's dp_zero form, FSDP2's DTensor state).
- Host mirror (``enable_param_mirror``): a pinned bf16 copy of the shards' elements that every step writes in place
  of the upload slots, so the params can be dropped on the device and rebuilt with ``upload_params_from_mirror``
  (only the shards' elements: padding around them, and the other ranks' elements, are the caller's).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from .._messages import shown
from ..errors import InvalidArgumentError, StateError
from ._host_state import HostState
from ._pipeline import Pipelined, Whole, _Transport, run_step
from ._validate import check_bucketing, check_distinct, check_groups
from .cpu_adam import KernelViews, _check_hyper, _check_threads_isa, check_moments_dtype, shared_engine

__all__ = ["Shard", "ShardedAdam", "sum_of_squares"]

_GRAD_DTYPES = (torch.bfloat16, torch.float32)


@dataclass(frozen=True, eq=False)
class Shard:
    """One piece of the model this rank updates (see the module policies)."""
    param: torch.Tensor
    grad: torch.Tensor | Callable[[], torch.Tensor | None]
    group: int = 0
    counts_for_norm: bool = True
    grad_dtype: torch.dtype | None = None
    name: str = ""


@dataclass
class _Bucket:
    """The pipeline's unit: host elements ``[start, end)``, consecutive pieces of shards."""
    start: int
    end: int
    grad_dtype: torch.dtype
    pieces: list  # (shard index, lo, hi): elements [lo, hi) of that shard, at host start + their offset here
    calls: list = field(default_factory=list)  # per param group: (group, host offsets, bucket offsets, lengths)
    uploads: list = field(default_factory=list)  # (bucket offset, n, device view of params): adjacent pieces merged


def _wrapper(t) -> bool:
    return getattr(t, "_local_tensor", None) is not None  # a DTensor: its _local_tensor is what to pass


def _runs(pieces: list) -> list:
    """``[(offset, n, view)]``: consecutive pieces (``n`` elements at ``offset`` in the bucket, a 1-D device view or
    None for zeros) merged where they are adjacent in one storage (or both None): one copy for each run."""
    out = []
    for off, n, v in pieces:
        if out:
            prev_off, prev_n, prev = out[-1]
            if v is None and prev is None:
                out[-1] = (prev_off, prev_n + n, None)
                continue
            if (v is not None and prev is not None and prev.dtype == v.dtype and prev.device == v.device
                    and prev.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
                    and prev.storage_offset() + prev_n == v.storage_offset()):
                out[-1] = (prev_off, prev_n + n, prev.as_strided((prev_n + n,), (1,), prev.storage_offset()))
                continue
        out.append((off, n, v))
    return out


class ShardedAdam(Pipelined, KernelViews, torch.optim.Optimizer):
    """Adam/AdamW over this rank's local shards, state in host memory (see the module policies). Also:
    ``buckets``, ``last_step_times``, ``moments_dtype``, ``threads``, ``isa``, ``engine``."""

    def __init__(self, shards, param_groups=None, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 adamw=True, amsgrad=False, maximize=False, mode="fast", threads=None, isa=None,
                 bucket_numel=16 * 2**20, slots=3, moments_dtype=torch.float32, after_step=None, all_reduce=None):
        _check_hyper(lr, betas, eps, weight_decay, mode, "ShardedAdam", amsgrad=amsgrad, maximize=maximize,
                     decoupled_weight_decay=adamw)
        _check_threads_isa(threads, isa)
        self._moments_dtype = check_moments_dtype(moments_dtype, amsgrad, "ShardedAdam")
        check_bucketing(bucket_numel, slots, 64)
        for name, fn in (("after_step", after_step), ("all_reduce", all_reduce)):
            if fn is not None and not callable(fn):
                raise InvalidArgumentError(f"{name} must be callable or None (got {shown(fn)})")
        self._shards = self._check_shards(shards)
        groups = self._groups(param_groups)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=bool(amsgrad),
                        maximize=bool(maximize), decoupled_weight_decay=bool(adamw), mode=mode)
        super().__init__(groups, defaults)
        check_groups(self.param_groups)
        if any(g["amsgrad"] for g in self.param_groups) and self._moments_dtype != torch.float32:
            raise InvalidArgumentError("ShardedAdam: amsgrad needs fp32 moments (moments_dtype=torch.bfloat16 given)")
        self.after_step, self.all_reduce = after_step, all_reduce
        self._engine = shared_engine(threads, isa)
        self._slots = slots
        self._step_count = 0
        self._mirror = None  # pinned bf16 copy of the shards' elements (enable_param_mirror)
        self._mirror_up: list = []  # per bucket: the last upload that reads its mirror range (an event, or None)
        self._whole = Whole("ShardedAdam", "load a checkpoint (load_state_dict, or set_local_shard then "
                                           "upload_params_from_master) first")
        self._layout(bucket_numel)
        # (what, shard index, the tensor, a view of it made now): the storage every cached view reads
        self._kept = [(what, i, t, t.view(-1)) for i, s in enumerate(self._shards)
                      for what, t in (("param", s.param), ("gradient", s.grad))
                      if isinstance(t, torch.Tensor) and t.numel()]
        self._transport = _Transport(self._device)
        self.sync_master_from_params()
        self._host.publish(self.state, self._positions(), 0)

    # ---- construction ------------------------------------------------------------------------------------------
    @staticmethod
    def _check_shards(shards) -> list:
        if isinstance(shards, (torch.Tensor, Shard, Mapping)) or not isinstance(shards, Iterable):
            raise InvalidArgumentError(f"shards must be an iterable of ebbtide.optim.Shard (got {shown(shards)})")
        shards = list(shards)
        if not shards:
            raise InvalidArgumentError("ShardedAdam got no shards")
        devices = set()
        for i, s in enumerate(shards):
            if not isinstance(s, Shard):
                raise InvalidArgumentError(f"shard {i} must be an ebbtide.optim.Shard (got {shown(s)})")
            p = s.param
            if not isinstance(p, torch.Tensor) or _wrapper(p):
                raise InvalidArgumentError(f"shard {i}: param must be a plain tensor (a DTensor's _local_tensor, a "
                                           f"range of a flat buffer), got {shown(p)}")
            if p.dtype != torch.bfloat16 or not p.is_contiguous() or (p.requires_grad and not p.is_leaf):
                raise InvalidArgumentError(f"shard {i}: param must be a contiguous bf16 tensor that autograd does not "
                                           f"track (got {p.dtype}, contiguous={p.is_contiguous()}, leaf={p.is_leaf})")
            if not isinstance(s.group, int) or isinstance(s.group, bool) or s.group < 0:
                raise InvalidArgumentError(f"shard {i}: group must be an int >= 0 (got {shown(s.group)})")
            if not isinstance(s.name, str):
                raise InvalidArgumentError(f"shard {i}: name must be a str (got {shown(s.name)})")
            if s.grad_dtype is not None and s.grad_dtype not in _GRAD_DTYPES:
                raise InvalidArgumentError(f"shard {i}: grad_dtype must be torch.bfloat16 or torch.float32 (got "
                                           f"{shown(s.grad_dtype)})")
            if isinstance(s.grad, torch.Tensor):
                if s.grad_dtype is not None and s.grad_dtype != s.grad.dtype:
                    raise InvalidArgumentError(f"shard {i}: grad_dtype {s.grad_dtype} but its grad is {s.grad.dtype}")
            elif not callable(s.grad):
                raise InvalidArgumentError(f"shard {i}: grad must be a tensor or a function returning one (got "
                                           f"{shown(s.grad)})")
            devices.add(p.device)
        if len(devices) > 1:
            raise InvalidArgumentError(f"the shards are on several devices: {sorted(map(str, devices))}")
        check_distinct([s.param for s in shards])  # two shards writing the same bytes would race
        device = devices.pop()
        for i, s in enumerate(shards):
            if isinstance(s.grad, torch.Tensor):
                _check_grad(i, s, s.grad, device)
        return shards

    def _groups(self, param_groups) -> list:
        """torch's param groups: each hyper-parameter dict with its shards' params."""
        if param_groups is None:
            param_groups = [{}]
        if isinstance(param_groups, Mapping) or not isinstance(param_groups, (list, tuple)):
            raise InvalidArgumentError(f"param_groups must be a list of dicts (got {shown(param_groups)})")
        out = []
        for gi, g in enumerate(param_groups):
            if not isinstance(g, Mapping) or "params" in g:
                raise InvalidArgumentError(f"param_groups[{gi}] must be a dict of hyper-parameters without 'params' "
                                           f"(each Shard names its group), got {shown(g)}")
            out.append({**g, "params": [s.param for s in self._shards if s.group == gi]})
        for i, s in enumerate(self._shards):
            if s.group >= len(out):
                raise InvalidArgumentError(f"shard {i} names group {s.group}; there are {len(out)} param groups")
        return out

    def _layout(self, bucket_numel: int) -> None:
        self._device = self._shards[0].param.device
        self._grad_dtypes = [s.grad.dtype if isinstance(s.grad, torch.Tensor) else (s.grad_dtype or s.param.dtype)
                             for s in self._shards]
        self._offsets, host = [], 0
        buckets: list[_Bucket] = []
        for i, s in enumerate(self._shards):
            self._offsets.append(host)
            n, lo = s.param.numel(), 0
            while lo < n:
                b = buckets[-1] if buckets else None
                if b is None or b.end - b.start == bucket_numel or b.grad_dtype != self._grad_dtypes[i]:
                    b = _Bucket(host, host, self._grad_dtypes[i], [])
                    buckets.append(b)
                hi = min(n, lo + bucket_numel - (b.end - b.start))
                b.pieces.append((i, lo, hi))
                b.end += hi - lo
                host += hi - lo
                lo = hi
        self._numel, self._buckets = host, buckets
        for b in buckets:
            rel = 0
            calls: dict = {}  # group -> [host offsets, bucket offsets, lengths]; adjacent pieces of one group merged
            views = []
            for i, lo, hi in b.pieces:
                gi, n = self._shards[i].group, hi - lo
                c = calls.setdefault(gi, [[], [], []])
                if c[1] and c[1][-1] + c[2][-1] == rel:
                    c[2][-1] += n
                else:
                    c[0].append(b.start + rel)
                    c[1].append(rel)
                    c[2].append(n)
                views.append((rel, n, self._shards[i].param.view(-1)[lo:hi]))
                rel += n
            b.calls = [(gi, *c) for gi, c in calls.items()]
            b.uploads = _runs(views)
        amsgrad = any(g["amsgrad"] for g in self.param_groups)
        self._host = HostState(host, self._moments_dtype, amsgrad)
        longest = max((b.end - b.start for b in buckets), default=1)
        pin = self._device.type == "cuda"
        width = max((t.itemsize for t in self._grad_dtypes), default=2)
        self._gslots = [torch.empty(longest * width, dtype=torch.uint8, pin_memory=pin) for _ in range(self._slots)]
        self._oslots = [torch.empty(longest, dtype=torch.bfloat16, pin_memory=pin) for _ in range(self._slots)]
        self._fixed = None
        if all(isinstance(s.grad, torch.Tensor) for s in self._shards):
            self._fixed = self._download_plan([s.grad for s in self._shards])  # the grads never move

    def _positions(self) -> list:
        return [(s.param, o) for s, o in zip(self._shards, self._offsets)]

    def check_storage(self, what: str = "step()") -> None:
        """StateError naming the first shard whose param (or gradient tensor) no longer lies in the storage the
        optimizer's views read (see the module policies); nothing is changed."""
        for kind, i, t, view in self._kept:
            if t.data_ptr() != view.data_ptr():
                name = self._shards[i].name
                raise StateError(f"{what}: the {kind} of shard {i}{f' ({name})' if name else ''} was moved to another "
                                 f"storage after the optimizer was built (set_, or a framework re-creating it: "
                                 f"model.to(), load_state_dict(assign=True)); the optimizer would step its old "
                                 f"memory. Nothing was changed: build the optimizer again over the tensors as they "
                                 f"are now")

    # ---- views -------------------------------------------------------------------------------------------------
    @property
    def shards(self) -> list[Shard]:
        """The shards, in the order given (``local_shard``'s indices)."""
        return list(self._shards)

    @property
    def numel(self) -> int:
        """Elements this rank steps (its host state's length)."""
        return self._numel

    @property
    def host_bytes(self) -> int:
        """Bytes of host state (master and moments; the pinned slots and the mirror not counted)."""
        return self._host.nbytes

    @property
    def step_count(self) -> int:
        return self._step_count

    def set_step_count(self, n: int) -> None:
        """The step count (a framework's checkpoint keeps it apart from the shards' state)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise InvalidArgumentError(f"step count must be an int >= 0 (got {n!r})")
        self._step_count = n

    # ---- gradients ---------------------------------------------------------------------------------------------
    def _grads_now(self) -> list:
        """Every shard's gradient for this step (a tensor, or None for a zero gradient), checked."""
        out = []
        for i, s in enumerate(self._shards):
            g = s.grad if isinstance(s.grad, torch.Tensor) else s.grad()
            if g is not None:
                _check_grad(i, s, g, self._device, self._grad_dtypes[i])
            out.append(g)
        return out

    def _download_plan(self, grads: list) -> list:
        """Per bucket ``[(offset, n, device view or None)]``: the gradient copies into its slot (None: zeros)."""
        plan = []
        for b in self._buckets:
            pieces, rel = [], 0
            for i, lo, hi in b.pieces:
                pieces.append((rel, hi - lo, None if grads[i] is None else grads[i].reshape(-1)[lo:hi]))
                rel += hi - lo
            plan.append(_runs(pieces))
        return plan

    def grads(self, counted_only: bool = False) -> list[torch.Tensor]:
        """The shards' gradients this step (1-D device views; shards without one left out), or only those that
        count for the norm."""
        return [g.reshape(-1) for s, g in zip(self._shards, self._grads_now())
                if g is not None and g.numel() and (s.counts_for_norm or not counted_only)]

    def _reduce(self, t: torch.Tensor, op) -> float:
        return float((self.all_reduce(t, op) if self.all_reduce is not None else t).item())

    @torch.no_grad()
    def grad_norm(self) -> float:
        """The fp32 2-norm of the gradients that count, over every rank (``all_reduce``)."""
        return math.sqrt(self._reduce(sum_of_squares(self.grads(counted_only=True), self._device),
                                      torch.distributed.ReduceOp.SUM))

    @torch.no_grad()
    def has_non_finite_grad(self) -> bool:
        """Whether any rank's gradient holds an Inf or a NaN (``all_reduce`` with MAX)."""
        grads = self.grads()
        bad = torch.zeros(1, dtype=torch.float32, device=self._device)
        if grads:
            amax = torch.stack(torch._foreach_norm(grads, float("inf"), dtype=torch.float32))
            bad += (~torch.isfinite(amax)).any().float()
        return self._reduce(bad, torch.distributed.ReduceOp.MAX) > 0

    # ---- the step ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float | None = None):
        """One pipelined step over every bucket; returns the closure's loss. ``grad_scale`` multiplies the
        gradients first (an unscale factor, a clip coefficient)."""
        self.check_storage("step()")
        loss, _, hypers = self._begin_step(closure, grad_scale)
        plan = self._fixed if self._fixed is not None else self._download_plan(self._grads_now())
        error = self._run(hypers, plan, float(self._step_count + 1))
        self._step_count += 1
        if self.after_step is not None:
            try:
                self.after_step()
            except BaseException as e:
                e.__context__ = error
                raise
        if error is not None:
            raise error
        return loss

    def _run(self, hypers, plan, step_no: float):
        """The buckets through ``run_step``; returns the error to raise once the step is counted."""
        t, K, buckets, h = self._transport, self._slots, self._buckets, self._host
        mom_bf16 = [True] if self._moments_dtype == torch.bfloat16 else []
        msize = h.m.element_size()
        master, m, v = h.master.data_ptr(), h.m.data_ptr(), h.v.data_ptr()
        vmax = h.vmax.data_ptr() if h.vmax is not None else 0
        mirror_up = self._mirror_up
        done = [0] * len(buckets)  # per bucket: its kernel calls that ran this step (a bucket is several calls)

        def download(i, slot):
            b = buckets[i]
            gs = self._gslots[slot].view(b.grad_dtype)
            event = None
            for off, n, src in plan[i]:
                if src is None:
                    gs[off:off + n].zero_()  # on the host: no copy into this slot is in flight now
                else:
                    event = t.download(gs[off:off + n], src)
            return event

        def compute(i, slot, up):
            b = buckets[i]
            n = b.end - b.start
            # the new bf16 params go to the mirror (its own range per bucket, once the last upload reading that
            # range is done: usually long since) or to a reused upload slot
            if self._mirror is not None:
                out = self._mirror[b.start:b.end]
                if i < len(mirror_up):
                    t.wait(mirror_up[i])
            else:
                out = self._oslots[slot][:n]
                if i >= K:
                    t.wait(up[i - K])
            grad, outp = self._gslots[slot].data_ptr(), out.data_ptr()
            gsize, bf16 = b.grad_dtype.itemsize, b.grad_dtype == torch.bfloat16
            for j, (gi, hosts, rel, numels) in enumerate(b.calls):  # one kernel call per param group
                if j < done[i]:  # ran before an interruption: its new params are in this slot already
                    continue
                k = len(hosts)
                t.kernel(self._engine.step, hypers[gi], [master + x * 4 for x in hosts],
                         [m + x * msize for x in hosts], [v + x * msize for x in hosts],
                         [vmax + x * 4 for x in hosts] if vmax else [], [grad + x * gsize for x in rel],
                         [bf16] * k, [outp + x * 2 for x in rel], numels, [], [step_no] * k, mom_bf16 * k)
                done[i] = j + 1
            return out

        ups = [None] * len(buckets)

        def upload(i, out):
            for off, n, dst in buckets[i].uploads:
                ups[i] = t.upload(dst, out[off:off + n])
            return ups[i]

        error = run_step(t, len(buckets), K, download=download, compute=compute, upload=upload,
                         changed=lambda: any(done), elements=self._numel, step=int(step_no), whole=self._whole)
        if self._mirror is not None:
            self._mirror_up = ups
        return error

    # ---- params, masters and the mirror -------------------------------------------------------------------------
    def _segments(self):
        """``(host slice, device view)`` of every run of adjacent shard elements."""
        for b in self._buckets:
            for off, n, dst in b.uploads:
                yield slice(b.start + off, b.start + off + n), dst

    @torch.no_grad()
    def sync_master_from_params(self) -> None:
        """Masters (and the mirror, if enabled) from the shards' bf16 params (after loading model weights)."""
        for sl, src in self._segments():
            self._host.master[sl].copy_(src)
            if self._mirror is not None:
                self._mirror[sl].copy_(src)

    @torch.no_grad()
    def upload_params_from_master(self) -> None:
        """The shards' bf16 params (and the mirror) from the masters, after ``set_local_shard`` loaded a
        checkpoint: the state is whole again."""
        self.check_storage("upload_params_from_master()")
        for sl, dst in self._segments():
            dst.copy_(self._host.master[sl])
            if self._mirror is not None:
                self._mirror[sl].copy_(dst)
        self._whole.torn = None

    def _copy_params_to(self, host: torch.Tensor) -> None:
        for sl, src in self._segments():  # the mirror of the shards' elements (enable_param_mirror)
            host[sl].copy_(src)

    @torch.no_grad()
    def upload_params_from_mirror(self) -> None:
        """Write the mirror into the shards' params (the caller's stream waits for the uploads). StateError
        without a mirror."""
        if self._mirror is None:
            raise StateError("upload_params_from_mirror(): the host mirror is not enabled (enable_param_mirror())")
        self.check_storage("upload_params_from_mirror()")
        t = self._transport
        t.begin()
        ups = []
        try:
            for b in self._buckets:
                event = None
                for off, n, dst in b.uploads:
                    event = t.upload(dst, self._mirror[b.start + off:b.start + off + n])
                ups.append(event)
        finally:
            self._mirror_up = ups
            t.end()

    # ---- state -------------------------------------------------------------------------------------------------
    def _shard_range(self, i: int, key: str) -> torch.Tensor:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(self._shards):
            raise InvalidArgumentError(f"shard index must be an int in [0, {len(self._shards)}) (got {shown(i)})")
        arrays = self._host.arrays()
        if key not in arrays:
            raise InvalidArgumentError(f"key must be one of {sorted(arrays)} (got {shown(key)})")
        p, o = self._shards[i].param, self._offsets[i]
        return arrays[key][o:o + p.numel()].view(p.shape)

    def local_shard(self, i: int, key: str) -> torch.Tensor:
        """A copy of shard ``i``'s ``key`` ("master_param", "exp_avg", "exp_avg_sq"; "max_exp_avg_sq" with amsgrad)
        as fp32, shaped like its param."""
        self._whole.check()
        return self._shard_range(i, key).to(torch.float32, copy=True)

    @torch.no_grad()
    def set_local_shard(self, i: int, key: str, value: torch.Tensor) -> None:
        """Set shard ``i``'s ``key`` from ``value`` (as many elements; converted to the state's dtype). Call
        ``upload_params_from_master`` once the masters are loaded."""
        dst = self._shard_range(i, key)
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.numel() != dst.numel():
            raise InvalidArgumentError(f"shard {i} {key}: expected a floating-point tensor of {dst.numel()} elements "
                                       f"(got {shown(value)})")
        dst.copy_(value.reshape(dst.shape))

    def add_param_group(self, param_group):
        if getattr(self, "_buckets", None) is not None:
            raise StateError("ShardedAdam lays out its host state at construction: pass every shard there")
        super().add_param_group(param_group)


def _check_grad(i: int, s: Shard, g, device, dtype=None) -> None:
    want = dtype or g.dtype
    if not isinstance(g, torch.Tensor) or _wrapper(g):
        raise InvalidArgumentError(f"shard {i}: its gradient must be a plain tensor (a DTensor's _local_tensor), got "
                                   f"{shown(g)}")
    if (g.device != device or g.dtype not in _GRAD_DTYPES or g.dtype != want or g.numel() != s.param.numel()
            or not g.is_contiguous()):
        raise InvalidArgumentError(f"shard {i}: its gradient must be a contiguous {want} tensor of "
                                   f"{s.param.numel()} elements on {device} (got {g.dtype}, {g.numel()} elements "
                                   f"on {g.device}, contiguous={g.is_contiguous()})")


def sum_of_squares(grads: list, device) -> torch.Tensor:
    """Sum of the squares of the gradients' fp32 2-norms, as a one-element fp32 tensor on ``device``: one
    multi-tensor launch for all of them (a model's shards are hundreds of tensors)."""
    if not grads:
        return torch.zeros(1, dtype=torch.float32, device=device)
    return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum().reshape(1)
