"""The rollout's end of a weight update: stage every bucket, then load the whole version into the live parameters
in place.

Policies:
- Nothing touches a parameter until every bucket of one version is staged: a transport copies each bucket into
  ``staging`` (one device buffer of ``plan.nbytes``, the quantized size of the model) and calls :meth:`apply`
  only after the last one. A missing bucket, a bucket of another version or a sender that went away raises and
  leaves the parameters at ``version`` (the last complete one).
- Versions only grow: an update whose version is not above the current one raises ``WeightVersionError``.
  ``require(v)`` lets the rollout check, before it generates, that it holds exactly version ``v``.
- At construction the plan is checked against the parameters: a name the rollout does not have, a shape or a
  dtype that differs raises ``PlanMismatchError`` naming the first ones. ``form="dequant"`` (a bf16 rollout):
  parameters are named as the trainer's with its dtypes, FP8 and INT4 weights are dequantized into them (what
  ``expected`` gives, bit for bit), raw tensors copied. ``form="served"`` (a rollout that serves the quantized
  weights): parameters are named as the plan's outputs (``weight``, ``weight_scale_inv``, ...) with their dtypes
  and shapes, and every output is copied.
- On CUDA every copy and dequant runs on the receiver's stream; :meth:`apply` returns after it completed. That
  stream is the caller's current stream at each call, so a receive is ordered after the caller's queued work,
  unless ``stream=`` names one (Note [One compute stream in a rollout]). The served form's copies are byte views
  built once (rebuilt if a parameter's storage moves; checking costs one address read per output): outputs of
  32 MiB and more get one copy each, the smaller ones (scales, norms, experts of an MoE layer: thousands) go in one
  ``ebbtide.quant.SegmentCopy`` launch, so an update's host time hardly grows with its tensor count. The dequant
  form's launches are prepared the same way (``_DequantLaunches``: one native dequant per FP8 weight at kept
  addresses, the raw tensors copied as the served outputs are); INT4 weights, non-contiguous or tied parameters take
  ``load_bucket`` instead.
- ``prepare(version)`` runs that address check ahead: the transports call it while the sender is still filling
  (IPC: when the update begins; host and NCCL: while the bytes travel), and ``apply(version)`` right after only
  launches. The check is then as old as the update: a parameter that another thread re-points between the two is
  not seen (it would race with the copies anyway). An apply of another version, or a second apply, checks itself.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import InvalidArgumentError
from ..quant.prepared import SegmentCopy
from ._fill import load_bucket
from .errors import PlanMismatchError, WeightVersionError
from .plan import Plan, _dtype

__all__ = ["Receiver"]

# Note [One compute stream in a rollout]
# A process that has launched kernels on a second stream (200 small ones do, one does not; copies do not) decodes
# slower afterwards (a cost per kernel boundary, so a decode of many small kernels pays it most), until the GPU
# switches to another context and back. A colocated
# rollout's GPU is switched to the trainer's context before every update and the rollout generates right after
# loading it, so a private stream here taxed every generation while the anchors' loads (plain copies on the
# caller's stream) did not; apply() is synchronous and gains nothing from one. So the receiver runs on the caller's
# stream; ``stream=`` pins one for a caller that overlaps a receive with its own work. Measurements: docs/results.md.

_BIG_COPY = 32 << 20  # outputs this large get their own copy (a memcpy at full bandwidth); smaller ones are batched


class Receiver:
    def __init__(self, params, plan: Plan, *, staging: torch.Tensor | None = None, device=None,
                 form: str = "dequant", stream: torch.cuda.Stream | None = None):
        if isinstance(params, torch.nn.Module):
            params = dict(params.named_parameters())
        if not isinstance(params, Mapping):
            raise InvalidArgumentError("params must be a module or a mapping name -> tensor")
        if form not in ("dequant", "served"):
            raise InvalidArgumentError(f"form must be 'dequant' or 'served', got {form!r}")
        self.params, self.plan, self.served = dict(params), plan, form == "served"
        bad = []
        for o in (o for it in plan.items for o in it.outputs) if self.served else ():
            p = self.params.get(o.name)
            if p is None or tuple(p.shape) != o.shape or p.dtype != _dtype(o.dtype):
                got = "missing" if p is None else f"{p.dtype} {tuple(p.shape)}"
                bad.append(f"{o.name}: receiver {got}, sender {o.dtype} {o.shape}")
        for it in () if self.served else plan.items:
            p = self.params.get(it.source)
            if p is None:
                bad.append(f"{it.source}: not a parameter of the receiver")
            elif tuple(p.shape) != it.shape:
                bad.append(f"{it.source}: receiver shape {tuple(p.shape)}, sender {it.shape}")
            elif p.dtype != _dtype(it.dtype):  # FP8 / INT4 too: dequantized to the trainer's dtype, bit for bit
                bad.append(f"{it.source}: receiver dtype {p.dtype}, sender {it.dtype}")
        if bad:
            raise PlanMismatchError(f"{len(bad)} tensor(s) of the plan do not fit the receiver: " + "; ".join(bad[:4]))
        self.device = torch.device(device) if device is not None else next(iter(self.params.values())).device
        if staging is None:
            staging = torch.empty(max(plan.nbytes, 1), dtype=torch.uint8, device=self.device)
        if staging.dtype != torch.uint8 or staging.numel() < plan.nbytes or staging.device != self.device:
            raise InvalidArgumentError(f"staging must be uint8 with at least {plan.nbytes} bytes on {self.device}")
        self.staging = staging
        self.offsets = plan.bucket_offsets()
        self.cuda = self.device.type == "cuda"
        if stream is not None and (not self.cuda or not isinstance(stream, torch.cuda.Stream)
                                   or stream.device != self.device):
            raise InvalidArgumentError(f"stream must be a torch.cuda.Stream on {self.device}, got {stream!r}")
        self._stream = stream
        self.version: int | None = None  # the last complete version the parameters hold
        self._copies = None  # (parameter addresses, cached copies) of the served form
        self._prepared = None  # (version, served copies) checked by prepare(version) for that apply, else None
        # the served form's destination of every output, in bucket order (the addresses checked per apply)
        self._outs = [self.params[o.name] for b in plan.buckets for o in b.outputs] if self.served else []
        self._srcs = [] if self.served else [self.params[it.source] for it in plan.items]  # the dequant form's
        self._dq = None  # (staging and parameter addresses, _DequantLaunches or None) of the dequant form

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The stream the receive runs on: the one given at construction, else the caller's current stream on the
        receiver's device (None on the CPU)."""
        if not self.cuda:
            return None
        return self._stream if self._stream is not None else torch.cuda.current_stream(self.device)

    def region(self, bucket) -> torch.Tensor:
        """Where bucket ``bucket`` (a BucketPlan or its index) is staged."""
        b = self.plan.buckets[bucket if isinstance(bucket, int) else bucket.index]
        o = self.offsets[b.index]
        return self.staging[o:o + b.nbytes]

    def check_next(self, version: int, expected: int | None = None) -> None:
        """Raise ``WeightVersionError`` unless ``version`` may be applied next (above the current one and equal to
        ``expected`` when given)."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise WeightVersionError(f"version must be a non-negative int (the sender's), got {version!r}")
        if expected is not None and version != expected:
            raise WeightVersionError(f"the update carries version {version}, the rollout expected {expected}")
        if self.version is not None and version <= self.version:
            raise WeightVersionError(f"version {version} is not newer than the held version {self.version}")

    def _served_copies(self) -> tuple:
        """(big (destination, source) byte views, one SegmentCopy of the small ones or None) of every output, built
        once and rebuilt only when a parameter's storage moved; ``None`` when a parameter is not contiguous, not on
        the staging's device or shares storage with another (then ``load_bucket`` copies)."""
        ptrs = list(map(torch.Tensor.data_ptr, self._outs))
        if self._copies is not None and self._copies[0] == ptrs:
            return self._copies[1]
        pairs = []
        for b in self.plan.buckets:
            region = self.region(b)
            for o in b.outputs:
                p = self.params[o.name]
                if not p.is_contiguous() or p.device != region.device:
                    self._copies = (ptrs, None)
                    return None
                pairs.append((p.detach().reshape(-1).view(torch.uint8), region[o.offset:o.offset + o.nbytes]))
        self._copies = (ptrs, _byte_copies(pairs))
        return self._copies[1]

    def _dequant_launches(self):
        """The dequant form's launches on CUDA (``_DequantLaunches``), built once and rebuilt only when a parameter
        or the staging moved; None where they cannot serve (then ``load_bucket`` runs)."""
        if not self.cuda:
            return None
        ptrs = [self.staging.data_ptr(), *map(torch.Tensor.data_ptr, self._srcs)]
        if self._dq is None or self._dq[0] != ptrs:
            self._dq = (ptrs, _DequantLaunches.build(self))
        return self._dq[1]

    def prepare(self, version: int) -> None:
        """Check the destinations now, for ``apply(version)`` (see the module policies)."""
        self._prepared = (version, self._served_copies() if self.served else self._dequant_launches())

    def _load_all(self, prepared=None) -> None:
        if not self.served:
            launches = prepared[1] if prepared is not None else self._dequant_launches()
            if launches is not None:
                launches(self.device)
                return
        copies = None
        if self.served:
            copies = prepared[1] if prepared is not None else self._served_copies()
        if copies is None:
            for b in self.plan.buckets:
                load_bucket(b, self.region(b), self.params, served=self.served)
            return
        _run_copies(copies)

    @torch.no_grad()
    def apply(self, version: int) -> None:
        """Load every staged bucket into the parameters (the whole version at once) and hold ``version``."""
        prepared, self._prepared = self._prepared, None  # a prepare serves one apply, of its version
        if prepared is not None and prepared[0] != version:
            prepared = None
        self.check_next(version)
        if self.cuda:
            stream = self.stream
            with torch.cuda.stream(stream):
                self._load_all(prepared)
            stream.synchronize()
        else:
            self._load_all(prepared)
        self.version = version

    def require(self, version: int) -> None:
        """Raise ``WeightVersionError`` unless the parameters hold exactly ``version``."""
        if self.version != version:
            raise WeightVersionError(f"the rollout holds version {self.version}, version {version} was required")


class _DequantLaunches:
    """The dequant form's apply prepared once (CUDA): one native FP8 block dequant per FP8 weight straight into its
    parameter, addresses kept (no views, no per-call checks: through the checked API the host time of a GPT's hundreds
    of launches exceeded their device time), and the raw tensors copied as the served form's outputs are
    (``_byte_copies``). The same kernel and arguments as ``load_bucket``'s, so the same bits."""

    def __init__(self, fp8: list, raw):
        self.fp8, self.raw = fp8, raw

    @classmethod
    def build(cls, rx: "Receiver") -> "_DequantLaunches | None":
        """None where a parameter is not contiguous on the staging's device, an FP8 one is not bf16, a weight is
        INT4, or raw parameters share storage: ``load_bucket`` handles those."""
        fp8, pairs = [], []
        for b in rx.plan.buckets:
            region = rx.region(b)
            base = region.data_ptr()
            for it in b.items:
                p = rx.params[it.source]
                if it.kind == "int4" or not p.is_contiguous() or p.device != region.device:
                    return None
                if it.kind == "fp8":
                    if p.dtype != torch.bfloat16:
                        return None
                    *lead, N, K = it.shape
                    fp8.append((base + it.outputs[0].offset, base + it.outputs[1].offset, lead[0] if lead else 1,
                                N, K, p.data_ptr()))
                else:
                    o = it.outputs[0]
                    pairs.append((p.detach().reshape(-1).view(torch.uint8), region[o.offset:o.offset + o.nbytes]))
        raw = _byte_copies(pairs)
        return None if raw is None else cls(fp8, raw)

    def __call__(self, device) -> None:
        from ..quant._cuda import fp8_block_dequant_at  # noqa: PLC0415

        if self.fp8:
            with torch.cuda.device(device):
                fp8_block_dequant_at(self.fp8, device)
        _run_copies(self.raw)


def _byte_copies(pairs) -> tuple | None:
    """(the big (destination, source) byte views, one ``SegmentCopy`` of the small ones or None) for ``pairs``;
    None where destinations share storage (tied names: SegmentCopy refuses overlaps; one copy each, in order)."""
    big = [(d, s) for d, s in pairs if s.numel() >= _BIG_COPY]
    small = [(d, s) for d, s in pairs if s.numel() < _BIG_COPY]
    if not small:
        return big, None
    try:
        return big, SegmentCopy([d for d, _ in small], [s for _, s in small])
    except InvalidArgumentError:
        return None


def _run_copies(copies: tuple) -> None:
    big, small = copies
    for d, s in big:
        d.copy_(s)
    if small is not None:  # many small tensors (scales, norms, experts): one launch
        small()
