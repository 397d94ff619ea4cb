"""The trainer's end of a weight update: gather (TP), quantize and hand each bucket to a transport.

Policies:
- ``Sender(tensors, transport, plan=...)``: ``transport`` is the sending end of a transport (``HostSender``,
  ``IpcSender``, ``NcclSender``, or an SGLang one from ``ebbtide.integrations.sglang``); ``tensors`` is a mapping
  name -> tensor or a callable returning one (read again at every push, so re-pointed ``.data`` is followed); any
  trainer's named parameters (plain torch, or names converted to the serving model's).
- Tensor parallel: with ``tp_group`` and ``tp_dims`` (name -> the dimension a parameter is split along), the
  plan is built on full shapes; every TP rank joins one all-gather per sharded tensor of a bucket, right before
  that bucket is quantized, and only TP rank 0 (``is_source``) quantizes and sends, unless ``each_rank_sends``:
  then every TP rank quantizes the gathered tensors and sends them through its own transport (one serving engine
  per GPU, each fed by the trainer rank on its GPU, as slime's colocated engines are). Gather buffers live for
  one bucket.
- Expert parallel: with ``ep_group`` and ``ep_sources`` (``{global name: (local name, EP rank)}`` for every
  expert parameter of the whole model) the plan names every expert under its global name while ``tensors`` holds
  this rank's local experts. Before a bucket is filled, every EP rank joins one coalesced all-gather per dtype of
  the local experts whose global names the bucket holds and that no earlier gather brought (each rank's pieces
  packed in one buffer, gathered over the group): the pieces of the other EP ranks wait until their own bucket is
  filled, so with the plan in name order at most the experts of one layer are held beyond the bucket. Every EP rank
  must push the same plan (the gathers pair up in plan order); expert parameters split over a tensor-parallel
  group are refused. Without a plan, the sender's plan lists the rank's other tensors in their order, then the
  experts in ``ep_sources``' order. Gathered experts are new buffers at every push, so their buckets' FP8 launch
  tables are rebuilt each time (the host-work note below holds for the rest). A failure on one EP rank outside the
  collective (out of memory, a missing tensor) leaves its peers waiting in their next gather until the group's
  timeout.
- Custom gathers: ``gather`` is an object for trainers whose shards are not split along one dimension per rank
  (FSDP2's padded dim-0 shards: ``ebbtide.integrations.fsdp.ShardGather``). ``gather.spec(name, local)`` gives the
  full ``(shape, dtype)`` the plan is built on; ``gather(names, tensors)`` returns ``({name: full tensor}, [new
  allocations])`` for one bucket's sources, in plan order on every rank (one collective per bucket and dtype is
  the point). Not with ``tp_dims`` or ``ep_sources``; a RuntimeError from it (a peer gone) is a
  PartialUpdateError, nothing committed.
- Host work: each bucket's FP8 launch table is built at the first push and kept while the tensors and the
  transport's buffer stay where they are (``ebbtide.quant.prepared``), and its FP8 source names are listed once, so
  a push reads each tensor's address, strides, size and dtype and does no other per-tensor work in Python (an MoE
  layer's experts are thousands; without TP the caller's mapping is read as it is, not copied per bucket).
- Overlap: on CUDA the gathers and quantization of every bucket run on the sender's own stream, which first waits
  for the caller's current stream ("optimizer done"); the transport moves bucket k (copy, IPC hand-off or
  broadcast on its own stream) while bucket k+1 is quantized. A producer buffer is written again only after the
  transport says its previous content was consumed on the device (an event), never when a reply arrives.
- ``open(version, wait=False)`` starts the transport's begin of the update (for CUDA IPC: the round trip to the
  receiver and the mapping of its staging) on the sender's own thread and returns a Future; ``push(version)`` then
  joins it instead of beginning. A trainer opens the update right after its backward, so the begin runs beside
  its CPU optimizer step (whose kernels release the GIL), and the push has only the fills and the commit left.
  The receiver must be ready to answer (for IPC: serving its ``receive``). A push of another version than the open
  one raises ``InvalidArgumentError`` and leaves the update open; a failed open raises from the push; ``abort()``
  gives an open update up (a failed or skipped step): the transport is closed, the receiver keeps its version.
- ``streamed(version)`` fills the update while its producer still writes the weights (``_stream.py``): each source
  as soon as its bytes are reported done, the commit at ``finish()``; for CUDA IPC and the host transport on CPU
  tensors, without gathers.
- ``push(version)`` returns when the receiver holds the new version (the transport's commit), or raises; the
  receiver then still holds its previous version. A TP gather that raises (a peer rank died, seen by Gloo within
  its timeout) becomes PartialUpdateError before the commit; with NCCL a dead peer usually ends in torch's
  watchdog aborting the process after the group's timeout instead. Either way nothing is committed, and a
  receiver waiting for the rest of the update gives up at its own timeout or when the connection closes.
"""
from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Mapping

import torch

from ..errors import InvalidArgumentError, StateError
from ._fill import BucketFill
from ._stream import PushReport, StreamedPush
from .errors import PartialUpdateError
from .plan import Plan

__all__ = ["Sender", "PushReport"]


class Sender:
    def __init__(self, tensors: Mapping | Callable[[], Mapping], transport, *, plan: Plan | None = None,
                 tp_group=None, tp_dims: Mapping[str, int] | None = None, each_rank_sends: bool = False, device=None,
                 ep_group=None, ep_sources: Mapping[str, tuple[str, int]] | None = None, gather=None,
                 **plan_options):
        self._tensors = tensors if callable(tensors) else (lambda: tensors)
        self._custom = gather
        if gather is not None and (tp_dims or ep_sources):
            raise InvalidArgumentError("gather= replaces the tensor- and expert-parallel gathers: pass one or the "
                                       "other")
        self.transport = transport
        self.tp_group, self.tp_dims = tp_group, dict(tp_dims or {})
        self.tp_size, self.tp_rank = 1, 0
        if tp_group is not None:
            import torch.distributed as dist  # noqa: PLC0415

            self.tp_size, self.tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        elif self.tp_dims:
            raise InvalidArgumentError("tp_dims needs a tp_group")
        local = dict(self._tensors())
        if not local:
            raise InvalidArgumentError("nothing to send: no tensors")
        unknown = sorted(set(self.tp_dims) - set(local))
        if unknown:
            raise InvalidArgumentError(f"tp_dims names tensors the trainer does not have: {unknown[:4]}")
        self._init_experts(ep_group, ep_sources, local)
        if plan is None:
            sources = [n for n in local if n not in self._ep_local] + list(self.ep_sources)
            plan = Plan.build([(n, *self._full_spec(n, self._local_of(n, local))) for n in sources], **plan_options)
        elif plan_options:
            raise InvalidArgumentError(f"pass either a plan or plan options, not both: {sorted(plan_options)}")
        self.plan = plan
        self._planned = {it.source for it in plan.items}  # gathered experts the plan does not send are not kept
        missing = [it.source for it in plan.items if it.source not in local and it.source not in self.ep_sources]
        if missing:
            raise InvalidArgumentError(f"the plan names tensors the trainer does not have: {missing[:4]}")
        for it in plan.items:
            got = self._full_shape(it.source, self._local_of(it.source, local))
            if got != it.shape:
                raise InvalidArgumentError(f"{it.source}: the trainer's tensor is {got}, the plan says {it.shape}")
        self.device = torch.device(device) if device is not None else next(iter(local.values())).device
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:  # "cuda": the current device, named (open's thread sets it)
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.is_source = bool(each_rank_sends) or self.tp_rank == 0
        # one prepared fill per bucket: its FP8 launch table is rebuilt only when an address changes
        self._fills = [BucketFill(plan, b) for b in plan.buckets]
        self._open = None  # (version, Future of the begin's seconds) of an update opened ahead of its push
        self._pool = None  # the thread open(wait=False) begins on, made at its first use
        self._streaming = None  # the StreamedPush in progress (streamed)

    def _init_experts(self, ep_group, ep_sources, local: dict) -> None:
        """Check and index the expert-parallel sources (see the module policies)."""
        self.ep_group, self.ep_sources = ep_group, dict(ep_sources or {})
        self.ep_size, self._ep_local, self._ep_global = 1, set(), {}
        if not self.ep_sources:
            if ep_group is not None:
                raise InvalidArgumentError("ep_group needs ep_sources ({global name: (local name, EP rank)})")
            return
        if ep_group is None:
            raise InvalidArgumentError("ep_sources needs an ep_group")
        import torch.distributed as dist  # noqa: PLC0415

        self.ep_size = dist.get_world_size(ep_group)
        for g, src in self.ep_sources.items():
            if not (isinstance(src, tuple) and len(src) == 2 and isinstance(src[1], int)
                    and 0 <= src[1] < self.ep_size):
                raise InvalidArgumentError(f"ep_sources[{g!r}] must be (local name, EP rank < {self.ep_size}), "
                                           f"got {src!r}")
            if src[0] not in local:
                raise InvalidArgumentError(f"ep_sources[{g!r}] names {src[0]!r}, which the trainer does not have")
            if src in self._ep_global:
                raise InvalidArgumentError(f"ep_sources maps both {self._ep_global[src]!r} and {g!r} to {src}")
            self._ep_global[src] = g
        self._ep_local = {src[0] for src in self.ep_sources.values()}
        for n in sorted(self._ep_local):
            if any((n, r) not in self._ep_global for r in range(self.ep_size)):
                raise InvalidArgumentError(f"ep_sources gives {n!r} no global name for some EP rank (every rank's "
                                           "copy of a local expert is a global expert)")
        split = sorted(self._ep_local & set(self.tp_dims))
        if split:
            raise InvalidArgumentError(f"expert parameters split over a tensor-parallel group are not gathered: "
                                       f"{split[:4]}")

    def _local_of(self, name: str, local: Mapping) -> torch.Tensor:
        """The tensor this rank holds for plan source ``name`` (an expert's local copy for a global name)."""
        src = self.ep_sources.get(name)
        return local[src[0]] if src is not None else local[name]

    def _full_spec(self, name: str, t: torch.Tensor) -> tuple:
        """(full shape, dtype) of plan source ``name`` whose local tensor is ``t``."""
        if self._custom is not None:
            shape, dtype = self._custom.spec(name, t)
            return tuple(shape), dtype
        return self._full_shape(name, t), t.dtype

    def _full_shape(self, name: str, t: torch.Tensor) -> tuple:
        if self._custom is not None:
            return tuple(self._custom.spec(name, t)[0])
        shape = list(t.shape)
        if name in self.tp_dims:
            shape[self.tp_dims[name]] *= self.tp_size
        return tuple(shape)

    def _gather(self, bucket, tensors, experts: dict) -> tuple[dict, list]:
        """Full tensors of ``bucket``'s items (all-gathered over the TP group where sharded, experts over the EP
        group), and the gathered ones (new allocations). Without either: ``tensors`` itself (read by name when
        filling). ``experts`` holds gathered experts of later buckets between calls."""
        if self._custom is not None:
            try:
                return self._custom([it.source for it in bucket.items], tensors)
            except RuntimeError as e:  # torch's DistBackendError and Gloo's errors are RuntimeErrors
                raise PartialUpdateError(
                    f"the gather of bucket {bucket.index} ({bucket.items[0].source!r} and {len(bucket.items) - 1} "
                    f"more) failed (a rank of the group gone, or the group released?): {type(e).__name__}: "
                    f"{str(e).splitlines()[0][:200]}. Nothing was committed: the receiver keeps its previous "
                    "version") from e
        if self.ep_sources:
            self._gather_experts(bucket, tensors, experts)
        if (self.tp_size == 1 or not self.tp_dims) and not self.ep_sources:
            return tensors, []
        out, new = {}, []
        for it in bucket.items:
            if it.source in self.ep_sources:
                out[it.source] = experts.pop(it.source)
                continue
            t = tensors[it.source]  # read by raw address under no_grad: no detach (a per-tensor cost)
            d = self.tp_dims.get(it.source)
            if d is None:
                out[it.source] = t
                continue
            import torch.distributed as dist  # noqa: PLC0415

            t = t.contiguous()
            g = torch.empty((self.tp_size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
            try:
                dist.all_gather_into_tensor(g, t, group=self.tp_group)  # shards stacked along dim 0
            except RuntimeError as e:  # torch's DistBackendError and Gloo's errors are RuntimeErrors
                raise PartialUpdateError(
                    f"the tensor-parallel gather of {it.source!r} failed on TP rank {self.tp_rank} (a rank of the "
                    f"group gone, or the group released?): {type(e).__name__}: {str(e).splitlines()[0][:200]}. "
                    f"Nothing was committed: the receiver keeps its previous version") from e
            out[it.source] = torch.cat(g.chunk(self.tp_size, 0), dim=d) if d else g
            new.append(out[it.source])
        return out, new

    def _gather_experts(self, bucket, tensors, experts: dict) -> None:
        """All-gather, over the EP group, the local experts behind ``bucket``'s global names not gathered yet:
        one collective per dtype, every rank's pieces packed in one buffer; the results land in ``experts``
        under their global names."""
        import torch.distributed as dist  # noqa: PLC0415

        need: dict = {}  # dtype -> local names, in plan order (the same on every EP rank)
        seen = set()
        for it in bucket.items:
            src = self.ep_sources.get(it.source)
            if src is not None and it.source not in experts and src[0] not in seen:
                seen.add(src[0])
                need.setdefault(tensors[src[0]].dtype, []).append(src[0])
        for dtype, names in need.items():
            parts = [tensors[n].reshape(-1) for n in names]
            packed = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
            whole = torch.empty(self.ep_size * packed.numel(), dtype=dtype, device=packed.device)
            try:
                dist.all_gather_into_tensor(whole, packed, group=self.ep_group)  # rank r's pieces at r * numel
            except RuntimeError as e:
                raise PartialUpdateError(
                    f"the expert-parallel gather of {names[0]!r} and {len(names) - 1} more failed (a rank of the "
                    f"group gone, or the group released?): {type(e).__name__}: {str(e).splitlines()[0][:200]}. "
                    f"Nothing was committed: the receiver keeps its previous version") from e
            for r, piece in enumerate(whole.chunk(self.ep_size)):
                at = 0
                for n in names:
                    t, g = tensors[n], self._ep_global[(n, r)]
                    if g in self._planned:
                        experts[g] = piece[at:at + t.numel()].view(t.shape)
                    at += t.numel()

    def _begin(self, version: int) -> float:
        t0 = time.perf_counter()
        if self.is_source:
            self.transport.begin(version, self.plan, self.device)
        return time.perf_counter() - t0

    def _begin_on_thread(self, version: int) -> float:
        if self.cuda:
            torch.cuda.set_device(self.device)  # the pool's thread starts on device 0
        return self._begin(version)

    def open(self, version: int, *, wait: bool = True):
        """Begin update ``version`` on the transport ahead of :meth:`push` (see the module policies): now, or with
        ``wait=False`` on the sender's thread, returning a ``concurrent.futures.Future`` of the begin's seconds."""
        _check_version(version)
        if self._open is not None:
            raise StateError(f"update {self._open[0]} is already open: push it before opening another")
        if self._streaming is not None:
            raise StateError(f"streamed update {self._streaming.version} is in progress: finish or abort it first")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if wait:
            fut.set_result(self._begin(version))
        else:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ebbtide-sync-open")
            fut = self._pool.submit(self._begin_on_thread, version)
        self._open = (version, fut)
        return fut

    def streamed(self, version: int):
        """Begin update ``version`` and return a ``StreamedPush``: its ``ready(begin, end, event)`` fills each source
        as its producer finishes writing it, its ``finish()`` commits (``_stream.py`` has the policies). Refused
        (InvalidArgumentError) with tensor- or expert-parallel gathers, and for a transport that cannot take the
        buckets out of plan order (``streams(device)``)."""
        _check_version(version)
        if (self.tp_size > 1 and self.tp_dims) or self.ep_sources or self._custom is not None:
            raise InvalidArgumentError("a streamed push cannot gather: tensor- and expert-parallel gathers are "
                                       "collectives in plan order (use open + push)")
        if not self.is_source:
            raise InvalidArgumentError("a streamed push needs a sending rank (this TP rank does not send)")
        streams = getattr(self.transport, "streams", None)
        if streams is None or not streams(self.device):
            raise InvalidArgumentError(f"{type(self.transport).__name__} on {self.device} cannot take a streamed "
                                       f"push (its buckets must come in plan order): use open + push")
        fut = self.open(version, wait=False)
        self._open = None  # the stream owns the begin now
        self._streaming = StreamedPush(self, version, fut)
        return self._streaming

    @torch.no_grad()
    def push(self, version: int) -> PushReport:
        """Send every bucket of the current weights as ``version`` (an int that grows with every update)."""
        _check_version(version)
        if self._streaming is not None:
            raise StateError(f"streamed update {self._streaming.version} is in progress: its finish() commits it")
        if self._open is not None and self._open[0] != version:
            raise InvalidArgumentError(f"push({version}) while update {self._open[0]} is open: push that version")
        tensors = self._tensors()
        end = self.transport if self.is_source else None
        t0 = time.perf_counter()
        opened, self._open = self._open, None
        open_s = opened[1].result() if opened is not None else self._begin(version)  # an open's failure raises here
        t1 = time.perf_counter()
        ctx = torch.cuda.stream(self.stream) if self.cuda else _nullctx()
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the optimizer step is done
        experts: dict = {}  # gathered experts waiting for their bucket
        with ctx:
            for bucket in self.plan.buckets:
                buf = end.buffer(bucket, self.stream) if end is not None else None
                sources, gathered = self._gather(bucket, tensors, experts)
                if end is not None:
                    self._fills[bucket.index](sources, buf)
                    end.send(bucket, buf, self.stream)
                if self.cuda:  # gather buffers go back to the pool only after this stream's work on them
                    for g in gathered:
                        g.record_stream(self.stream)
                del sources, gathered
        t2 = time.perf_counter()
        if end is not None:
            end.commit(version)
        elif self.cuda:
            self.stream.synchronize()
        t3 = time.perf_counter()
        return PushReport(version=version, seconds=t3 - t0, buckets=len(self.plan.buckets),
                          wire_bytes=self.plan.nbytes, source_bytes=self.plan.source_bytes, begin_s=t1 - t0,
                          fill_s=t2 - t1, commit_s=t3 - t2, **({"open_s": open_s} if opened is not None else {}))

    def abort(self) -> None:
        """Give up an open update (its push will not come: the step failed or was skipped): wait for its begin,
        then close the transport, which ends the receiver's pending update without a commit (it keeps its
        version). Nothing open: nothing happens."""
        opened, self._open = self._open, None
        if opened is None:
            return
        opened[1].exception()  # the begin has finished (or failed) before the transport is touched again
        if self.is_source:
            self.transport.close()

    def close(self) -> None:
        if self._streaming is not None:
            self._streaming.abort()
        if self._pool is not None:
            self._pool.shutdown(wait=True)  # an open still running ends first
            self._pool = None
        self._open = None
        if self.is_source:
            self.transport.close()


def _check_version(version) -> None:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise InvalidArgumentError(f"version must be a non-negative int, got {version!r}")


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
