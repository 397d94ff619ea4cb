"""c10d registry surgery for ebbtide.comm: where a group is registered (``_world`` maps, tags, the native name
registry). The wrapper takes the inner's place in every Python-side map; the native name registry points at whichever
object should receive name-resolved calls (the live inner, or the wrapper while released)."""
from __future__ import annotations

import contextlib

import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import ProcessGroup

from ._group import ReloadableGroup


def _global_ranks(g: ReloadableGroup) -> list[int]:
    m = c10d._world.pg_group_ranks.get(g)
    return sorted(m, key=m.get) if m else []


_WORLD_DICTS = ("pg_map", "pg_names", "pg_backend_config", "pg_to_tag", "pg_group_ranks", "pg_coalesce_state")


def _move_registration(inner: ProcessGroup, wrapper: ReloadableGroup) -> None:
    """Put the wrapper where c10d registered the inner (same name, tag, store, ranks); the native name registry
    keeps pointing at the inner (functional collectives run on it directly)."""
    w = c10d._world
    for attr in _WORLD_DICTS:
        d = getattr(w, attr, None)
        if d is not None and inner in d:
            d[wrapper] = d.pop(inner)
    for pgs in w.tags_to_pg.values():
        for i, pg in enumerate(pgs):
            if pg is inner:
                pgs[i] = wrapper
    if w.default_pg is inner:
        w.default_pg = wrapper


def _forget_registration(pg: ProcessGroup, name: str) -> None:
    """Remove a temporary rebuild group from every c10d registry (the wrapper stays the registered one)."""
    w = c10d._world
    for attr in _WORLD_DICTS:
        d = getattr(w, attr, None)
        if d is not None:
            d.pop(pg, None)
    for tag in list(w.tags_to_pg):
        w.tags_to_pg[tag] = [x for x in w.tags_to_pg[tag] if x is not pg]
        if not w.tags_to_pg[tag]:
            del w.tags_to_pg[tag]
    with contextlib.suppress(Exception):
        c10d._unregister_process_group(name)


def _world_creation_call(world: ProcessGroup) -> dict:
    """The ``_new_process_group_helper`` arguments that would re-create an existing WORLD (install() after
    init_process_group adopts it with this as its journal entry)."""
    backend, prefix_store = c10d._world.pg_map[world]
    store = getattr(prefix_store, "underlying_store", prefix_store)
    timeout = None
    for dev in world._device_types:
        with contextlib.suppress(Exception):
            timeout = world._get_backend(dev).options._timeout
            break
    return {"group_size": world.size(), "group_rank": world.rank(), "global_ranks_in_group": [],
            "backend": backend, "store": store, "group_name": world.group_name,
            "timeout": timeout or c10d._get_default_timeout(backend), "device_id": world.bound_device_id,
            "group_desc": world.group_desc}


def _register_native(name: str, pg: ProcessGroup) -> None:
    with contextlib.suppress(Exception):
        c10d._unregister_process_group(name)
    c10d._register_process_group(name, pg)
