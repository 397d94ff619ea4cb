"""Backend handling for ebbtide.comm: what a group's torch backend is (NCCL or Gloo), and how its communicators are
drained, torn down, connected and split. Functions over one inner torch ``ProcessGroup`` (or a list of them); they
know nothing of the journal's order or of the runtime's state.

What holds:
- Nothing here creates a CUDA context: device probes look only where CUDA is initialised already.
- A teardown frees the inner group's communicators now (not at garbage collection) and never raises: after the
  drain and the barrier nothing is in flight, so ``abort`` (local, immediate) and ``shutdown`` (``ncclCommFinalize``
  then destroy) are both safe; whichever was asked for is tried first, then the other.
- Teardowns of one split level may run concurrently (:func:`teardown_concurrently`, Note [Concurrent teardown]); a
  teardown still running after the timeout is logged by group name every period while it lasts.
- Before ``ProcessGroupNCCL::split`` runs on a parent, the parent has a rank map of its size
  (:func:`ensure_rank_map`, Note [A rebuilt WORLD has no rank map]).
"""
from __future__ import annotations

import contextlib
import copy
import datetime
import logging
import threading
import time

import torch
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import ProcessGroup

from .. import settings
from ..errors import StateError
from . import _strategy as S
from ._registry import _global_ranks

log = logging.getLogger("ebbtide.comm")

# How a destroyed NCCL backend is torn down. "shutdown" (ncclCommFinalize, then destroy) is the default: a concurrent
# release is faster with it than with "abort", whose cost is the proxy thread noticing the abort on its poll period, not
# work (Note [Concurrent teardown]; measured: docs/results.md, comm). "abort" stays available (local, needs no peer
# progress).
TEARDOWNS = ("shutdown", "abort")
DEFAULT_TEARDOWN = "shutdown"


def has_accelerator(g) -> bool:
    """The group has a device-collective backend (NCCL, XCCL, a plugin). Gloo also serves CUDA tensors, so device
    types alone do not tell; the backend configuration does ("cpu:gloo,cuda:nccl", "cuda:gloo", ...)."""
    if g is None:
        return False
    config = str(c10d._world.pg_backend_config.get(g, ""))
    backends = {part.split(":")[-1].strip().lower() for part in config.split(",") if part.strip()}
    return bool(backends - {"gloo", "mpi", "undefined", ""})


def local_choices(journal: list, requested: str, include_world: bool, include_cpu: bool) -> list:
    """(entry, strategy, reason) for every live group of ``journal`` this rank would release, from its own facts
    (release() combines the members' choices). Sets ``entry.initialized``: whether an op went through the group
    since its last (re)build (then its communicator exists, and reload connects it eagerly)."""
    out = []
    for e in journal:
        g = e.group
        if g is None or g._ebt_destroyed or g._ebt_inner is None:
            continue
        if e.kind == "world" and not include_world:
            continue
        choice, reason = S.select_strategy(S.Facts(accelerator=has_accelerator(g), include_cpu=include_cpu),
                                           requested)
        if choice == S.KEEP:
            continue
        e.initialized = g._ebt_used
        out.append((e, choice, reason))
    return out


def drain(groups: list, timeout: float) -> None:
    """Wait for the device work of these groups: a synchronize of every device they are bound to, and of the
    current device (where unbound groups run). A bare ``torch.cuda.synchronize()`` covers the current device
    only, so a group bound to another device would still have kernels running while it is torn down.

    Bounded: a collective whose peers never join (launched on one rank only, or a peer that died) never finishes,
    and neither would a plain synchronize. The synchronizes run on a helper thread; past ``timeout`` seconds this
    raises ``StateError`` naming the devices (the helper stays blocked until the work ends, harmlessly)."""
    if not groups:
        return
    devices = {g.bound_device_id for g in groups if g.bound_device_id is not None}
    with contextlib.suppress(Exception):
        devices.add(torch.device("cuda", torch.cuda.current_device()))
    if not devices:
        return
    finished = threading.Event()

    def sync_all():
        for dev in sorted(devices, key=str):
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(dev)
        finished.set()

    threading.Thread(target=sync_all, name="ebbtide-comm-drain", daemon=True).start()
    if not finished.wait(timeout):
        raise StateError(f"ebbtide.comm.release(): device work on {sorted(map(str, devices))} did not finish within "
                         f"{timeout:.0f} s (a collective waiting for peers that never joined it, or a kernel that "
                         "does not end); nothing was released and the groups are usable again")


def teardown(inner: ProcessGroup, how: str) -> None:
    """Free the inner group's communicators now (not at garbage collection). After the drain and the barrier
    nothing is in flight, so abort (local, immediate) is safe; shutdown also flushes (ncclCommFinalize)."""
    other = "shutdown" if how == "abort" else "abort"
    try:
        for method in (how, other):
            try:
                getattr(inner, method)()
                return
            except Exception as e:  # Gloo has no abort on some versions: try the other, then let GC free it
                log.debug("ebbtide.comm: %s failed on %s: %s", method, inner, e)
    finally:
        sever_split_from(inner)


def timed_teardown(inner: ProcessGroup, how: str, device: int | None = None) -> float:
    """``teardown`` timed. ``device``: make it this thread's CUDA device first, as on the one-at-a-time path (the
    caller's thread). A new thread starts on device 0; teardown code that saves and restores the current device
    around its own cudaSetDevice, unguarded by torch (torch guards the communicators it keys by device, not every
    path), would restore device 0, and since CUDA 12 cudaSetDevice creates that device's primary context: a
    context of every rank of a node on GPU 0. Defensive: not observed, and not checkable without GPUs."""
    if device is not None:
        with contextlib.suppress(Exception):
            torch.cuda.set_device(device)
    t = time.perf_counter()
    teardown(inner, how)
    return time.perf_counter() - t


# Note [Concurrent teardown]
#     One group's abort takes anything up to NCCL's 500 ms idle poll() timeout, with the phase of that period: NCCL's
#     proxy service thread notices the abort flag only when its poll times out; finalize+destroy is the communicator's
#     own work. One after another that adds up per group. Aborts of different communicators are independent, local
#     operations (NCCL is thread-safe across communicators; torch's abort/shutdown bindings drop the GIL), so one
#     release runs them concurrently, one thread per group, in waves by split level: every child is gone before the
#     parent it was split from (split-share children may use their parent's resources), WORLD last. All ranks derive the
#     same waves from the agreed journal. An abort is local; a shutdown's ncclCommFinalize waits for the communicator to
#     be globally quiescent, i.e. for the same group's other members, who run the same wave (or, one at a time, the same
#     reverse journal order restricted to their groups: Note [Ordering and deadlock freedom] in comm/NOTES.md), so
#     neither can deadlock overlapping groups. Concurrent finalizes beat concurrent aborts (which pay one poll period
#     per wave), hence DEFAULT_TEARDOWN (docs/results.md, comm).
#     ``install(concurrent_teardown=False)`` restores one-at-a-time, reverse journal order.
def teardown_concurrently(work: dict, how: str, tmo: datetime.timedelta, names: dict) -> dict:
    """Tear down ``work`` (key -> inner group) concurrently, one thread per group, on this thread's CUDA device (see
    :func:`timed_teardown`). ``names``: key -> group name for the log. Returns key -> seconds. A teardown still
    running after ``tmo`` is logged as an error, naming the groups, every ``tmo`` while it lasts: an abort cannot be
    interrupted, so this keeps waiting, but a hang is never silent."""
    from concurrent.futures import ThreadPoolExecutor, wait

    if len(work) == 1:
        ((key, inner),) = work.items()
        return {key: timed_teardown(inner, how)}
    dev = current_cuda_device()
    with ThreadPoolExecutor(max_workers=min(len(work), 64), thread_name_prefix="ebt-teardown") as pool:
        futs = {k: pool.submit(timed_teardown, inner, how, dev) for k, inner in work.items()}
        pending = set(futs.values())
        waited = 0.0
        step = max(tmo.total_seconds(), 0.001)
        while pending:
            _done, pending = wait(pending, timeout=step)
            if pending:
                waited += step
                slow = [names[k] for k, f in futs.items() if f in pending]
                log.error("ebbtide.comm: release: teardown of group(s) %s still running after %.0f s (a hung NCCL "
                          "abort/shutdown?); release cannot interrupt it and keeps waiting", slow, waited)
    return {k: f.result() for k, f in futs.items()}


def sever_split_from(inner: ProcessGroup) -> None:
    """Clear ``split_from`` in the options of a torn-down group's device backends (an owning pointer to the parent
    backend; with dist.split_group's default options it points at the group itself, a cycle that would keep the
    aborted backend alive forever)."""
    with contextlib.suppress(Exception):
        inner._get_backend(torch.device("cuda")).options.split_from = None


def replay_split_options(parent_inner: ProcessGroup, snap, parent_group):
    """Fresh options for replaying a split on the live parent (Note [Split options are not replayed] in
    ``_journal.py``): a copy of the live parent's, with the journaled scalar snapshot ``snap`` applied."""
    from ._journal import OptionsSnapshot

    dev = parent_inner.bound_device_id or (parent_group.bound_device_id if parent_group is not None else None)
    live = parent_inner._get_backend(dev).options
    try:
        fresh = copy.deepcopy(live)
    except Exception as err:  # older torch without Options.__deepcopy__: a default-constructed object
        log.debug("ebbtide.comm: cannot copy the parent's options (%s); using defaults", err)
        fresh = type(live)()
        OptionsSnapshot.take(live).apply(fresh)
    with contextlib.suppress(Exception):
        fresh.split_from = None  # split() sets it to the live parent; never carry an older one in
    if isinstance(snap, OptionsSnapshot):
        snap.apply(fresh)
    return fresh


# Note [A rebuilt WORLD has no rank map]
#     ProcessGroupNCCL::split maps the requested group ranks to global ranks with ``groupRanks()[rank]``.
#     ``groupRanks()`` returns ``options.global_ranks_in_group``, except for the *first* ProcessGroupNCCL of the
#     process (``local_id_ == 0``) when that list is empty: then a static 0..size-1 list. c10d creates WORLD with an
#     empty list, which works only because WORLD is normally the first NCCL group of the process. A WORLD rebuilt by
#     reload() is not (local ids count up for the life of the process), so its groupRanks() is empty and split()
#     would read past the end of an empty vector (a segfault). new_group children of a rebuilt WORLD never call
#     split() (they pass ``split_from`` + color from Python), so only dist.split_group children are exposed. The
#     rebuilt WORLD gets the identity map (what the static list holds, :func:`give_world_rank_map`), and every split
#     parent is checked before split() runs (:func:`ensure_rank_map`).
def ensure_rank_map(backend, parent, where: str) -> None:
    """Make sure ProcessGroupNCCL::split will find the parent's rank map (Note [A rebuilt WORLD has no rank
    map]); raise StateError where it cannot be given one."""
    opts = getattr(backend, "options", None)
    if opts is None or not hasattr(opts, "global_ranks_in_group"):
        return  # not a ProcessGroupNCCL-like backend: nothing to check
    size = parent.size()
    current = list(opts.global_ranks_in_group)
    if len(current) == size:
        return
    if current:
        # Not the crash this guards against (an empty map); torches whose dist.split_group hands split() the
        # parent's own options (no deepcopy) leave the last child's ranks here. Say so and let torch decide.
        log.warning("ebbtide.comm: %s: parent '%s' maps %d ranks (%s) but has %d; ProcessGroupNCCL::split reads "
                    "this map", where, parent._ebt_name, len(current), current, size)
        return
    wanted = _global_ranks(parent) or list(range(size))
    try:
        opts.global_ranks_in_group = wanted
        ok = list(opts.global_ranks_in_group) == wanted
    except Exception:
        ok = False
    if not ok:
        raise StateError(f"{where}: parent '{parent._ebt_name}' has no global rank map and none can be set; "
                         "ProcessGroupNCCL::split would read past an empty vector")
    log.debug("ebbtide.comm: gave split parent %s the rank map %s", parent._ebt_name, wanted)


def split_parent_ready(parent, name: str, rebuilt: set, connected: set) -> ProcessGroup:
    """The live inner of split group ``name``'s parent (a ReloadableGroup, None where unknown), checked against
    ProcessGroupNCCL::split's preconditions, so an unmet one is a StateError here and never a crash or a hang inside
    native code: the parent is live, has a splitting backend on the device and a bound device (ncclCommSplit needs
    the parent's communicator on it), and - when the parent was itself rebuilt by this reload (in ``rebuilt``) - its
    communicator exists on every parent rank (otherwise members would fall back to ncclCommInitRank while
    non-members' no-color split initialises the parent: the two never meet). ``connected``: rebuilt parents whose
    communicator exists; updated here."""
    where = f"ebbtide.comm.reload(): cannot rebuild split group '{name}'"
    if parent is None:
        raise StateError(f"{where}: its parent group is unknown on this rank")
    inner = parent._ebt_inner
    if inner is None:
        raise StateError(f"{where}: its parent '{parent._ebt_name}' is not live (released or destroyed)")
    dev = inner.bound_device_id or parent.bound_device_id
    if dev is None:
        raise StateError(f"{where}: its parent '{parent._ebt_name}' has no bound device; ncclCommSplit needs "
                         "one (init_process_group(device_id=...))")
    try:
        backend = inner._get_backend(dev)
    except Exception as err:
        raise StateError(f"{where}: parent '{parent._ebt_name}' has no backend on {dev}: {err}") from err
    if not getattr(backend, "supports_splitting", False):
        raise StateError(f"{where}: the backend of parent '{parent._ebt_name}' on {dev} cannot split")
    ensure_rank_map(backend, parent, where)
    if parent in rebuilt and parent not in connected:
        log.debug("ebbtide.comm: reload: connecting rebuilt parent %s before splitting it", parent._ebt_name)
        backend.eager_connect_single_device(dev)
        connected.add(parent)
    return inner


def give_world_rank_map(pg: ProcessGroup) -> None:
    """A rebuilt WORLD's NCCL backend gets the identity rank map (Note [A rebuilt WORLD has no rank map])."""
    with contextlib.suppress(Exception):
        dev = pg.bound_device_id or torch.device("cuda", torch.cuda.current_device())
        backend = pg._get_backend(dev)
        if not list(backend.options.global_ranks_in_group):
            backend.options.global_ranks_in_group = list(range(pg.size()))


def splitting_backend(inner: ProcessGroup, dev):
    """The inner group's backend on ``dev`` where it can split (NCCL), else None."""
    try:
        backend = inner._get_backend(dev)
    except Exception:
        return None  # c10d raises its own error for a group that cannot split
    return backend if getattr(backend, "supports_splitting", False) else None


def connect(inner: ProcessGroup, g) -> bool:
    """Create the NCCL communicator of ``inner`` (the live inner of wrapper ``g``) now: collective over the group's
    ranks, every member reaches this entry in journal order. Returns True when a connect was issued."""
    if not has_accelerator(g):
        return False  # Gloo connects its full mesh while it is constructed
    dev = g.bound_device_id
    if dev is None:
        if not torch.cuda.is_available():
            return False
        dev = torch.device("cuda", torch.cuda.current_device())
    try:
        backend = inner._get_backend(dev)
    except Exception:
        return False
    if not getattr(backend, "supports_splitting", False) or not hasattr(backend, "eager_connect_single_device"):
        return False
    try:
        backend.eager_connect_single_device(dev)
    except Exception as e:  # an optimisation only: the communicator is then created on first use
        log.warning("ebbtide.comm: eager connect of group %s failed (%s); it connects on first use", g._ebt_name, e)
        return False
    return True


# Note [Concurrent warm-up]
#     With NCCL's runtime connect (the default since 2.22) a rebuilt communicator is cheap to create and pays its
#     transport connect at its first collective, one group after another as user code reaches them.
#     NCCL_RUNTIME_CONNECT=0 only moves that cost into the (sequential) splits, and non-blocking init
#     (TORCH_NCCL_USE_COMM_NONBLOCKING=1) does not change it (measured: docs/results.md, comm). The connects are
#     host-side handshakes inside the first collective's call, so warming the groups from a thread each overlaps
#     them. But NCCL documents calls on independent communicators of one device from several threads at once as
#     unsafe, and it crashed here: a segmentation fault inside the threads' all_reduce calls in one of two runs of
#     an EP=2 MoE reload (NCCL 2.28.9). So the warm-up is serial by default: one thread, the groups in
#     one order every rank agrees on (sorted names), each collective on its own stream and all streams
#     synchronised at the end. A blocking connect may wait for a peer still finishing an earlier group of that
#     order, but that peer never waits back on a later one: the lowest unfinished group always has all its members
#     in it, so there is no cycle. EBBTIDE_COMM_WARMUP=concurrent brings the threads back, outside NCCL's
#     documented contract (and with CUDA_DEVICE_MAX_CONNECTIONS=1, which Megatron sets, threads that launch in
#     different orders on different ranks can also deadlock on the GPU); "off" leaves every connect to the
#     group's first use.
WARMUP = settings.declare("EBBTIDE_COMM_WARMUP", settings.parse_choice("serial", "concurrent", "off"), "serial",
                          "how an eager reload connects the rebuilt groups: one thread, in an order every rank "
                          "agrees on (serial); a thread per group (concurrent: faster, outside NCCL's "
                          "thread-safety contract); or not at all (off: each connects at its first use)")


def warm_up(groups: list, device: int | None) -> float:
    """Connect the transports of these (attached, device) groups now: one 1-element all_reduce per group (NCCL
    connects a communicator's transports at its first collective, not at init: Note [Concurrent warm-up]). Every
    member warms the same groups in the same order (the caller passes a set agreed on every rank; sorted here by
    name; each group's collective pairs up within the group), from this thread or, with
    ``EBBTIDE_COMM_WARMUP=concurrent``, a thread per group (``off``: nothing). A failure is logged, not raised:
    a connect that failed is tried again at the group's first use, where a lasting fault (a peer gone, a sticky
    CUDA error) raises or times out in the user's collective. ``device``: the caller's CUDA device, where groups
    without a bound device run (a fresh thread's current device would be 0). Returns the seconds spent, device
    work included."""
    how = settings.get(WARMUP)
    if not groups or how == "off":
        return 0.0
    t0 = time.perf_counter()
    default = torch.device("cuda", device if device is not None else 0)
    groups = sorted(groups, key=lambda g: g._ebt_name)

    def issue(g, set_device: bool):
        dev = g.bound_device_id or default
        if set_device:
            torch.cuda.set_device(dev)
        stream = torch.cuda.Stream(dev)  # its own: a sync then waits for this group's collective only
        with torch.cuda.stream(stream):
            x = torch.zeros(1, device=dev)
            c10d.all_reduce(x, group=g, async_op=True).wait()  # NCCL work: the stream waits for the kernel
        return stream

    def failed(g, e):  # an optimisation only
        log.warning("ebbtide.comm: warm-up of group %s failed (%s); it connects on first use", g._ebt_name, e)

    if how == "serial":
        streams = []
        for g in groups:
            try:
                streams.append((g, issue(g, False)))
            except Exception as e:
                failed(g, e)
        for g, st in streams:
            try:
                st.synchronize()
            except Exception as e:
                failed(g, e)
        return time.perf_counter() - t0

    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    with ThreadPoolExecutor(max_workers=min(len(groups), 64), thread_name_prefix="ebt-comm-warmup") as ex:
        futures = {ex.submit(lambda g=g: issue(g, True).synchronize()): g for g in groups}
        for f, g in futures.items():
            try:
                f.result()
            except Exception as e:
                failed(g, e)
    return time.perf_counter() - t0


def set_split_sequence_number(child: ProcessGroup, dev) -> None:
    with contextlib.suppress(Exception):
        child._get_backend(dev or torch.device("cuda"))._set_sequence_number_for_group()


def current_cuda_device() -> int | None:
    """The calling thread's CUDA device where CUDA is initialised (never initialises it)."""
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch.cuda.current_device()
    except Exception:
        pass
    return None


def reserved_mib() -> str:
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return f"{torch.cuda.memory_reserved() / 2**20:.0f}"
    except Exception:
        pass
    return "n/a"
