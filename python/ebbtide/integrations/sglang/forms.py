"""SGLang's weight-update forms, built from ebbtide's buckets (SGLang itself is not imported unless present).

Requests are dicts whose keys are the fields of SGLang's request structs (``sglang.srt.managers.io_struct``),
ready for its HTTP endpoint of the same name (``POST /<endpoint>`` with the dict as JSON; pass ``as_str=True``
so the payloads are base64 text) or for the ``Engine`` method of the same name.

- ``update_weights_from_tensor``: ``serialized_named_tensors`` holds one payload per TP rank of the engine, each
  ``MultiprocessingSerializer.serialize`` of the named tensors (torch's ``ForkingPickler``: a CUDA tensor travels
  as a CUDA IPC handle, a CPU tensor through shared memory). ``form="named"``: a list of ``(name, tensor)`` views
  into the bucket (``load_format=None``: the model's ``load_weights``). ``form="flattened_bucket"``: the dict
  ``{"flattened_tensor": uint8 bucket, "metadata": [FlattenedTensorMetadata(name, shape, dtype, start_idx,
  end_idx, numel)]}`` (byte offsets; dtypes mixed), which SGLang rebuilds as views. ``form="ebbtide"``: one
  named tensor, the bucket, under a name carrying the layout, version and plan signature, with ``load_format``
  naming ebbtide's loader (``loader.py``; the server needs ``--custom-weight-loader
  ebbtide.integrations.sglang.load_weights``),
  which replays a record of SGLang's own placement in one launch per bucket.
- ``update_weights_from_distributed``: per bucket ``names``/``dtypes``/``shapes`` in wire order with
  ``load_format="flattened_bucket"``: the receiver allocates ``FlattenedTensorBucket.empty(names, dtypes, shapes)``
  and joins one broadcast of the whole bucket, which lands in place because ebbtide's bucket has exactly that
  gapless layout (see ``plan``). The group comes from ``init_weights_update_group``.
- SGLang 0.5.23 loads weights only inside a session: ``begin_weight_update`` before the first bucket and
  ``end_weight_update`` after the last (it also runs the post-load processing, e.g. UE8M0 requantization).
- SGLang replies once its copies are enqueued, not completed. So once a bucket's request is answered the sender
  drops its own reference and leaves the buffer to torch's CUDA IPC reference count: the engine's rebuilt tensors
  keep it, and their release first synchronizes the engine's stream (torch's consumer-side deleter), so the block
  goes back to the sender's caching allocator (``torch.cuda.ipc_collect`` before every new bucket) only after the
  engine's copies out of it completed. SGLang's rebuilt tensors are locals of its request handler, released before
  it answers: at most two buckets are live on the sender (the one posted, the one being filled).
"""
from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import types
from multiprocessing.reduction import ForkingPickler

import torch

from ...errors import InvalidArgumentError, StateError
from ...sync.plan import BucketPlan

__all__ = ["serialize", "tensor_request", "ebbtide_payload", "distributed_request", "init_group_request",
           "destroy_group_request", "begin_request", "end_request", "SGLangTensorSender", "SGLangDistributedSender",
           "FORMS"]

FORMS = ("flattened_bucket", "named", "ebbtide")


def serialize(obj, *, as_str: bool = False):
    """What SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=as_str)`` produces: a ``ForkingPickler``
    dump (torch's reductions: CUDA tensors as IPC handles), base64 text with ``as_str``."""
    import torch.multiprocessing  # noqa: F401,PLC0415  (registers torch's reductions with ForkingPickler)

    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    out = buf.getvalue()
    return base64.b64encode(out).decode("ascii") if as_str else out


def _metadata_class():
    """SGLang's ``FlattenedTensorMetadata`` where SGLang is importable (the exact form slime sends), else a
    ``types.SimpleNamespace`` with the same attributes (on SGLang's unpickler allow-list; its loader reads the
    attributes)."""
    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata  # noqa: PLC0415

        return FlattenedTensorMetadata
    except Exception:  # noqa: BLE001 (an install missing one of SGLang's dependencies fails with other errors too:
        # seen, KeyError 'sglang' from importlib when sglang/__init__ cannot import IPython)
        return types.SimpleNamespace


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def flattened_payload(bucket: BucketPlan, buf: torch.Tensor) -> dict:
    """``{"flattened_tensor", "metadata"}`` of SGLang's flattened-bucket form for ``bucket`` in ``buf``."""
    meta = _metadata_class()
    flat = buf[:bucket.nbytes]
    return {"flattened_tensor": flat,
            "metadata": [meta(name=o.name, shape=torch.Size(o.shape), dtype=_dtype(o.dtype), start_idx=o.offset,
                              end_idx=o.offset + o.nbytes, numel=o.nbytes) for o in bucket.outputs]}


_OUTPUTS_JSON: dict = {}  # id(bucket) -> (bucket, its outputs as JSON): each bucket's layout is encoded once


def _outputs_json(bucket: BucketPlan) -> str:
    hit = _OUTPUTS_JSON.get(id(bucket))
    if hit is None or hit[0] is not bucket:  # the entry holds the bucket, so its id cannot be reused meanwhile
        if len(_OUTPUTS_JSON) >= 4096:
            _OUTPUTS_JSON.clear()
        hit = (bucket, json.dumps([[o.name, o.dtype, list(o.shape), o.offset, o.offset + o.nbytes]
                                   for o in bucket.outputs], separators=(",", ":")))
        _OUTPUTS_JSON[id(bucket)] = hit
    return hit[1]


def ebbtide_payload(bucket: BucketPlan, buf: torch.Tensor, *, version: int, signature: str, buckets: int) -> list:
    """The ebbtide form's named tensors: ``[(name carrying the layout, the bucket's bytes)]``; the name is
    ``loader.encode`` of ``{"v", "sig", "bucket", "buckets", "outputs"}``, the outputs' JSON made once per
    bucket (an MoE bucket lists hundreds of outputs)."""
    from .loader import encode  # noqa: PLC0415

    head = {"v": int(version), "sig": signature, "bucket": bucket.index, "buckets": int(buckets)}
    return [(encode(head, _outputs_json(bucket)), buf[:bucket.nbytes])]


def tensor_request(bucket: BucketPlan, buf: torch.Tensor, *, form: str = "flattened_bucket", tp_size: int = 1,
                   weight_version=None, flush_cache: bool = False, as_str: bool = False,
                   signature: str | None = None, buckets: int | None = None) -> dict:
    """The ``update_weights_from_tensor`` request for one bucket held in ``buf`` (uint8, ``bucket.nbytes``+).
    ``form="ebbtide"`` needs ``weight_version`` (an int), the plan's ``signature`` and its bucket count."""
    if form not in FORMS:
        raise InvalidArgumentError(f"form must be one of {FORMS}, got {form!r}")
    if not isinstance(tp_size, int) or tp_size < 1:
        raise InvalidArgumentError(f"tp_size must be a positive int, got {tp_size!r}")
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.numel() < bucket.nbytes:
        raise InvalidArgumentError(f"buf must be a uint8 tensor of at least {bucket.nbytes} bytes")
    load_format = None
    if form == "flattened_bucket":
        obj, load_format = flattened_payload(bucket, buf), form
    elif form == "ebbtide":
        if not isinstance(weight_version, int) or isinstance(weight_version, bool) or weight_version < 0 \
                or not signature or not isinstance(buckets, int) or buckets < 1:
            raise InvalidArgumentError("form='ebbtide' needs weight_version (an int >= 0), the plan's signature and "
                                       f"its bucket count (got {weight_version!r}, {signature!r}, {buckets!r})")
        from .loader import LOADER  # noqa: PLC0415

        obj = ebbtide_payload(bucket, buf, version=weight_version, signature=signature, buckets=buckets)
        load_format = LOADER
    else:
        obj = [(o.name, o.view(buf)) for o in bucket.outputs]
    return {"serialized_named_tensors": [serialize(obj, as_str=as_str) for _ in range(tp_size)],
            "load_format": load_format, "flush_cache": flush_cache,
            "weight_version": None if weight_version is None else str(weight_version)}


def distributed_request(bucket: BucketPlan, *, group_name: str = "weight_update_group", weight_version=None,
                        flush_cache: bool = False) -> dict:
    """The ``update_weights_from_distributed`` request announcing one bucket's broadcast."""
    names, dtypes, shapes = bucket.request_lists()
    return {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "flush_cache": flush_cache, "weight_version": None if weight_version is None else str(weight_version),
            "load_format": "flattened_bucket"}


def init_group_request(master_address: str, master_port: int, rank_offset: int, world_size: int, *,
                       group_name: str = "weight_update_group", backend: str = "nccl") -> dict:
    """``init_weights_update_group``: the engine's ranks join a group of ``world_size`` at ``rank_offset``."""
    return {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend}


def destroy_group_request(group_name: str = "weight_update_group") -> dict:
    return {"group_name": group_name}


def begin_request(selector: str = "all") -> dict:
    return {"selector": selector}


def end_request() -> dict:
    return {}


def _ok(reply, what: str):
    """SGLang answers ``{"success": bool, "message": str}`` (or a (success, message) pair from the Engine)."""
    if isinstance(reply, dict):
        success, message = reply.get("success", True), reply.get("message", "")
    elif isinstance(reply, (tuple, list)) and len(reply) >= 2:
        success, message = reply[0], reply[1]
    else:
        return reply
    if not success:
        raise StateError(f"SGLang refused {what}: {message}")
    return reply


class SGLangTensorSender:
    """Sending end for a colocated SGLang engine: ``post(endpoint, request) -> reply`` is called with
    ``begin_weight_update``, one ``update_weights_from_tensor`` per bucket and ``end_weight_update``. The
    request for bucket k is posted after bucket k+1 is queued, so the engine loads k while k+1 is quantized.

    Memory (see the module's notes): bucket k's buffer is the sender's until its request is answered, then the
    engine's until it released its tensors (torch keeps the block meanwhile: ``torch.cuda.memory_allocated``
    counts it); ``buffer()`` first collects what the engine released."""

    def __init__(self, post, *, form: str = "flattened_bucket", tp_size: int = 1, as_str: bool = False,
                 session: bool = True, flush_cache: bool = True):
        if form not in FORMS:
            raise InvalidArgumentError(f"form must be one of {FORMS}, got {form!r}")
        self.post, self.form, self.tp_size, self.as_str = post, form, tp_size, as_str
        self.session, self.flush_cache = session, flush_cache
        self._queued = None

    def _collect(self) -> None:
        """Give back to the caching allocator the buffers whose IPC references the engine released."""
        if self.device.type == "cuda" and torch.cuda.is_initialized():
            torch.cuda.ipc_collect()

    def begin(self, version, plan, device) -> None:
        self.plan, self.version, self.device = plan, version, torch.device(device)
        self._collect()
        if self.session:
            _ok(self.post("begin_weight_update", begin_request()), "begin_weight_update")

    def buffer(self, bucket, stream):
        self._collect()
        return torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)

    def _flush(self, last: bool) -> None:
        if self._queued is None:
            return
        bucket, buf, ev = self._queued
        self._queued = None
        if ev is not None:
            ev.synchronize()  # SGLang reads the bytes without waiting for our stream
        req = tensor_request(bucket, buf, form=self.form, tp_size=self.tp_size, weight_version=self.version,
                             flush_cache=self.flush_cache and last, as_str=self.as_str,
                             signature=self.plan.signature, buckets=len(self.plan.buckets))
        # the request carries the IPC handle: from here the sender keeps no reference, and torch's IPC reference
        # count decides when the block is reused
        del buf
        _ok(self.post("update_weights_from_tensor", req), f"bucket {bucket.index}")

    def send(self, bucket, buf, stream) -> None:
        ev = None
        if stream is not None:
            ev = torch.cuda.Event()
            ev.record(stream)
        self._flush(last=False)
        self._queued = (bucket, buf, ev)

    def commit(self, version) -> None:
        self._flush(last=True)
        self._collect()
        if self.session:
            _ok(self.post("end_weight_update", end_request()), "end_weight_update")

    def close(self) -> None:
        self._queued = None


class SGLangDistributedSender:
    """Sending end for SGLang engines on other GPUs: an ``NcclSender`` without ebbtide's header whose
    ``announce`` posts ``update_weights_from_distributed`` for each bucket on a worker thread (the engine answers
    after it received the broadcast), bracketed by ``begin_weight_update`` / ``end_weight_update``."""

    def __init__(self, group, post, *, src: int = 0, group_name: str = "weight_update_group", session: bool = True,
                 flush_cache: bool = True):
        from ...sync.nccl import NcclSender  # noqa: PLC0415

        self.post, self.group_name, self.session, self.flush_cache = post, group_name, session, flush_cache
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ebbtide-sglang")
        self._nccl = NcclSender(group, src=src, header=False, announce=self._announce)

    def _announce(self, bucket, version):
        req = distributed_request(bucket, group_name=self.group_name, weight_version=version,
                                  flush_cache=self.flush_cache and bucket.index == len(self.plan.buckets) - 1)
        return self._pool.submit(lambda: _ok(self.post("update_weights_from_distributed", req),
                                             f"bucket {bucket.index}"))

    def begin(self, version, plan, device) -> None:
        self.plan = plan
        if self.session:
            _ok(self.post("begin_weight_update", begin_request()), "begin_weight_update")
        self._nccl.begin(version, plan, device)

    def buffer(self, bucket, stream):
        return self._nccl.buffer(bucket, stream)

    def send(self, bucket, buf, stream) -> None:
        self._nccl.send(bucket, buf, stream)

    def commit(self, version) -> None:
        self._nccl.commit(version)
        if self.session:
            _ok(self.post("end_weight_update", end_request()), "end_weight_update")

    def close(self) -> None:
        self._nccl.close()
        self._pool.shutdown(wait=True)
