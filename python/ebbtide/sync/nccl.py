"""NCCL transport: one broadcast per bucket from the sender's rank over a process group (another GPU or node).

Policies:
- The group is any ``torch.distributed`` process group; make it while ``ebbtide.comm`` is installed and its
  communicator is released and reloaded with the others between updates. ``src`` is the sender's global rank.
- Per bucket the broadcast runs on the sender's communication stream after the bucket's quantization (an event),
  so bucket k+1 is quantized while bucket k is on the wire; a producer buffer is written again only after its
  broadcast completed on the device (an event recorded after it).
- With ``header=True`` (ebbtide receivers) a small header (version, bucket count, plan signature) is broadcast
  first and every rank reports with an all-reduce whether it accepts the update; a refusal raises on every rank
  before any bucket moves, and a last all-reduce after the receivers applied it makes ``commit`` return only once
  every receiver holds the version. Receivers broadcast straight into their staging (no extra copy).
- With ``header=False`` the wire carries only the buckets, exactly as SGLang's ``update_weights_from_distributed``
  with ``load_format="flattened_bucket"`` receives them; ``announce(bucket, version)`` is called before each
  broadcast (post the request there; it may return a future, waited for before ``commit`` returns).
"""
from __future__ import annotations

import torch

from ..errors import InvalidArgumentError
from .errors import PlanMismatchError, WeightVersionError

__all__ = ["NcclSender", "NcclReceiver"]

_MAGIC = 0x45425453594E4332


def _header(version: int, plan, device) -> torch.Tensor:
    import numpy as np  # noqa: PLC0415

    sig = np.frombuffer(bytes.fromhex(plan.signature)[:32], dtype=np.int64).tolist()
    return torch.tensor([_MAGIC, version, len(plan.buckets), plan.nbytes, *sig], dtype=torch.int64, device=device)


def _agree(ok: bool, group, device) -> bool:
    import torch.distributed as dist  # noqa: PLC0415

    t = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


class NcclSender:
    def __init__(self, group, *, src: int = 0, slots: int = 2, header: bool = True, announce=None):
        if slots < 1:
            raise InvalidArgumentError(f"slots must be >= 1, got {slots}")
        self.group, self.src, self.nslots, self.header, self.announce = group, src, slots, header, announce
        self._bufs, self._sent, self._futures = [], [], []

    def begin(self, version, plan, device) -> None:
        import torch.distributed as dist  # noqa: PLC0415

        device = torch.device(device)
        if device.type != "cuda":
            raise InvalidArgumentError("the NCCL transport needs tensors on a CUDA device")
        self.plan, self.version, self._futures = plan, version, []
        if not self._bufs or self._bufs[0].numel() < plan.max_bucket_bytes or self._bufs[0].device != device:
            self._bufs = [torch.empty(plan.max_bucket_bytes, dtype=torch.uint8, device=device)
                          for _ in range(self.nslots)]
            self._sent = [torch.cuda.Event() for _ in range(self.nslots)]
            self._comm = torch.cuda.Stream(device)
        if self.header:
            dist.broadcast(_header(version, plan, device), src=self.src, group=self.group)
            if not _agree(True, self.group, device):
                raise PlanMismatchError("a receiver refused the update (another plan, or a version that is not "
                                        "newer than its own); its error says which")

    def buffer(self, bucket, stream):
        slot = bucket.index % self.nslots
        stream.wait_event(self._sent[slot])  # its previous broadcast completed
        return self._bufs[slot]

    def send(self, bucket, buf, stream) -> None:
        import torch.distributed as dist  # noqa: PLC0415

        self._comm.wait_stream(stream)
        if self.announce is not None:
            f = self.announce(bucket, self.version)
            if f is not None:
                self._futures.append(f)
        with torch.cuda.stream(self._comm):
            dist.broadcast(buf[:bucket.nbytes], src=self.src, group=self.group)
        self._sent[bucket.index % self.nslots].record(self._comm)

    def commit(self, version) -> None:
        self._comm.synchronize()
        for f in self._futures:
            f.result()
        self._futures = []
        if self.header and not _agree(True, self.group, self._bufs[0].device):
            raise WeightVersionError(f"a receiver failed to apply version {version}")

    def close(self) -> None:
        self._bufs, self._sent = [], []


class NcclReceiver:
    def __init__(self, group, *, src: int = 0):
        self.group, self.src = group, src

    def receive(self, receiver, version: int | None = None) -> int:
        import torch.distributed as dist  # noqa: PLC0415

        plan, dev = receiver.plan, receiver.device
        hdr = torch.empty(8, dtype=torch.int64, device=dev)
        dist.broadcast(hdr, src=self.src, group=self.group)
        got = hdr.tolist()
        err = None
        if got[0] != _MAGIC or got != _header(got[1], plan, "cpu").tolist():
            err = PlanMismatchError("the sender's plan differs from the receiver's (names, shapes, dtypes, kinds or "
                                    "bucketing)")
        else:
            try:
                receiver.check_next(got[1], version)
            except WeightVersionError as e:
                err = e
        if not _agree(err is None, self.group, dev):
            raise err or PlanMismatchError("another rank refused the update")
        v = got[1]
        with torch.cuda.stream(receiver.stream):
            for b in plan.buckets:
                dist.broadcast(receiver.region(b), src=self.src, group=self.group)
        receiver.prepare(v)  # while the broadcasts run
        receiver.apply(v)
        _agree(True, self.group, dev)
        return v
