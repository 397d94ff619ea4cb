"""ebbtide's weight loader inside SGLang: ``--custom-weight-loader ebbtide.integrations.sglang.load_weights`` on the
server and ``SGLangTensorSender(form="ebbtide")`` on the trainer.

SGLang (0.5.23) calls ``load_weights(model, named_tensors)`` in its scheduler process for every
``update_weights_from_tensor`` request whose ``load_format`` names this function, with the tensors already rebuilt
from their CUDA IPC handles on the engine's device. The ebbtide form sends one tensor per request: the bucket
(uint8, ebbtide's gapless layout) under a name that carries, as JSON after ``__ebbtide__``, the plan signature, the
version, the bucket's index and count, and every output's name, dtype, shape and byte range.

What holds:
- Record. The first time a bucket layout arrives (or when the model's parameters moved), SGLang's own
  ``model.load_weights`` places it, one output at a time, while a ``TorchDispatchMode`` observes every write into
  the model's parameters. A write that is a ``copy_`` from a same-dtype, same-shape view of that output's bytes is
  recorded as byte segments (destination: parameter or buffer storage + offset; source: offset in the bucket),
  decomposed into contiguous runs (a TP shard along an inner dimension becomes one run per row). An output whose
  loader does anything else to the model's tensors (casts, an intermediate tensor, a fill, an in-place op), writes
  nothing the dispatcher sees (a loader that combines outputs within one call, e.g. DeepSeek's fused q_a/kv_a
  projection, or a Triton kernel), or would make runs shorter than 8 elements on average (a transposed copy) is
  kept for SGLang's loader: those outputs go to ``model.load_weights`` together, in one call, at the record and at
  every update (the docs list what that means per model). Writes the dispatcher cannot see are not detected when
  the same output also makes an observed placement.
- Replay. Later updates of the same layout run the record: on CUDA one ``SegmentCopy`` launch per bucket (the
  table's sources rebased on the new bucket's address; the table uploaded once and launched again while buckets
  arrive at the same address on the same stream), on the CPU one copy per segment. The record is checked against
  the bucket's layout and the parameters' storage addresses first; a mismatch records again. The model's
  parameters are walked on the first bucket of each version and again after any call into SGLang's loader (a record,
  or the outputs it keeps), the only code here that could replace a parameter between two buckets.
- Versions. Buckets of one version arrive in order; the loader holds the highest version it completed. A bucket of
  a version older than the one held or in progress, or one applied already, is refused and nothing changes.
- Errors. SGLang 0.5.23 ignores the loader's return value and turns an exception into a scheduler crash, so a
  refusal (stale version, a layout that does not match, a different plan signature within one version) is logged
  at ERROR and kept in ``state(model).last_error`` -- never raised. Requests without the ebbtide form go to
  ``model.load_weights`` unchanged, so the loader is safe to name for every update.
"""
from __future__ import annotations

import functools
import json
import math
import logging
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

log = logging.getLogger("ebbtide.integrations.sglang")

__all__ = ["LOADER", "PREFIX", "encode", "decode", "load_weights", "state", "LoaderState"]

LOADER = "ebbtide.integrations.sglang.load_weights"  # the import path SGLang's --custom-weight-loader names
PREFIX = "__ebbtide__"
_ATTR = "_ebbtide_sglang_loader"
_OUTPUTS_KEY = ',"outputs":'  # "outputs" is the name's last key: a cached layout is the text after it


def encode(meta: dict, outputs_json: str | None = None) -> str:
    """The request's tensor name for ``meta`` (see the module doc). ``outputs_json``: the outputs already encoded
    (a sender encodes each bucket's layout once), appended last as ``"outputs"``; ``meta`` then has no outputs."""
    if outputs_json is None:
        return PREFIX + json.dumps(meta, separators=(",", ":"))
    return PREFIX + json.dumps(meta, separators=(",", ":"))[:-1] + _OUTPUTS_KEY + outputs_json + "}"


def decode(name: str) -> dict | None:
    """``meta`` of an ebbtide-form tensor name, or None for any other name."""
    if not isinstance(name, str) or not name.startswith(PREFIX):
        return None
    return json.loads(name[len(PREFIX):])



@functools.lru_cache(maxsize=512)
def _layout(outputs_json: str) -> tuple:
    """A bucket's outputs as (name, dtype, shape, start, end) tuples, parsed and checked once per layout (the sender
    repeats the same layout every update; an MoE bucket lists hundreds of outputs). ValueError where an output's
    dtype, shape and byte range disagree."""
    layout = tuple((o[0], o[1], tuple(o[2]), int(o[3]), int(o[4])) for o in json.loads(outputs_json))
    for name, dtype, shape, lo, hi in layout:
        dt = getattr(torch, dtype, None) if isinstance(dtype, str) else None
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"output {name!r}: {dtype!r} is not a torch dtype")
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"output {name!r}: bad shape {shape!r}")
        if not 0 <= lo <= hi or math.prod(shape) * dt.itemsize != hi - lo:
            raise ValueError(f"output {name!r}: bytes [{lo}, {hi}) do not hold a {dtype} tensor of shape {shape}")
    return layout


def _parse(name: str) -> tuple[dict, tuple]:
    """(meta without "outputs", layout) of an ebbtide-form name; ValueError/KeyError/TypeError if unreadable or if
    an output's dtype, shape and byte range do not agree."""
    body = name[len(PREFIX):]
    i = body.find(_OUTPUTS_KEY)
    if i > 0 and body.endswith("}"):  # "outputs" last, as encode writes it
        try:
            return json.loads(body[:i] + "}"), _layout(body[i + len(_OUTPUTS_KEY):-1])
        except ValueError:
            pass  # another key order, or a bad layout: the full parse below decides
    meta = json.loads(body)
    return meta, _layout(json.dumps(meta["outputs"], separators=(",", ":")))


@dataclass
class _Record:
    layout: tuple  # the bucket's (name, dtype, shape, start, end) outputs
    ptrs: tuple  # the parameters' storage addresses when recorded
    dst: list  # per segment: (param index, byte offset in its storage)
    src: torch.Tensor  # int64 [n]: byte offset in the bucket
    nbytes: torch.Tensor  # int64 [n]
    fallback: list  # output names SGLang's loader places at every update
    table: torch.Tensor | None = None  # CUDA: the segment table's fixed columns (dst, -, bytes, first chunk)
    # CUDA: (bucket address, stream, pinned table, device table) of the last replay, launched again as they are
    # while the bucket arrives at the same address (the sender reuses its buffers) on the same stream
    launch: tuple | None = None


@dataclass
class LoaderState:
    """What the loader keeps on the model: records per layout, the version it holds, the last refusal."""

    records: dict = field(default_factory=dict)
    held: int = -1  # the highest version completed (every bucket applied)
    current: int | None = None  # the version in progress
    done: set = field(default_factory=set)  # its buckets applied so far
    signature: str | None = None
    last_error: str = ""
    recorded: int = 0  # how many layouts were recorded (re-recorded after the parameters moved included)
    replayed: int = 0
    # the model's parameters and buffers and their storage addresses, walked once per version (the first bucket
    # of each; again after a record): (version, tensors, addresses)
    walked: tuple | None = None


def state(model) -> LoaderState:
    st = getattr(model, _ATTR, None)
    if st is None:
        st = LoaderState()
        setattr(model, _ATTR, st)
    return st


class _Observer(TorchDispatchMode):
    """Records the copies into parameter storages made while one output is loaded."""

    def __init__(self, storages: dict, bucket: torch.Tensor, lo: int, hi: int):
        super().__init__()
        self.storages, self.bucket_ptr, self.lo, self.hi = storages, bucket.untyped_storage().data_ptr(), lo, hi
        self.copies, self.bad = [], ""

    def _param(self, t):
        return self.storages.get(t.untyped_storage().data_ptr()) if isinstance(t, torch.Tensor) else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            pi = self._param(dst)
            if pi is not None:
                ok = (isinstance(src, torch.Tensor) and src.untyped_storage().data_ptr() == self.bucket_ptr
                      and src.dtype == dst.dtype and tuple(src.shape) == tuple(dst.shape))
                if ok:
                    s0 = src.storage_offset() * src.element_size()
                    ok = self.lo <= s0 < self.hi
                if ok:
                    self.copies.append((pi, dst, src))
                else:
                    self.bad = self.bad or f"a copy into parameter {pi} that is not a placement of the output's bytes"
        elif getattr(func, "_schema", None) is not None and func._schema.is_mutable:
            for a, v in zip(func._schema.arguments, list(args) + [kwargs.get(a.name) for a in
                                                               func._schema.arguments[len(args):]]):
                if a.alias_info is not None and a.alias_info.is_write and self._param(v) is not None:
                    self.bad = self.bad or f"{func} writes a parameter"
        return func(*args, **kwargs)


def _runs(dst: torch.Tensor, src: torch.Tensor):
    """Contiguous byte runs of ``dst.copy_(src)`` (same dtype and shape): (dst byte offsets in dst's storage,
    src byte offsets in src's storage, run length in bytes)."""
    es = dst.element_size()
    shape, ds, ss = list(dst.shape), list(dst.stride()), list(src.stride())
    inner, k = 1, len(shape)
    while k > 0 and (shape[k - 1] == 1 or (ds[k - 1] == inner and ss[k - 1] == inner)):
        inner *= shape[k - 1]
        k -= 1
    d = torch.tensor([dst.storage_offset()], dtype=torch.int64)
    s = torch.tensor([src.storage_offset()], dtype=torch.int64)
    for n, a, b in zip(shape[:k], ds[:k], ss[:k]):
        i = torch.arange(n, dtype=torch.int64)
        d = (d[:, None] + i[None, :] * a).reshape(-1)
        s = (s[:, None] + i[None, :] * b).reshape(-1)
    return d * es, s * es, inner * es


def _storages(params: list) -> dict:
    return {p.untyped_storage().data_ptr(): i for i, p in enumerate(params)}


def _record(model, params, bucket: torch.Tensor, layout: tuple, ptrs: tuple) -> _Record:
    """Place the bucket through ``model.load_weights`` (output by output, then the kept ones together) and record
    the placements (``params``: the model's parameters and buffers, the tensors a loader may write)."""
    storages = _storages(params)
    dst, src, nb, fallback = [], [], [], []
    for name, dtype, shape, lo, hi in layout:
        view = _view(bucket, dtype, shape, lo, hi)
        obs = _Observer(storages, bucket, lo + bucket.storage_offset(), hi + bucket.storage_offset())
        with obs:
            model.load_weights([(name, view)])
        runs = [(pi,) + _runs(d_t, s_t) for pi, d_t, s_t in obs.copies]
        elements = sum(d_t.numel() for _, d_t, _ in obs.copies)
        why = obs.bad or ("" if runs else "no placement observed") or (
            "runs shorter than 8 elements" if sum(len(d) for _, d, _, _ in runs) * min(8, elements) > elements
            else "")  # a transpose (one element per run); a whole output shorter than 8 elements is one run
        if why:
            log.info("ebbtide: SGLang's loader keeps %s (%s)", name, why)
            fallback.append(name)
            continue
        for pi, d, s, n in runs:
            s = s - (bucket.storage_offset() * bucket.element_size())
            dst += [(pi, int(x)) for x in d.tolist()]
            src.append(s)
            nb.append(torch.full_like(s, n))
    if fallback:  # together, as SGLang's own path would see them (loaders that combine outputs need that)
        by_name = {o[0]: o for o in layout}
        model.load_weights([(n, _view(bucket, *by_name[n][1:])) for n in fallback])
    src_t = torch.cat(src) if src else torch.zeros(0, dtype=torch.int64)
    nb_t = torch.cat(nb) if nb else torch.zeros(0, dtype=torch.int64)
    return _Record(layout, ptrs, dst, src_t, nb_t, fallback)


def _view(bucket, dtype: str, shape, lo: int, hi: int) -> torch.Tensor:
    return bucket[lo:hi].view(getattr(torch, dtype)).view(tuple(shape))


def _replay(rec: _Record, params, bucket: torch.Tensor) -> None:
    if len(rec.dst) == 0:
        return
    if bucket.device.type == "cuda":
        from ...quant import _cuda  # noqa: PLC0415

        if rec.table is None:
            chunk = _cuda._q().COPY_SEGMENT_CHUNK
            counts = -(-rec.nbytes // chunk)
            table = torch.zeros((len(rec.dst), 4), dtype=torch.int64)
            table[:, 0] = torch.tensor([params[pi].untyped_storage().data_ptr() + off for pi, off in rec.dst])
            table[:, 2] = rec.nbytes
            table[:, 3] = torch.cumsum(counts, 0) - counts
            rec.table, rec.launch = table, None
        stream = torch.cuda.current_stream(bucket.device).cuda_stream
        if rec.launch is None or rec.launch[:2] != (bucket.data_ptr(), stream):
            host = rec.table.clone()
            host[:, 1] = rec.src + bucket.data_ptr()
            host = host.pin_memory()  # the device copy is ordered on this stream: later launches here follow it
            rec.launch = (bucket.data_ptr(), stream, host, _cuda.upload(host, bucket.device))
        _cuda.launch_segments(rec.launch[2], rec.launch[3], len(rec.dst), bucket.device)
        return
    flat = bucket.reshape(-1)
    stores = [torch.empty(0, dtype=torch.uint8).set_(p.untyped_storage()) for p in params]
    for (pi, off), s, n in zip(rec.dst, rec.src.tolist(), rec.nbytes.tolist()):
        stores[pi][off:off + n].copy_(flat[s:s + n])


def _refuse(st: LoaderState, why: str) -> None:
    st.last_error = why
    log.error("ebbtide: SGLang loader refused an update (weights untouched): %s", why)


@torch.no_grad()
def load_weights(model, named_tensors) -> None:
    """SGLang's custom weight loader entry (see the module doc). ``named_tensors``: SGLang's list of (name,
    tensor); the ebbtide form is one entry, anything else goes to ``model.load_weights``."""
    named_tensors = list(named_tensors)
    name = named_tensors[0][0] if len(named_tensors) == 1 else None
    if not (isinstance(name, str) and name.startswith(PREFIX)):
        model.load_weights(named_tensors)
        return
    bucket = named_tensors[0][1]
    st = state(model)
    try:
        meta, layout = _parse(name)
        version, index, count, sig = int(meta["v"]), int(meta["bucket"]), int(meta["buckets"]), meta["sig"]
    except (ValueError, KeyError, TypeError, IndexError) as e:
        return _refuse(st, f"the tensor's name does not carry a readable ebbtide layout ({type(e).__name__}: {e})")
    if version <= st.held:
        return _refuse(st, f"version {version} is not newer than the held version {st.held}")
    if st.current is not None and version < st.current:
        return _refuse(st, f"version {version} is older than version {st.current}, in progress")
    if st.current != version:
        st.current, st.done, st.signature = version, set(), sig
    elif sig != st.signature:
        return _refuse(st, f"bucket {index} of version {version} has plan signature {sig}, its earlier buckets "
                           f"{st.signature}")
    if index in st.done or not 0 <= index < count:
        return _refuse(st, f"bucket {index} of {count} of version {version} was already applied or is out of range")
    if bucket.dtype != torch.uint8 or bucket.dim() != 1 or any(hi > bucket.numel() for *_, hi in layout):
        return _refuse(st, f"bucket {index}: the tensor ({bucket.dtype}, {tuple(bucket.shape)}) does not hold its "
                           "outputs")
    if st.walked is None or st.walked[0] != version:
        params = [p for _, p in model.named_parameters()] + [b for _, b in model.named_buffers()]
        st.walked = (version, params, tuple(p.untyped_storage().data_ptr() for p in params))
    _, params, ptrs = st.walked
    key = (sig, index)
    rec = st.records.get(key)
    if rec is None or rec.layout != layout or rec.ptrs != ptrs:
        rec = _record(model, params, bucket, layout, ptrs)  # places this bucket through SGLang's loader
        st.records[key] = rec
        st.recorded += 1
        st.walked = None  # SGLang's loader ran: walk the parameters again for the next bucket
    else:
        _replay(rec, params, bucket)
        if rec.fallback:
            by_name = {o[0]: o for o in layout}
            model.load_weights([(n, _view(bucket, *by_name[n][1:])) for n in rec.fallback])
            st.walked = None  # SGLang's loader ran (it may replace parameters): walk again for the next bucket
        st.replayed += 1
    st.done.add(index)
    if len(st.done) == count:
        st.held, st.current, st.done = version, None, set()
