"""The distributed-optimizer form: each data-parallel rank keeps and steps only its shard of the fp32 master and the
Adam moments in host memory, with Megatron's own shard ranges.

What holds:
- Layout. Megatron's DDP built with ``use_distributed_optimizer=True`` keeps every param in a flat ``param_data``
  buffer and its gradient in ``grad_data`` (one buffer per dtype, dense and expert-parallel apart), cut into
  buckets whose sizes divide by the bucket's data-parallel group size. Rank r owns, in each bucket, the contiguous
  slice ``[offset + r*S, offset + (r+1)*S)`` with ``S = bucket numel / dp`` (``DistributedOptimizer.
  _build_model_gbuf_range``). This optimizer keeps, per owned slice, runs of elements whose params share a param
  group (alignment gaps inside a run hold zeros and stay zero); host memory is 12 B per owned element (8 with bf16
  moments) plus the pinned transfer slots: 1/dp of the non-sharded optimizer's.
- Step. Megatron's DDP has already reduce-scattered the gradients into the owned slice of ``grad_data`` when
  ``finish_grad_sync`` returns (Megatron's training loop calls it before ``optimizer.step()``). The pipeline reads
  the slice in place: D2H of each run (grad dtype as DDP keeps it: bf16, or fp32 with ``grad_reduce_in_fp32``) into
  a pinned slot, the CPU kernel (master/moments; new bf16 params into a pinned upload slot), H2D straight into the
  owned slice of ``param_data``; ``slots`` runs in flight. The caller's stream then waits for the uploads, and the
  params are all-gathered as Megatron's DistributedOptimizer does: synchronously here without
  ``overlap_param_gather``; with it, by DDP's forward pre-hooks (bucket by bucket, overlapped with the forward).
  Whatever interrupts the step after its first run was stepped, the step is finished and ``StepError`` raised, or
  the optimizer refuses further use until a checkpoint is loaded (``_pipeline`` Note [A step is whole]).
- Numerics: ``mode="exact"`` gives torch's CPU AdamW (for-loop) on fp32 masters, the master initialised as
  ``param.float()`` -- what Megatron's DistributedOptimizer with HybridDeviceOptimizer (offload fraction 1.0)
  computes, so losses match it bit for bit (GPU test). Unscale and clip go into the kernel's ``grad_scale``.
- Norm: squares of the owned slices of params that count (not shared, not a TP duplicate), summed over the
  distributed-optimizer group (every rank of one optimizer instance), as Megatron does for its distributed form.
- Checkpoints: ``get_parameter_state_dp_zero`` / ``load_parameter_state_from_dp_zero`` in Megatron's layout
  (``{"buckets_coalesced": True, gbuf_idx: {(param_dtype, grad_dtype): {"param", "exp_avg", "exp_avg_sq",
  "numel_unpadded"}}}``, fp32, on DP rank 0), so the state moves both ways between this optimizer and Megatron's
  DistributedOptimizer. ``state_dict`` holds the param groups and the step only, as Megatron's does.
- Host mirror (``enable_param_mirror``, for ``TrainingState(weights="discard")``): a pinned bf16 copy of the owned
  elements that every step writes in place of the upload slots (the uploads read it), so the weights can be dropped
  on the GPU and rebuilt: ``upload_params_from_mirror`` zeroes each ``param_data`` and writes the owned slices;
  the caller then all-gathers them over the data-parallel group (DDP's ``start_param_sync``), which needs the
  groups, so a trainer that releases its groups does it after reloading them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...errors import InvalidArgumentError, StateError, StepError
from ...optim._validate import check_grad_scale, check_groups
from ...optim.cpu_adam import check_moments_dtype, make_hyper, shared_engine
from ...optim._pipeline import _Transport, run_step

try:
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared
except ImportError as e:  # pragma: no cover - the package is imported through integrations.megatron
    raise ImportError(f"ebbtide.integrations.megatron needs megatron-core (tested with 0.16.1): {e}") from e

__all__ = ["ShardAdam", "shard_ranges"]


@dataclass
class _Run:
    buffer: int  # index into ShardAdam.buffers
    bucket: int
    group: int  # param group
    lo: int  # [lo, hi): element range in the buffer (inside this rank's slice of the bucket)
    hi: int
    host: int  # offset in the host arrays
    norm_pieces: list  # (lo, hi) sub-ranges whose params count for the grad norm


@dataclass
class _Chunk:
    """The pipeline's unit: consecutive runs of one bucket, contiguous both in the buffer and in the host arrays
    (``[lo, hi)`` and ``host``), at most ``run_numel`` elements: one download, one kernel call per param group
    among its runs, one upload. Params of alternating groups (a weight with decay, its bias without) are one chunk,
    not hundreds of runs each paying the copies' and the pool's fixed costs."""
    buffer: int
    lo: int
    hi: int
    host: int
    runs: list  # of _Run
    # per param group among the runs, built once: (group, host offsets, offsets from lo, lengths) of its runs
    spans: list = field(default_factory=list)


def shard_ranges(buffer) -> list[tuple[int, int]]:
    """This rank's ``[start, end)`` slice of every bucket of a Megatron ``_ParamAndGradBuffer`` (buffer coords)."""
    dp = buffer.data_parallel_group.size()
    r = buffer.data_parallel_group.rank()
    out = []
    for b in buffer.buckets:
        n = b.grad_data.numel()
        if n % dp:
            raise InvalidArgumentError(f"a bucket of {n} elements does not divide by the data-parallel size {dp}")
        s = n // dp
        out.append((b.offset + r * s, b.offset + min(n, (r + 1) * s)))
    return out


class ShardAdam(torch.optim.Optimizer):
    """Adam/AdamW over this rank's shards of Megatron DDP buffers, state in host memory (see the module doc)."""

    def __init__(self, groups: list[dict], buffers: list, *, lr, betas, eps, weight_decay, adamw: bool, mode: str,
                 threads=None, run_numel: int = 16 * 2**20, slots: int = 3, moments_dtype=torch.float32, tp_group=None):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=False,
                        decoupled_weight_decay=bool(adamw), mode=mode)
        super().__init__(groups, defaults)
        self._moments_dtype = check_moments_dtype(moments_dtype, False, "ShardAdam")
        if not isinstance(run_numel, int) or run_numel < 64 or not isinstance(slots, int) or slots < 1:
            raise InvalidArgumentError(f"run_numel must be an int >= 64 and slots >= 1 (got {run_numel!r}, {slots!r})")
        self.buffers = list(buffers)
        self._engine = shared_engine(threads, None)
        self._slots = slots
        self._step_count = 0
        self._tp_group = tp_group
        self._mirror = None  # pinned bf16 copy of the owned elements (enable_param_mirror)
        self._mirror_up: list = []  # per run: the last upload that reads its mirror range (an event, or None)
        self._torn = None  # why the state mixes two versions (a step that could not be finished), else None
        self._build(run_numel)
        self._transport = _Transport(self._device)

    # ---- layout ------------------------------------------------------------------------------------------------
    def _build(self, run_numel: int) -> None:
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        devices = {b.param_data.device for b in self.buffers}
        if len(devices) != 1:
            raise InvalidArgumentError(f"the DDP buffers are on several devices: {sorted(map(str, devices))}")
        self._device = devices.pop()
        runs, host = [], 0
        for bi, buf in enumerate(self.buffers):
            if buf.param_data is None or buf.param_dtype != torch.bfloat16:
                raise InvalidArgumentError(f"DDP buffer {bi}: ebbtide's distributed optimizer needs bf16 params in "
                                           f"the buffer (param dtype {buf.param_dtype})")
            slices = shard_ranges(buf)
            pieces = {k: [] for k in range(len(buf.buckets))}
            for p, (start, end, k) in buf.param_index_map.items():
                s0, s1 = slices[k]
                lo, hi = max(start, s0), min(end, s1)
                if lo >= hi:
                    continue
                gi = group_of.get(id(p))
                if gi is None:
                    raise InvalidArgumentError("a param of the DDP buffers is in no param group of the optimizer")
                counts = param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p, self._tp_group)
                pieces[k].append((lo, hi, gi, counts))
            for k in range(len(buf.buckets)):
                for lo, hi, gi, counted in self._merge(sorted(pieces[k])):
                    for c0 in range(lo, hi, run_numel):  # pipeline granularity
                        c1 = min(hi, c0 + run_numel)
                        norm = [(max(a, c0), min(b, c1)) for a, b in counted if max(a, c0) < min(b, c1)]
                        runs.append(_Run(bi, k, gi, c0, c1, host, norm))
                        host += c1 - c0
        # Forward order: the last bucket holds the first layers (DDP fills buckets in backward order).
        runs.sort(key=lambda r: (r.buffer, -r.bucket, r.lo))
        self._runs, self._numel = runs, host
        self._chunks = self._chunk(runs, run_numel)
        self._master = torch.zeros(host, dtype=torch.float32)
        self._m = torch.zeros(host, dtype=self._moments_dtype)
        self._v = torch.zeros(host, dtype=self._moments_dtype)
        longest = max((c.hi - c.lo for c in self._chunks), default=1)
        pin = self._device.type == "cuda"
        gdt = {b.grad_dtype for b in self.buffers}
        self._gslots = {dt: [torch.empty(longest, dtype=dt, pin_memory=pin) for _ in range(self._slots)]
                        for dt in gdt}
        self._oslots = [torch.empty(longest, dtype=torch.bfloat16, pin_memory=pin) for _ in range(self._slots)]
        self.sync_master_from_params()

    @staticmethod
    def _chunk(runs, run_numel: int) -> list:
        """Consecutive runs of one bucket, contiguous in the buffer and in the host arrays, up to ``run_numel``."""
        out = []
        for r in runs:
            c = out[-1] if out else None
            if (c is None or c.buffer != r.buffer or c.runs[-1].bucket != r.bucket or c.hi != r.lo
                    or c.host + (c.hi - c.lo) != r.host or r.hi - c.lo > run_numel):
                out.append(_Chunk(r.buffer, r.lo, r.hi, r.host, [r]))
            else:
                c.hi = r.hi
                c.runs.append(r)
        for c in out:
            for gi in dict.fromkeys(r.group for r in c.runs):
                rs = [r for r in c.runs if r.group == gi]
                c.spans.append((gi, [r.host for r in rs], [r.lo - c.lo for r in rs], [r.hi - r.lo for r in rs]))
        return out

    @staticmethod
    def _merge(pieces):
        """Consecutive pieces of one param group become one run (gaps between them are zeros: stepped to zero)."""
        out = []
        for lo, hi, gi, counts in pieces:
            if out and out[-1][2] == gi:
                out[-1][1] = hi
                if counts:
                    out[-1][3].append((lo, hi))
            else:
                out.append([lo, hi, gi, [(lo, hi)] if counts else []])
        return out

    # ---- views -------------------------------------------------------------------------------------------------
    @property
    def numel(self) -> int:
        """Elements this rank steps (its host state's length)."""
        return self._numel

    @property
    def last_step_times(self) -> dict:
        """Where the last step's time went: ``seconds`` (the whole pipeline), ``kernel_s`` (the CPU kernel),
        ``wait_s`` (the host waiting for copies), ``elements`` stepped; ``{}`` before the first step."""
        return dict(self._transport.times)

    @property
    def host_bytes(self) -> int:
        """Bytes of host state (master and both moments; the pinned slots not counted)."""
        return self._master.nbytes + self._m.nbytes + self._v.nbytes

    def grad_slices(self, counted_only: bool = False) -> list[torch.Tensor]:
        """The owned gradient slices (device tensors), or only those whose params count for the norm."""
        out = []
        for r in self._runs:
            g = self.buffers[r.buffer].grad_data
            out += [g[a:b] for a, b in r.norm_pieces] if counted_only else [g[r.lo:r.hi]]
        return out

    @torch.no_grad()
    def sync_master_from_params(self) -> None:
        """Masters (and the mirror, if enabled) from the owned slices of the bf16 params (after loading model
        weights in place)."""
        for c in self._chunks:
            src = self.buffers[c.buffer].param_data[c.lo:c.hi]
            self._master[c.host:c.host + c.hi - c.lo].copy_(src)
            if self._mirror is not None:
                self._mirror[c.host:c.host + c.hi - c.lo].copy_(src)

    @torch.no_grad()
    def enable_param_mirror(self) -> torch.Tensor:
        """Keep a pinned bf16 host copy of the owned params that every step writes (see the module doc); filled
        from the params now. Idempotent; returns it."""
        if self._mirror is None:
            m = torch.empty(self._numel, dtype=torch.bfloat16, pin_memory=self._device.type == "cuda")
            for c in self._chunks:
                m[c.host:c.host + c.hi - c.lo].copy_(self.buffers[c.buffer].param_data[c.lo:c.hi])
            self._mirror = m
        return self._mirror

    @property
    def param_mirror(self):
        return self._mirror

    @torch.no_grad()
    def upload_params_from_mirror(self) -> None:
        """Zero every ``param_data`` and write the owned slices from the mirror (the caller's stream waits for the
        uploads); the other ranks' slices come with the all-gather that follows. StateError without a mirror."""
        if self._mirror is None:
            raise StateError("upload_params_from_mirror(): the host mirror is not enabled (enable_param_mirror())")
        for b in self.buffers:
            b.param_data.zero_()
        t = self._transport
        t.begin()
        try:
            self._mirror_up = [t.upload(self.buffers[c.buffer].param_data[c.lo:c.hi],
                                        self._mirror[c.host:c.host + c.hi - c.lo]) for c in self._chunks]
        finally:
            t.end()

    # ---- the step ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float | None = None):
        """One pipelined step over the owned runs (units of ``run_step``: an interrupted step is made whole or
        refused, as OffloadedAdam's; see ``_pipeline`` Note [A step is whole])."""
        self._check_whole()
        if closure is not None:
            raise InvalidArgumentError("ShardAdam.step takes no closure (Megatron computes the loss)")
        scale = check_grad_scale(grad_scale)
        check_groups(self.param_groups)
        hypers = [make_hyper(g, grad_scale=scale) for g in self.param_groups]
        step_no = float(self._step_count + 1)
        t, K, chunks = self._transport, self._slots, self._chunks
        mom_bf16 = [True] if self._moments_dtype == torch.bfloat16 else []
        msize = self._m.element_size()
        master, m, v = self._master.data_ptr(), self._m.data_ptr(), self._v.data_ptr()
        mirror_up = self._mirror_up
        done = [0] * len(chunks)  # per chunk: its kernel calls that ran this step (a chunk is several calls)

        def download(i, slot):
            c = chunks[i]
            buf = self.buffers[c.buffer]
            return t.download(self._gslots[buf.grad_dtype][slot][:c.hi - c.lo], buf.grad_data[c.lo:c.hi])

        def compute(i, slot, up):
            c = chunks[i]
            n, buf = c.hi - c.lo, self.buffers[c.buffer]
            # the new bf16 params go to the mirror (its own range per chunk, once the last upload reading that
            # range is done: usually long since, on any stream) or to a reused upload slot
            if self._mirror is not None:
                out = self._mirror[c.host:c.host + n]
                if i < len(mirror_up):
                    t.wait(mirror_up[i])
            else:
                out = self._oslots[slot][:n]
                if i >= K:
                    t.wait(up[i - K])
            grad, outp = self._gslots[buf.grad_dtype][slot].data_ptr(), out.data_ptr()
            gsize, bf16 = buf.grad_data.element_size(), buf.grad_dtype == torch.bfloat16
            for j, (gi, hosts, rel, numels) in enumerate(c.spans):  # one kernel call per param group
                if j < done[i]:  # ran before an interruption: its new params are in this slot already
                    continue
                k = len(hosts)
                t.kernel(self._engine.step, hypers[gi], [master + h * 4 for h in hosts],
                         [m + h * msize for h in hosts], [v + h * msize for h in hosts], [],
                         [grad + x * gsize for x in rel], [bf16] * k, [outp + x * 2 for x in rel], numels, [],
                         [step_no] * k, mom_bf16 * k)
                done[i] = j + 1
            return out

        ups = [None] * len(chunks)

        def upload(i, out):
            c = chunks[i]
            ups[i] = t.upload(self.buffers[c.buffer].param_data[c.lo:c.hi], out)
            return ups[i]

        try:
            error = run_step(t, len(chunks), K, download=download, compute=compute, upload=upload,
                             changed=lambda: any(done), elements=self._numel, step=int(step_no))
        except StepError as e:
            self._torn = str(e)
            raise
        if self._mirror is not None:
            self._mirror_up = ups
        self._step_count += 1
        if error is not None:
            raise error

    def _check_whole(self) -> None:
        if self._torn is not None:
            raise StateError(f"ShardAdam: an earlier step could not be finished, the state mixes two versions "
                             f"({self._torn}); load the parameter state from a checkpoint first")

    # ---- state -------------------------------------------------------------------------------------------------
    @property
    def step_count(self) -> int:
        return self._step_count

    def set_step_count(self, n: int) -> None:
        if not isinstance(n, int) or n < 0:
            raise InvalidArgumentError(f"step count must be an int >= 0 (got {n!r})")
        self._step_count = n

    def _owned(self, bi: int, k: int):
        return [r for r in self._runs if r.buffer == bi and r.bucket == k]

    def local_shard(self, bi: int, k: int, key: str) -> torch.Tensor:
        """This rank's slice of bucket ``k`` of buffer ``bi`` for ``key`` ("param", "exp_avg", "exp_avg_sq") as
        Megatron's checkpoint code lays it out: fp32, zeros where no param is."""
        self._check_whole()
        src = {"param": self._master, "exp_avg": self._m, "exp_avg_sq": self._v}[key]
        s0, s1 = shard_ranges(self.buffers[bi])[k]
        out = torch.zeros(self.buffers[bi].buckets[k].grad_data.numel() // self.buffers[bi].data_parallel_group.size(),
                          dtype=torch.float32)
        for r in self._owned(bi, k):
            out[r.lo - s0:r.hi - s0].copy_(src[r.host:r.host + r.hi - r.lo])
        return out

    @torch.no_grad()
    def set_local_shard(self, bi: int, k: int, key: str, shard: torch.Tensor) -> None:
        dst = {"param": self._master, "exp_avg": self._m, "exp_avg_sq": self._v}[key]
        s0, _ = shard_ranges(self.buffers[bi])[k]
        for r in self._owned(bi, k):
            dst[r.host:r.host + r.hi - r.lo].copy_(shard[r.lo - s0:r.hi - s0])

    @torch.no_grad()
    def upload_params_from_master(self) -> None:
        """The owned slices of the bf16 params (and the mirror, if enabled) from the masters (after loading a
        checkpoint: the state is whole again)."""
        self._torn = None
        for r in self._runs:
            dst = self.buffers[r.buffer].param_data[r.lo:r.hi]
            dst.copy_(self._master[r.host:r.host + r.hi - r.lo])
            if self._mirror is not None:
                self._mirror[r.host:r.host + r.hi - r.lo].copy_(dst)

    def state_dict(self):
        raise StateError("ShardAdam's state is sharded: use the Megatron optimizer's state_dict() for the common part "
                         "and get_parameter_state_dp_zero() for the parameter state")
