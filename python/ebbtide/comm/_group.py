"""ReloadableGroup: the ProcessGroup object users hold; it forwards every operation to the live inner group.

Contract:
- It is a real ``torch.distributed.ProcessGroup`` (a Python subclass through torch's PyProcessGroup trampoline),
  registered in c10d's ``_world`` maps under the group's original name, so ``dist.*`` collectives, rank helpers
  (``get_rank(group)``, ``get_process_group_ranks``, ``get_global_rank``), object collectives and
  ``batch_isend_irecv`` take it like any group. rank, size, name, description, bound device and device types stay
  the same across release/reload.
- The *inner* group is the torch group that does the work. It is torn down at release and a rebuilt one takes its
  place at reload. c10d's native name registry points the stable name at the live inner, so functional
  collectives and compiled graphs resolve it natively; while released it points at this wrapper, whose ops raise.
- While released, every operation raises :class:`~ebbtide.errors.StateError` naming the group and what to do, before
  anything reaches NCCL (a collective on a destroyed communicator would fault the GPU or hang).
- A Python op never returns None to c10d (a None Work segfaults at ``wait()``): a completed Work stands in.
- It owns its state: its journal entry, its live inner, whether it is live, released (and by which strategy) or
  destroyed. The runtime changes that state only through the ``_ebt_*``
  transition methods below, under the runtime's lock; an op reads ``_ebt_inner`` once (one attribute load).
- Destroyed is final: a group destroyed with ``dist.destroy_process_group`` (also while released, also on a peer
  rank while released) is never rebuilt, and every op on it raises StateError naming it.
"""
from __future__ import annotations

import torch
from torch._C._distributed_c10d import ProcessGroup

from ..errors import StateError

__all__ = ["ReloadableGroup"]

# Operations that return a Work (a None result is replaced by a completed Work).
_WORK_OPS = (
    "allreduce", "allreduce_coalesced", "allgather", "_allgather_base", "allgather_coalesced",
    "allgather_into_tensor_coalesced", "all_gather_single", "all_gather_single_coalesced", "alltoall",
    "alltoall_base", "all_to_all_single", "barrier", "broadcast", "gather", "scatter", "reduce", "reduce_scatter",
    "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "reduce_scatter_single",
    "reduce_scatter_single_coalesced", "send", "recv", "recv_anysource", "monitored_barrier", "_end_coalescing",
)
# Other per-group calls that need the live inner group.
_PLAIN_OPS = (
    "_start_coalescing", "_get_backend", "_has_hooks", "_wait_for_pending_works",
    "_register_on_completion_hook", "_set_sequence_number_for_group", "_get_sequence_number_for_group",
    "set_timeout", "get_group_store", "_enable_collectives_timing", "_backend_id",
)


def _completed_work():
    fut = torch.futures.Future()
    fut.set_result(None)
    return torch._C._distributed_c10d._create_work_from_future(fut)


def _forwarder(name: str, returns_work: bool):
    def forward(self, *args, **kwargs):
        inner = self._ebt_inner
        if inner is None:
            raise self._ebt_released_error(name)
        self._ebt_used = True
        result = getattr(inner, name)(*args, **kwargs)
        if returns_work and result is None:
            return _completed_work()
        return result

    forward.__name__ = name
    forward.__qualname__ = f"ReloadableGroup.{name}"
    forward.__doc__ = f"Forwards ``{name}`` to the live inner group; raises StateError while released."
    return forward


class ReloadableGroup(ProcessGroup):
    """A process group that survives ``ebbtide.comm.release()`` / ``reload()``. Created by the runtime only."""

    def __init__(self, inner: ProcessGroup, *, name: str, desc: str, index: int, runtime):
        super().__init__(inner.rank(), inner.size())
        self._ebt_inner: ProcessGroup | None = inner  # live torch group; None while released
        self._ebt_name = str(name)  # stable c10d name
        self._ebt_desc = str(desc)
        self._ebt_index = index  # position in the replay journal
        self._ebt_runtime = runtime
        self._ebt_backend_name = inner.name()
        self._ebt_device_types = list(inner._device_types)
        self._ebt_used = False  # an op went through the wrapper since the last (re)build
        self._ebt_released_by: str | None = None  # strategy that released it; None while live
        self._ebt_destroyed = False  # destroyed by the user (dist.destroy_process_group): final
        self._ebt_destroyed_why = ""
        self._ebt_entry = None  # its journal entry (set when the runtime journals it)
        if inner.bound_device_id is not None:
            self.bound_device_id = inner.bound_device_id

    # ---- identity (trampolined virtuals: C++ callers see these too) -------------------------------------------
    def getGroupName(self) -> str:  # noqa: N802 (PyProcessGroup override name)
        return self._ebt_name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._ebt_desc

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._ebt_name = str(name)

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._ebt_desc = str(desc)

    def getBackendName(self) -> str:  # noqa: N802
        return self._ebt_backend_name

    def _get_backend_name(self) -> str:
        return self._ebt_backend_name

    @property
    def _device_types(self):
        return list(self._ebt_device_types)

    # ---- state ----------------------------------------------------------------------------------------------
    @property
    def released(self) -> bool:
        """True between release() and reload() for this group."""
        return self._ebt_inner is None and not self._ebt_destroyed

    @property
    def inner(self) -> ProcessGroup | None:
        """The live torch group doing the work (changes on reload; None while released). For diagnostics."""
        return self._ebt_inner

    def _ebt_released_error(self, op: str) -> StateError:
        if self._ebt_destroyed:
            return StateError(f"process group '{self._ebt_name}' ({self._ebt_desc}) was destroyed "
                              f"({self._ebt_destroyed_why}); '{op}' cannot run on it")
        return StateError(
            f"process group '{self._ebt_name}' ({self._ebt_desc}, size {self.size()}) is released by "
            f"ebbtide.comm.release() (strategy {self._ebt_released_by}); call ebbtide.comm.reload() before "
            f"'{op}'")

    # ---- state transitions (the runtime calls these under its lock) ------------------------------------------
    def _ebt_detach(self) -> ProcessGroup | None:
        """Release starts: ops raise from now on. Returns the inner that was live."""
        inner, self._ebt_inner, self._ebt_released_by = self._ebt_inner, None, "pending"
        return inner

    def _ebt_attach(self, inner: ProcessGroup, *, fresh: bool = False) -> None:
        """``inner`` is live (again). ``fresh``: it was rebuilt, so no op has gone through it yet."""
        self._ebt_inner, self._ebt_released_by = inner, None
        if fresh:
            self._ebt_used = False

    def _ebt_mark_released(self, plan: str) -> None:
        self._ebt_released_by = plan

    def _ebt_destroy(self, why: str) -> ProcessGroup | None:
        """Mark destroyed (final). Returns the live inner the caller must tear down, if any."""
        inner, self._ebt_inner, self._ebt_destroyed = self._ebt_inner, None, True
        self._ebt_destroyed_why = why
        return inner

    # ---- creation and teardown hooks into the runtime -------------------------------------------------------
    def split_group(self, ranks, *args, **kwargs):
        """c10d's split_group() calls this on the parent; the runtime splits the live inner and journals it."""
        return self._ebt_runtime.split_from(self, ranks, args, kwargs)

    def shutdown(self) -> None:
        self._ebt_runtime.user_destroyed(self, "shutdown")

    def abort(self) -> None:
        self._ebt_runtime.user_destroyed(self, "abort")

    def __repr__(self) -> str:
        state = "destroyed" if self._ebt_destroyed else ("released" if self._ebt_inner is None else "live")
        return (f"<ebbtide ReloadableGroup '{self._ebt_name}' ({self._ebt_desc}) rank {self.rank()}/{self.size()} "
                f"{state}>")


for _name in _WORK_OPS:
    if hasattr(ProcessGroup, _name):
        setattr(ReloadableGroup, _name, _forwarder(_name, True))
for _name in _PLAIN_OPS:
    if hasattr(ProcessGroup, _name):
        setattr(ReloadableGroup, _name, _forwarder(_name, False))
del _name
