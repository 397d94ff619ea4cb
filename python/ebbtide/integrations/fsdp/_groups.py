"""An FSDP2 model's process groups as ebbtide.comm groups: install before the device mesh is made, release for the
rollout, reload after.

What holds:
- ``install_groups()`` is ``ebbtide.comm.install()`` (best before ``init_process_group``: then WORLD is reloadable
  too). ``init_device_mesh`` makes its groups with ``new_group`` / ``split_group``, which ebbtide.comm hooks, so the
  mesh's groups come back as ``ReloadableGroup`` objects that the mesh (and every FSDPParam's mesh info) keeps
  holding across release/reload. A 1-D mesh over every rank uses WORLD itself.
- ``fsdp_groups(model)``: ``{name: group}`` of every group the model's FSDP params communicate over: the shard
  group (``"shard"``) and, where one was set apart (``set_separate_reduce_scatter_group`` in torch 2.13), the
  reduce-scatter group. ``check_groups(model)`` raises StateError naming any that is not reloadable (the mesh was
  made before ``install_groups()``), before any release is tried.
- ``release_groups()`` / ``reload_groups()`` are ebbtide.comm's collective release/reload over WORLD (every rank,
  same order). ``include_world`` defaults to True here, since the usual 1-D mesh is WORLD; Gloo groups are kept
  unless ``include_cpu=True``. A collective on a released group raises StateError before reaching the backend;
  a rank missing at release or reload makes the others raise WaitTimeoutError naming it, within the timeout.
"""
from __future__ import annotations

import torch.distributed as dist

from ... import comm
from ...errors import StateError
from ._model import describe

__all__ = ["install_groups", "fsdp_groups", "check_groups", "release_groups", "reload_groups"]


def install_groups(**comm_install_kwargs) -> list[str]:
    """Make every process group created from now on reloadable (``ebbtide.comm.install``); call it before
    ``init_process_group`` and ``init_device_mesh``. Returns the NCCL variables it warned about. Idempotent."""
    return comm.install(**comm_install_kwargs)


def fsdp_groups(model) -> dict:
    """``{name: ProcessGroup}`` the model's FSDP params communicate over (see the module doc)."""
    out = {}
    for r in describe(model).params:
        info = r.fsdp_param.mesh_info
        out.setdefault("shard", info.shard_process_group)
        rs = getattr(info, "reduce_scatter_process_group", None)
        if rs is not None and rs is not info.shard_process_group:
            out.setdefault("reduce_scatter", rs)
    return out


def check_groups(model) -> dict:
    """``{name: {"reloadable", "backend", "size"}}`` for :func:`fsdp_groups`; StateError naming the groups that are
    not ebbtide.comm groups."""
    report, plain = {}, []
    for name, g in fsdp_groups(model).items():
        ok = isinstance(g, comm.ReloadableGroup)
        backend = "released" if comm.is_released() else str(dist.get_backend(g))
        report[name] = {"reloadable": ok, "backend": backend, "size": g.size()}
        if not ok:
            plain.append(name)
    if plain:
        raise StateError(f"the model's {', '.join(plain)} group(s) are not reloadable: the device mesh was made "
                         "before ebbtide.integrations.fsdp.install_groups() (call it before init_process_group "
                         "and init_device_mesh)")
    return report


def release_groups(include_world: bool = True, *, include_cpu: bool = False, timeout: float | None = None,
                   wait: bool = True):
    """Free the communicators (WORLD's too unless ``include_world=False``; Gloo groups with ``include_cpu``).
    Collective. Returns ebbtide.comm's Report, or with ``wait=False`` a Future of it (see ebbtide.comm.release)."""
    if not comm.is_installed():
        raise StateError("release_groups() needs install_groups() before init_process_group / init_device_mesh")
    return comm.release(include_world, include_cpu=include_cpu, timeout=timeout, wait=wait)


def reload_groups(eager: bool = True, *, timeout: float | None = None):
    """Bring the released groups back (``eager=False``: each connects on first use). Collective."""
    if not comm.is_installed():
        raise StateError("reload_groups() needs install_groups() before init_process_group / init_device_mesh")
    return comm.reload(eager, timeout=timeout)
