"""Megatron-core's process groups as ebbtide.comm groups: install before ``initialize_model_parallel``, release for
the rollout, reload after.

Policies:
- ``install_groups()`` is ``ebbtide.comm.install()`` plus a guard: it refuses (StateError) once Megatron's
  ``parallel_state`` holds groups, since those were made as plain torch groups and would stay unmanaged. Called
  before ``init_process_group`` every group (WORLD included) is reloadable; called after it, WORLD is adopted (see
  ebbtide.comm) and every group Megatron makes afterwards is reloadable.
- Every group Megatron creates goes through ``torch.distributed.new_group`` (its ``create_group`` wrapper and the
  Gloo twins alike), which ebbtide.comm hooks, so TP, PP, DP, CP, EP, embedding, position-embedding,
  model-parallel, the DP-with-CP groups and their Gloo twins all come back as ``ReloadableGroup`` objects that
  Megatron's module globals keep holding across release/reload.
- ``release_groups()`` frees the NCCL communicators; Gloo groups are kept (and keep working) unless
  ``include_cpu=True``. ``reload_groups()`` brings them back (``eager=False``: each connects on first use).
  Both are collective over WORLD, as ebbtide.comm's release/reload.
- ``check_groups()`` walks ``parallel_state``'s module globals and lists every group Megatron holds, raising
  StateError naming the ones that are not reloadable.
- ``gloo_twin(group)`` makes a Gloo group over the same ranks: the optimizer's scalar all-reduces (the grad norm,
  found-inf) go there, so they never wait for a released NCCL communicator to be rebuilt and connected inside the
  step (what that cost: docs/results.md, "Megatron-core adapter").
"""
from __future__ import annotations

import torch.distributed as dist

from ... import comm
from ...errors import StateError

__all__ = ["install_groups", "release_groups", "reload_groups", "check_groups", "megatron_groups", "gloo_twin"]


def _parallel_state():
    from megatron.core import parallel_state  # noqa: PLC0415

    return parallel_state


def install_groups(**comm_install_kwargs) -> list[str]:
    """Make every process group Megatron creates reloadable. Call it before
    ``parallel_state.initialize_model_parallel`` (best: before ``init_process_group``). Keyword arguments go to
    :func:`ebbtide.comm.install`; returns its list of warned NCCL variables. Idempotent."""
    ps = _parallel_state()
    if ps.model_parallel_is_initialized():
        held = megatron_groups()
        raise StateError("install_groups() must run before parallel_state.initialize_model_parallel(): Megatron "
                         f"already holds {len(held)} process group(s) made as plain torch groups "
                         f"({', '.join(sorted(held)[:6])}...), which release/reload would not manage. Call "
                         "destroy_model_parallel(), install_groups(), then initialize_model_parallel() again.")
    return comm.install(**comm_install_kwargs)


def release_groups(include_world: bool = False, *, include_cpu: bool = False, timeout: float | None = None,
                   wait: bool = True):
    """Free the communicators of every Megatron group (WORLD too with ``include_world``; Gloo groups too with
    ``include_cpu``). Collective. Returns ebbtide.comm's Report (a second call is a no-op report); with
    ``wait=False`` a Future of it, the teardown going on in the background (see :func:`ebbtide.comm.release`)."""
    _require_installed("release_groups")
    return comm.release(include_world, include_cpu=include_cpu, timeout=timeout, wait=wait)


def reload_groups(eager: bool = True, *, timeout: float | None = None):
    """Bring the released groups back (``eager=False``: communicators connect on first use). Collective."""
    _require_installed("reload_groups")
    return comm.reload(eager, timeout=timeout)


def _require_installed(what: str) -> None:
    if not comm.is_installed():
        raise StateError(f"{what}() needs install_groups() before initialize_model_parallel()")


def _groups_in(value):
    if isinstance(value, dist.ProcessGroup):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _groups_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _groups_in(v)


def megatron_groups() -> dict:
    """``{name: ProcessGroup}`` for every group Megatron's ``parallel_state`` holds (module globals such as
    ``_TENSOR_MODEL_PARALLEL_GROUP``; lists and dicts of groups get ``[i]``/``[key]`` suffixes)."""
    ps = _parallel_state()
    out = {}
    for name in sorted(vars(ps)):
        if not name.startswith("_") or "GROUP" not in name.upper() or name.startswith("__"):
            continue
        value = getattr(ps, name)
        found = list(_groups_in(value))
        if len(found) == 1 and isinstance(value, dist.ProcessGroup):
            out[name] = found[0]
        else:
            for i, g in enumerate(found):
                out[f"{name}[{i}]"] = g
    return out


def _backend(g) -> str:
    try:
        return str(dist.get_backend(g))
    except Exception:  # noqa: BLE001 (a released group answers through its wrapper; report what is known)
        return "unknown"


def check_groups() -> dict:
    """Every process group Megatron holds, as ``{name: {"reloadable": bool, "backend": str, "size": int}}``.
    Raises StateError naming the groups that are not ebbtide.comm groups (made before install_groups())."""
    report, plain = {}, []
    for name, g in megatron_groups().items():
        ok = isinstance(g, comm.ReloadableGroup)
        report[name] = {"reloadable": ok, "backend": _backend(g) if not comm.is_released() else "released",
                        "size": g.size()}
        if not ok:
            plain.append(name)
    if plain:
        raise StateError(f"{len(plain)} of Megatron's process groups are not reloadable (made before "
                         f"install_groups()): {', '.join(plain[:8])}")
    return report


def gloo_twin(group):
    """A Gloo group over ``group``'s ranks, or None where there is nothing to reduce (no process group, or
    ``group`` is this rank alone). Collective over WORLD: every rank calls it, and every rank's group is made by
    every rank, in one agreed order (``new_group``'s rule), so ranks of different groups (the model-parallel
    groups of a TP x DP grid) build their twins together."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return None
    mine = tuple(sorted(dist.get_process_group_ranks(group)))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    twin = None
    for ranks in sorted({tuple(r) for r in everyone if len(r) > 1}):
        g = dist.new_group(list(ranks), backend="gloo")
        if ranks == mine:
            twin = g
    return twin
