"""ebbtide.comm — reloadable process groups: free NCCL communicator memory between phases, get it back later,
while every ProcessGroup object the program holds stays valid.

Usage::

    import ebbtide.comm as comm
    comm.install()                                   # before init_process_group
    dist.init_process_group("nccl", device_id=dev)   # WORLD, new_group, new_subgroups, split_group, DeviceMesh,
    tp = dist.new_group([0, 1])                      # Megatron parallel_state ... are all reloadable
    ...
    rep = comm.release()                             # collective: every rank calls it
    print(rep.summary())                             # per-group strategy, bytes freed, seconds
    ...                                              # (using a released group raises ebbtide.StateError)
    comm.reload()                                    # eager: communicators are back, barrier passed
    with comm.released(include_world=True):          # the same as a context manager
        rollout()

Contract:
- install() before ``init_process_group`` makes every group reloadable, WORLD included. install() after it adopts
  WORLD (references to the WORLD object taken earlier are not managed) and leaves earlier subgroups alone.
- release(), reload() and released() are collective over WORLD: all ranks, same order, same arguments. They are
  idempotent (a repeated call returns a report with ``noop=True``), thread-safe (one lock) and fork-safe (a
  child starts empty). ``release(wait=False)`` leaves the teardown to a background thread and returns a Future of
  the report; reload() and group creation go ahead beside it, and the next release() and uninstall() join it
  first, raising its failure as StateError.
- Strategy per group, chosen at run time and reported: "auto" (the default) destroys and rebuilds every device
  group. CPU-only (Gloo) groups are kept unless ``include_cpu=True``. Native NCCL suspend/resume is not selectable
  (``install(strategy="suspend")`` raises UnsupportedError): it has not run on a GPU yet; its design is in
  docs/comm.md.
- A group destroyed with ``dist.destroy_process_group`` (also while released) stays destroyed; using it raises
  StateError naming it.
- The rendezvous store is the control plane: whoever reaches it can forge its keys. :func:`serve_store` serves one
  that listens on loopback unless another address is named.
- Creating groups while released raises StateError. CUDA graphs that captured collectives must be recaptured after
  a destroy-and-rebuild reload.
- DeepEP: every ``deep_ep.Buffer`` built after install() (Megatron-core's flex dispatcher buffer included) is freed
  by release() and rebuilt in place by reload(): the same object, its NVLink buffer back; using it while released
  raises StateError. One built before install() needs :func:`track_deepep` (and ``explicitly_destroy=True``).
  How and why: ``_deepep.py``; docs/comm.md.
"""
from __future__ import annotations

import contextlib
from concurrent.futures import Future

from ._backend import DEFAULT_TEARDOWN, TEARDOWNS
from ._deepep import track as track_deepep
from ._group import ReloadableGroup
from ._report import GroupReport, Report
from ._runtime import RUNTIME as _RT
from ._store import serve_store
from ._strategy import DESTROY, KEEP, Facts, env_warnings, select_strategy

__all__ = [
    "install", "uninstall", "release", "reload", "released", "is_installed", "is_released", "generation",
    "track_deepep", "ReloadableGroup", "Report", "GroupReport", "Facts", "select_strategy", "env_warnings",
    "DESTROY", "KEEP", "TEARDOWNS", "DEFAULT_TEARDOWN", "serve_store",
]


def install(*, strategy: str = "auto", teardown: str = DEFAULT_TEARDOWN, timeout: float | None = None,
            check_env: bool = True, concurrent_teardown: bool = True) -> list[str]:
    """Hook c10d group creation so every group becomes reloadable. Idempotent; call it before
    ``init_process_group``. ``strategy``: "auto" or "destroy", both destroy-and-rebuild ("suspend", native NCCL
    suspend/resume, raises UnsupportedError: not selectable until it has run on a GPU). ``teardown``: how destroyed
    NCCL backends go, "shutdown" (default: ncclCommFinalize, then destroy; faster than abort for a concurrent
    release, docs/comm.md) or "abort" (local; safe because release() drains and barriers first).
    ``timeout``: seconds for control-plane barriers (default ``EBBTIDE_COMM_TIMEOUT`` or 300).
    ``concurrent_teardown``: tear the released groups down concurrently, one thread per group, children before
    the group they were split from (default); False: one at a time in reverse creation order. Warns about NCCL
    settings that defeat release and returns the names of the variables it warned about."""
    return _RT.install(strategy=strategy, teardown=teardown, timeout=timeout, check_env=check_env,
                       concurrent_teardown=concurrent_teardown)


def uninstall() -> None:
    """Undo install(): new groups are plain torch groups again; existing wrappers keep working."""
    _RT.uninstall()


def release(include_world: bool = False, *, include_cpu: bool = False, timeout: float | None = None,
            wait: bool = True) -> Report | Future:
    """Free the communicators of every managed group (WORLD too with ``include_world``; Gloo-only groups too with
    ``include_cpu``). Collective. Returns a :class:`Report`; a second call without reload() is a no-op.

    ``wait=False``: return once the ranks have agreed and the groups are detached (their ops raise StateError
    from then on); the teardowns go on in a background thread, and the call returns a
    ``concurrent.futures.Future`` of the Report, done when this rank's teardowns are (its memory is back then; a
    peer's mappings of it go with the peer's own teardowns). reload() does not wait for it: new communicators are
    made while the old ones finish. The next release() (on every rank, before it changes anything) and uninstall()
    wait for it and raise its failure as StateError naming the cause; it is also logged when it happens."""
    return _RT.release(include_world=include_world, include_cpu=include_cpu, timeout=timeout, wait=wait)


def reload(eager: bool = True, *, timeout: float | None = None, warm: bool = True) -> Report:
    """Bring released groups back. ``eager``: create every communicator that existed before release now (in
    journal order), so the first collective pays no init; otherwise they are created on first use. ``warm`` (with
    ``eager``): also connect their transports now (one 1-element all_reduce per group; from this
    thread in an order every rank agrees on, or from a thread per group with ``EBBTIDE_COMM_WARMUP=concurrent``,
    or not at all with ``off``), so the first collective pays no connect either (NCCL connects at first use).
    Collective; ends with a barrier. A call while nothing is released is a no-op."""
    return _RT.reload(eager=eager, timeout=timeout, warm=warm)


@contextlib.contextmanager
def released(include_world: bool = False, *, include_cpu: bool = False, eager: bool = True,
             timeout: float | None = None):
    """``with released(): ...`` releases on entry and reloads on exit (also on an exception). Yields the release
    report; its ``reload`` field holds the reload report after the block."""
    rep = release(include_world, include_cpu=include_cpu, timeout=timeout)
    try:
        yield rep
    finally:
        rep.reload = reload(eager, timeout=timeout)


def is_installed() -> bool:
    return _RT.installed


def is_released() -> bool:
    return _RT.state == "released"


def generation() -> int:
    """Number of completed reloads since the current WORLD was created."""
    return _RT.generation
