"""The small hooks ebbtide.comm puts into torch.distributed, and their undoing.

What holds:
- Every replaced attribute is recorded with its original object the first time it is replaced, in the module it was
  found in (c10d functions are re-exported by several modules; each binding is replaced and restored on its own).
- The hooks: c10d's ``_new_process_group_helper`` (the one creation chokepoint of ``init_process_group``,
  ``new_group``, ``new_subgroups*`` and DeviceMesh; handled by the runtime), ``batch_isend_irecv`` (coalesces on
  wrappers too), ``split_group`` (the native name registry points at the live inner) and the Python-side
  ``_resolve_process_group`` (returns the stable wrapper, never one generation's inner).
- A hook on a group that is not a wrapper calls the original unchanged.
"""
from __future__ import annotations

import sys

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ._group import ReloadableGroup
from ._registry import _register_native

__all__ = ["Hooks"]

_MODULES = ("torch.distributed.distributed_c10d", "torch.distributed", "torch.distributed.device_mesh",
            "torch.distributed.tensor._collective_utils")


def _modules_with(attr: str):
    for n in _MODULES:
        mod = sys.modules.get(n)
        if mod is not None and hasattr(mod, attr):
            yield mod


class Hooks:
    """The installed replacements. ``wrapper_of(pg)``: the wrapper whose live inner ``pg`` is, else ``pg``."""

    def __init__(self, wrapper_of):
        self.orig: dict = {}  # (module, attribute) -> original object, restored by uninstall()
        self.wrapper_of = wrapper_of

    @property
    def installed(self) -> bool:
        return bool(self.orig)

    def install(self, helper) -> None:
        """Replace c10d's group-creation helper by ``helper`` and install the other hooks."""
        self._patch(c10d, "_new_process_group_helper", helper)
        for mod in _modules_with("batch_isend_irecv"):
            self._patch(mod, "batch_isend_irecv", self.batch_isend_irecv)
        for mod in _modules_with("split_group"):
            self._patch(mod, "split_group", self.split_group)
        for mod in _modules_with("_resolve_process_group"):
            self._patch(mod, "_resolve_process_group", self.resolve_process_group)

    def uninstall(self) -> None:
        for (mod, attr), obj in self.orig.items():
            setattr(mod, attr, obj)
        self.orig.clear()

    def _patch(self, mod, attr: str, new) -> None:
        key = (mod, attr)
        if key not in self.orig:
            self.orig[key] = getattr(mod, attr)
        setattr(mod, attr, new)

    def original(self, attr: str):
        """c10d's own ``attr`` (the current binding where nothing is installed)."""
        return self.orig.get((c10d, attr)) or getattr(c10d, attr)

    # ---- replacements ---------------------------------------------------------------------------------------
    def batch_isend_irecv(self, p2p_op_list):
        """batch_isend_irecv that coalesces on wrappers too (c10d only coalesces when ``type(group) is
        ProcessGroup``; without coalescing, NCCL send/recv pairs can deadlock)."""
        orig = self.original("batch_isend_irecv")
        if not p2p_op_list:
            return orig(p2p_op_list)
        group = p2p_op_list[0].group
        if group is None and dist.is_initialized():
            group = c10d._get_default_group()
        if not isinstance(group, ReloadableGroup):
            return orig(p2p_op_list)
        c10d._check_p2p_op_list(p2p_op_list)
        inner = group._ebt_inner
        if inner is None:
            raise group._ebt_released_error("batch_isend_irecv")
        device = p2p_op_list[0].tensor.device
        if not inner._get_backend(device).supports_coalescing:
            return orig(p2p_op_list)

        def peer(op):
            if hasattr(op, "group_peer"):
                return {("group_dst" if op.op is c10d.isend else "group_src"): op.group_peer}
            return {("dst" if op.op is c10d.isend else "src"): op.peer}

        with c10d._coalescing_manager(group, device, async_ops=True) as cm:
            for op in p2p_op_list:
                op.op(op.tensor, group=op.group, tag=op.tag, **peer(op))
        return cm.works

    def split_group(self, *args, **kwargs):
        """split_group: c10d registers the returned wrapper under the name natively; point the name at the live
        inner instead so functional collectives run on it."""
        pg = self.original("split_group")(*args, **kwargs)
        if isinstance(pg, ReloadableGroup) and pg._ebt_inner is not None:
            _register_native(pg._ebt_name, pg._ebt_inner)
        return pg

    def resolve_process_group(self, name):
        """Python-side name resolution returns the wrapper (stable, cacheable), never a generation's inner."""
        return self.wrapper_of(self.original("_resolve_process_group")(name))
