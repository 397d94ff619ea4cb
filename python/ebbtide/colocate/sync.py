"""Weight sync of the colocation example: the trainer packs its weights into one shared pinned host buffer, the
rollout loads them (``ebbtide.sync``'s host transport), with the same plan on both sides.

Policies:
- The plan is ``ebbtide.sync.Plan`` of the model's parameters with nothing ignored: every 2-D weight is sent as
  FP8 128x128 block (``weight`` + ``weight_scale_inv``), every 1-D parameter as raw bf16. Both processes build it
  from their own model, and the buffer's header carries its signature, so nothing but bytes crosses the buffer.
- Two codecs over the same buffer layout: "ebbtide" (``ebbtide.sync``: one FP8 launch per bucket, bucket k copied
  down while k+1 is quantized; the rollout stages the update with one host-to-device copy and applies it whole,
  checking the version) and "torch" (the anchor: the DeepGEMM / slime torch formula per tensor, plain per-tensor
  copies, no version check). Each side's reference for the correctness check is ``dequant(quant(w))`` of its codec.
- The buffer is a memfd shared mapping that both processes register with ``cudaHostRegister`` (created by the
  trainer, inherited by the rollout), so both copies are DMA at PCIe speed.
"""
from __future__ import annotations

import torch

from ..errors import InvalidArgumentError
from ..sync import HostReceiver, HostSender, Plan, Receiver, Sender, SharedHostBuffer, expected
from ..sync.transport import HEADER_BYTES

__all__ = ["sync_plan", "TrainerSync", "RolloutSync", "SharedHostBuffer", "CODECS", "torch_block_quant",
           "torch_block_dequant"]

CODECS = ("ebbtide", "torch")


def sync_plan(model) -> Plan:
    """The example's plan: all 2-D weights FP8 block, 1-D parameters raw, one bucket per 256 MiB of output."""
    return Plan.of(model.named_parameters(), ignore=(), bucket_bytes=256 << 20)


def _check_codec(codec: str) -> None:
    if codec not in CODECS:
        raise InvalidArgumentError(f"codec must be one of {CODECS}, got {codec!r}")


# ---- the torch formula (the anchor codec) ---------------------------------------------------------------------
def torch_block_quant(x: torch.Tensor, eps: float = 1e-4):
    """DeepGEMM's per_block_cast_to_fp8 for [N, K] with N, K multiples of 128 (what slime's weight sync runs)."""
    n, k = x.shape
    xv = x.view(n // 128, 128, k // 128, 128)
    amax = xv.abs().float().amax(dim=(1, 3), keepdim=True).clamp(eps)
    sf = amax / 448.0
    q = (xv * (1.0 / sf)).to(torch.float8_e4m3fn).view(n, k)
    return q, sf.view(n // 128, k // 128)


def torch_block_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.bfloat16)


def _regions(plan: Plan, data: torch.Tensor):
    """(item, output views) of every tensor in ``data`` (the whole update, laid out as the plan's buckets)."""
    for b, o in zip(plan.buckets, plan.bucket_offsets()):
        region = data[o:o + b.nbytes]
        for it in b.items:
            yield it, [out.view(region) for out in it.outputs]


# ---- trainer side --------------------------------------------------------------------------------------------
class TrainerSync:
    """The trainer's end: owns the shared buffer (``fd``, ``nbytes`` go to the rollout)."""

    def __init__(self, model, codec: str, *, pin: bool):
        _check_codec(codec)
        self.model, self.codec = model, codec
        self.plan = sync_plan(model)
        self.buffer = SharedHostBuffer.create(SharedHostBuffer.size_for(self.plan), pin=pin)
        self.fd, self.nbytes = self.buffer.fd, self.buffer.nbytes
        self.sender = Sender(lambda: dict(model.named_parameters()), HostSender(self.buffer, keep_slots=False),
                             plan=self.plan) \
            if codec == "ebbtide" else None

    @torch.no_grad()
    def pack(self, version: int) -> int:
        """Quantize the weights into the buffer as ``version``; complete when it returns. Returns bytes written."""
        if self.sender is not None:
            self.sender.push(version)
            return self.plan.nbytes
        data = self.buffer.tensor[HEADER_BYTES:HEADER_BYTES + self.plan.nbytes]
        named = dict(self.model.named_parameters())
        for it, views in _regions(self.plan, data):  # per tensor, plain (synchronous) copies
            w = named[it.source].detach()
            if it.kind == "fp8":
                q, s = torch_block_quant(w)
                views[0].view(torch.uint8).copy_(q.view(torch.uint8))
                views[1].copy_(s)
            else:
                views[0].copy_(w)
        return self.plan.nbytes

    @torch.no_grad()
    def reference(self) -> dict:
        """{name: dequant(quant(w))} for 2-D weights and the bf16 value for 1-D params, on the model's device: what
        the rollout must hold after a load."""
        named = {n: p.detach() for n, p in self.model.named_parameters()}
        if self.codec == "ebbtide":
            return expected(self.plan, named)
        return {it.source: torch_block_dequant(*torch_block_quant(named[it.source])) if it.kind == "fp8"
                else named[it.source].clone() for it in self.plan.items}

    def close(self) -> None:
        self.buffer.close()


# ---- rollout side --------------------------------------------------------------------------------------------
class RolloutSync:
    """The rollout's end over the buffer the trainer created (``fd``, ``nbytes`` inherited). ``staging`` is the
    device buffer the update is copied into before it is applied (``plan.nbytes``; allocated here if None)."""

    def __init__(self, model, codec: str, fd: int, nbytes: int, *, pin: bool, staging: torch.Tensor | None = None):
        _check_codec(codec)
        self.model, self.codec = model, codec
        self.plan = sync_plan(model)
        self.buffer = SharedHostBuffer(fd, nbytes, pin=pin)
        self.receiver = Receiver(model, self.plan, staging=staging)
        self.host = HostReceiver(self.buffer)

    @staticmethod
    def staging_bytes(model) -> int:
        return sync_plan(model).nbytes

    @torch.no_grad()
    def load(self, version: int) -> int:
        """Load ``version`` from the buffer into the model's parameters. Returns bytes moved host -> device."""
        if self.codec == "ebbtide":
            self.host.receive(self.receiver, version)
            return self.plan.nbytes
        staging = self.receiver.staging[:self.plan.nbytes]
        staging.copy_(self.buffer.tensor[HEADER_BYTES:HEADER_BYTES + self.plan.nbytes], non_blocking=True)
        named = dict(self.model.named_parameters())
        for it, views in _regions(self.plan, staging):
            named[it.source].copy_(torch_block_dequant(*views) if it.kind == "fp8" else views[0])
        return self.plan.nbytes

    def close(self) -> None:
        self.buffer.close()
