"""DeepEP buffers released and reloaded with the process groups.

What holds:
- Which buffers. Every ``deep_ep.Buffer`` constructed after :func:`ebbtide.comm.install` (through an import hook
  on ``deep_ep``, or a patch of the class when it is already imported) is tracked by a weak reference, as is one
  passed to :func:`track`. The user's object stays the object: Megatron-core's ``fused_a2a._buffer`` global and an
  SGLang-style holder keep working across cycles.
- Why construction is adjusted. DeepEP's C++ buffer destroys itself in its destructor unless it was built with
  ``explicitly_destroy=True``, and its ``destroy()`` asserts it was not destroyed yet: a runtime freed by release
  would fail again (an exception out of a destructor) when the object dies. So tracked buffers are built with
  ``explicitly_destroy=True``; where the caller did not ask for that, a finalizer does what DeepEP's destructor
  would (destroy the live runtime when the object is collected). A buffer constructed before install() with
  ``explicitly_destroy=False`` cannot be released safely: release() refuses it by name (UnsupportedError).
- Release (on every rank, after the control plane agreed, before any communicator is torn down): the live
  runtime's ``destroy()`` (a device sync, DeepEP's intranode barrier among the buffer's ranks, IPC handles closed,
  the NVLink buffer, its 32 MiB workspace and host counters freed; NVSHMEM memory where it was used) and
  ``buffer.runtime`` becomes a guard whose every use raises StateError. Reload (after the groups are back):
  DeepEP's own ``Buffer.__init__`` runs again on the same object with the same arguments, which allocates and
  exchanges the IPC handles over the (reloaded) group.
- Agreement: each rank's live buffers (group ranks and sizes, in tracking order) travel in release()'s
  control-plane payload; two ranks must list the same buffers for the groups they share (a rank outside a group
  need not hold its buffer: pipeline stages without MoE layers). Ranks that disagree fail release() before
  anything is freed.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
import threading
import time
import weakref

from ..errors import StateError, UnsupportedError
from ._report import GroupReport

log = logging.getLogger("ebbtide.comm")

__all__ = ["track", "tracked", "install_hook", "describe", "release_buffers", "reload_buffers", "timings"]

_LOCK = threading.Lock()
_BUFFERS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()  # id -> Buffer
_ORDER: list[int] = []  # tracking order (ids), so every rank walks its buffers in creation order
_ATTR = "_ebbtide_deepep"  # per-buffer record: {"args": ..., "box": [runtime], "released": bool}


class ReleasedRuntime:
    """Stands in for ``buffer.runtime`` while released: any use raises StateError instead of touching freed
    device memory."""

    def __init__(self, what: str):
        object.__setattr__(self, "_what", what)

    def __getattr__(self, name):
        raise StateError(f"{object.__getattribute__(self, '_what')} was released by ebbtide.comm.release(); "
                         f"call ebbtide.comm.reload() before using it (attribute {name!r})")

    def __setattr__(self, name, value):
        self.__getattr__(name)


def _destroy_if_live(box: list) -> None:
    """Finalizer of a buffer whose caller relied on DeepEP's destroy-in-destructor."""
    rt = box[0]
    if rt is not None and not isinstance(rt, ReleasedRuntime):
        try:
            if rt.is_available():
                rt.destroy()
        except Exception as e:  # noqa: BLE001 (a finalizer has no caller to raise to)
            log.warning("ebbtide.comm: destroying a collected DeepEP buffer failed: %s", e)


def _record(buf, args: dict, auto_destroy: bool) -> None:
    box = [getattr(buf, "runtime", None)]
    setattr(buf, _ATTR, {"args": args, "box": box, "released": False})
    if auto_destroy:
        weakref.finalize(buf, _destroy_if_live, box)
    with _LOCK:
        if id(buf) not in _ORDER:
            _ORDER.append(id(buf))
        _BUFFERS[id(buf)] = buf


def _patch(cls) -> None:
    if getattr(cls.__init__, "_ebbtide_patched", False):
        return
    original = cls.__init__
    import inspect  # noqa: PLC0415

    sig = inspect.signature(original)

    def __init__(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        bound.apply_defaults()
        call = dict(bound.arguments)
        call.pop("self", None)
        wanted = bool(call.get("explicitly_destroy", False))
        if "explicitly_destroy" in sig.parameters:
            call["explicitly_destroy"] = True
        original(self, **call)
        _record(self, call, auto_destroy=not wanted and "explicitly_destroy" in sig.parameters)
        if not wanted:
            self.explicitly_destroy = False  # what the caller asked for (DeepEP's destroy() checks this flag)

    __init__._ebbtide_patched = True
    __init__._ebbtide_original = original
    cls.__init__ = __init__


def _original_init(cls):
    return getattr(cls.__init__, "_ebbtide_original", cls.__init__)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Patches ``deep_ep.Buffer`` right after ``deep_ep`` is imported (Megatron imports it at module load)."""

    def find_spec(self, name, path=None, target=None):
        if name != "deep_ep":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        self._inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        cls = getattr(module, "Buffer", None)
        if cls is not None:
            _patch(cls)


_FINDER = _Finder()


def install_hook() -> None:
    """Track every DeepEP buffer built from now on (idempotent)."""
    mod = sys.modules.get("deep_ep")
    if mod is not None and getattr(mod, "Buffer", None) is not None:
        _patch(mod.Buffer)
    elif _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def track(buf) -> None:
    """Release and reload ``buf`` (a ``deep_ep.Buffer``) with the process groups. Needed only for a buffer built
    before :func:`ebbtide.comm.install`; it must have been built with ``explicitly_destroy=True``."""
    if getattr(buf, _ATTR, None) is not None:
        return
    if not getattr(buf, "explicitly_destroy", False):
        raise UnsupportedError("ebbtide.comm.track(): this DeepEP Buffer was built with explicitly_destroy=False "
                               "before ebbtide.comm.install(): DeepEP's destructor would destroy it a second time "
                               "after a release. Build it after install(), or with explicitly_destroy=True")
    if getattr(buf, "low_latency_mode", False) or getattr(buf, "group", None) is None:
        raise UnsupportedError("ebbtide.comm.track(): a low-latency or MPI-communicator DeepEP Buffer built before "
                               "install() cannot be rebuilt with its own arguments (not kept on the object); "
                               "build it after ebbtide.comm.install()")
    args = {k: getattr(buf, k) for k in ("group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode",
                                         "explicitly_destroy") if hasattr(buf, k)}
    _record(buf, args, auto_destroy=False)


def tracked() -> list:
    """The live tracked buffers, in tracking order."""
    with _LOCK:
        out = [_BUFFERS.get(i) for i in _ORDER]
        _ORDER[:] = [i for i, b in zip(list(_ORDER), out) if b is not None]
    return [b for b in out if b is not None]


def _live(buf) -> bool:
    rec = getattr(buf, _ATTR)
    rt = getattr(buf, "runtime", None)
    return not rec["released"] and rt is not None and not isinstance(rt, ReleasedRuntime)


def describe() -> list:
    """This rank's live buffers as ``[group ranks, num_nvl_bytes, num_rdma_bytes]`` (the release payload's
    part), in tracking order."""
    return [[_ranks(b), int(getattr(b, "num_nvl_bytes", 0)), int(getattr(b, "num_rdma_bytes", 0))]
            for b in tracked() if _live(b)]


def disagreement(everyone: list) -> str:
    """"" when every rank lists, in the same order, the buffers of each group it belongs to (DeepEP's destroy is
    collective among a buffer's ranks; ranks outside a group need not hold its buffer, e.g. pipeline stages
    without MoE layers); else what differs."""
    for r, payload in enumerate(everyone):
        for ranks, *_ in payload["deepep"]:
            for peer in ranks:
                mine = [e for e in payload["deepep"] if peer in e[0]]
                theirs = [e for e in everyone[peer]["deepep"] if r in e[0]] if peer < len(everyone) else None
                if mine != theirs:
                    return (f"rank {r} holds {mine} with rank {peer}, rank {peer} holds {theirs} "
                            "([group ranks, nvl bytes, rdma bytes])")
    return ""


def _name(buf) -> str:
    g = getattr(buf, "group", None)
    gname = getattr(g, "_ebt_name", None) or getattr(g, "group_name", None) or "?"
    return f"deep_ep.Buffer(group {gname}, nvl {int(getattr(buf, 'num_nvl_bytes', 0)) / 2**20:.0f} MiB)"


def release_buffers() -> list[GroupReport]:
    """Destroy every tracked live buffer's runtime (collective among each buffer's ranks); reports in order."""
    reports = []
    for buf in tracked():
        if not _live(buf):
            continue
        rec = getattr(buf, _ATTR)
        t0 = time.perf_counter()
        rt = buf.runtime
        rt.destroy()
        rec["released"] = True
        rec["box"][0] = None
        buf.runtime = ReleasedRuntime(_name(buf))
        nbytes = int(getattr(buf, "num_nvl_bytes", 0)) + int(getattr(buf, "num_rdma_bytes", 0))
        reports.append(GroupReport(_name(buf), "DeepEP buffer", _ranks(buf), "destroy",
                                   "NVLink buffer freed; rebuilt in place at reload", time.perf_counter() - t0,
                                   nbytes))
    return reports


def reload_buffers() -> list[GroupReport]:
    """Rebuild every released buffer in place with its original arguments (after the groups are back). The
    group's first collective (a barrier: NCCL connects a rebuilt communicator's transports on first use) is timed
    apart from DeepEP's own rebuild (allocation, IPC handle exchange, peer mappings): both in the report's reason
    and in the buffer's record (``timings``)."""
    import torch.distributed as dist  # noqa: PLC0415

    reports = []
    for buf in tracked():
        rec = getattr(buf, _ATTR)
        if not rec["released"]:
            continue
        t0 = time.perf_counter()
        group = rec["args"].get("group")
        if group is not None:
            dist.barrier(group=group)
        t1 = time.perf_counter()
        wanted = bool(getattr(buf, "explicitly_destroy", False))
        _original_init(type(buf))(buf, **rec["args"])
        buf.explicitly_destroy = wanted
        rec["box"][0] = buf.runtime
        rec["released"] = False
        t2 = time.perf_counter()
        rec["timings"] = {"connect_s": t1 - t0, "rebuild_s": t2 - t1}
        reports.append(GroupReport(_name(buf), "DeepEP buffer", _ranks(buf), "destroy",
                                   f"rebuilt in place: group's first collective {1e3 * (t1 - t0):.1f} ms, DeepEP "
                                   f"allocation + IPC exchange {1e3 * (t2 - t1):.1f} ms", t2 - t0,
                                   -int(getattr(buf, "num_nvl_bytes", 0))))
    return reports


def timings(buf) -> dict:
    """The last reload's ``{"connect_s", "rebuild_s"}`` of a tracked buffer (empty before its first reload)."""
    rec = getattr(buf, _ATTR, None)
    return dict(rec.get("timings", {})) if rec else {}


def _ranks(buf) -> list[int]:
    try:
        import torch.distributed as dist  # noqa: PLC0415

        return list(dist.get_process_group_ranks(buf.group))
    except Exception:  # noqa: BLE001 (a report field, not a precondition)
        return []

