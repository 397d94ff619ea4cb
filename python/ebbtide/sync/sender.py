"""The trainer's end of a weight update: gather (TP), quantize and hand each bucket to a transport.

Policies:
- ``Sender(tensors, transport, plan=...)``: ``transport`` is the sending end of a transport (``HostSender``,
  ``IpcSender``, ``NcclSender``, or an SGLang one from ``ebbtide.sync.sglang``); ``tensors`` is a mapping name ->
  tensor or a callable returning one (read again at every push, so re-pointed ``.data`` is followed); any
  trainer's named parameters (plain torch, or names converted to the serving model's).
- Tensor parallel: with ``tp_group`` and ``tp_dims`` (name -> the dimension a parameter is split along), the
  plan is built on full shapes; every TP rank joins one all-gather per sharded tensor of a bucket, right before
  that bucket is quantized, and only TP rank 0 (``is_source``) quantizes and sends, unless ``each_rank_sends``:
  then every TP rank quantizes the gathered tensors and sends them through its own transport (one serving engine
  per GPU, each fed by the trainer rank on its GPU, as slime's colocated engines are). Gather buffers live for
  one bucket.
- Host work: each bucket's FP8 launch table is built at the first push and kept while the tensors and the
  transport's buffer stay where they are (``ebbtide.quant.prepared``), and its FP8 source names are listed once, so
  a push reads each tensor's address, strides, size and dtype and does no other per-tensor work in Python (an MoE
  layer's experts are thousands; without TP the caller's mapping is read as it is, not copied per bucket).
- Overlap: on CUDA the gathers and quantization of every bucket run on the sender's own stream, which first waits
  for the caller's current stream ("optimizer done"); the transport moves bucket k (copy, IPC hand-off or
  broadcast on its own stream) while bucket k+1 is quantized. A producer buffer is written again only after the
  transport says its previous content was consumed on the device (an event), never when a reply arrives.
- ``push(version)`` returns when the receiver holds the new version (the transport's commit), or raises; the
  receiver then still holds its previous version. A TP gather that raises (a peer rank died, seen by Gloo within
  its timeout) becomes PartialUpdateError before the commit; with NCCL a dead peer usually ends in torch's
  watchdog aborting the process after the group's timeout instead. Either way nothing is committed, and a
  receiver waiting for the rest of the update gives up at its own timeout or when the connection closes.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch

from ..errors import InvalidArgumentError
from ._fill import BucketFill
from .errors import PartialUpdateError
from .plan import Plan

__all__ = ["Sender", "PushReport"]


class PushReport(dict):
    """``{"version", "seconds", "buckets", "wire_bytes", "source_bytes"}`` of one push."""


class Sender:
    def __init__(self, tensors: Mapping | Callable[[], Mapping], transport, *, plan: Plan | None = None,
                 tp_group=None, tp_dims: Mapping[str, int] | None = None, each_rank_sends: bool = False, device=None,
                 **plan_options):
        self._tensors = tensors if callable(tensors) else (lambda: tensors)
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
        if plan is None:
            plan = Plan.build([(n, self._full_shape(n, t), t.dtype) for n, t in local.items()], **plan_options)
        elif plan_options:
            raise InvalidArgumentError(f"pass either a plan or plan options, not both: {sorted(plan_options)}")
        self.plan = plan
        missing = [it.source for it in plan.items if it.source not in local]
        if missing:
            raise InvalidArgumentError(f"the plan names tensors the trainer does not have: {missing[:4]}")
        for it in plan.items:
            got = self._full_shape(it.source, local[it.source])
            if got != it.shape:
                raise InvalidArgumentError(f"{it.source}: the trainer's tensor is {got}, the plan says {it.shape}")
        self.device = torch.device(device) if device is not None else next(iter(local.values())).device
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.is_source = bool(each_rank_sends) or self.tp_rank == 0
        # one prepared fill per bucket: its FP8 launch table is rebuilt only when an address changes
        self._fills = [BucketFill(plan, b) for b in plan.buckets]

    def _full_shape(self, name: str, t: torch.Tensor) -> tuple:
        shape = list(t.shape)
        if name in self.tp_dims:
            shape[self.tp_dims[name]] *= self.tp_size
        return tuple(shape)

    def _gather(self, bucket, tensors) -> tuple[dict, list]:
        """Full tensors of ``bucket``'s items (all-gathered over the TP group where sharded), and the gathered
        ones (new allocations). Without tensor parallelism: ``tensors`` itself (read by name when filling)."""
        if self.tp_size == 1 or not self.tp_dims:
            return tensors, []
        out, new = {}, []
        for it in bucket.items:
            t = tensors[it.source]  # read by raw address under no_grad: no detach (1-3 us per tensor)
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

    @torch.no_grad()
    def push(self, version: int) -> PushReport:
        """Send every bucket of the current weights as ``version`` (an int that grows with every update)."""
        if not isinstance(version, int) or version < 0:
            raise InvalidArgumentError(f"version must be a non-negative int, got {version!r}")
        t0 = time.perf_counter()
        tensors = self._tensors()
        end = self.transport if self.is_source else None
        if end is not None:
            end.begin(version, self.plan, self.device)
        ctx = torch.cuda.stream(self.stream) if self.cuda else _nullctx()
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the optimizer step is done
        with ctx:
            for bucket in self.plan.buckets:
                buf = end.buffer(bucket, self.stream) if end is not None else None
                sources, gathered = self._gather(bucket, tensors)
                if end is not None:
                    self._fills[bucket.index](sources, buf)
                    end.send(bucket, buf, self.stream)
                if self.cuda:  # gather buffers go back to the pool only after this stream's work on them
                    for g in gathered:
                        g.record_stream(self.stream)
                del sources, gathered
        if end is not None:
            end.commit(version)
        elif self.cuda:
            self.stream.synchronize()
        return PushReport(version=version, seconds=time.perf_counter() - t0, buckets=len(self.plan.buckets),
                          wire_bytes=self.plan.nbytes, source_bytes=self.plan.source_bytes)

    def close(self) -> None:
        if self.is_source:
            self.transport.close()


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
