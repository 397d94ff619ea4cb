"""ebbtide.comm runtime: the replay journal, the release/reload state machine, and the c10d hooks.

Policies (the caller's contract is in ``__init__.py``):
- One creation chokepoint is hooked: c10d's ``_new_process_group_helper`` (used by ``init_process_group``,
  ``new_group``, ``new_subgroups*`` and DeviceMesh), plus ``ProcessGroup.split_group`` on our wrappers (used by
  ``dist.split_group``). Every call is journaled in order with all its arguments, including calls on ranks that are
  not members (they matter: with a bound device, non-members take part in ``ncclCommSplit``).
- Every journaled group is returned to the user as a :class:`ReloadableGroup` registered in c10d under the group's
  own name; the torch group doing the work is its *inner*. See Note [Why a wrapper].
- release() and reload() are collective over WORLD: every rank calls them, in the same order, with the same
  arguments. They are idempotent (a repeated call returns a no-op report) and serialised by one lock.
- Order of release: detach the inners (ops now raise StateError) -> drain the device -> agree on the CPU control
  plane (journal hash, options, per-group strategy) -> tear down or suspend in reverse journal order (children
  before the WORLD they were split from, as c10d does; a global order, so overlapping groups never wait on each
  other in a cycle: the PP=4 deadlock of one-by-one destroys cannot happen; teardowns of one split level run
  concurrently, see Note [Concurrent teardown]) -> trailing barrier (peers' mappings of our buffers are gone too).
- Order of reload: agree (journal hash, which communicators existed) -> rebuild WORLD first (subgroups split from
  it) -> every journal entry in order, with a fresh store prefix per generation (``<name>.ebt<gen>``) -> eager
  connect of communicators that existed before release, except where replaying the creation connected them already
  (split children, device-bound groups: ``_creation_connects``) -> trailing barrier, so no rank races into a
  collective a peer has not rebuilt yet.
- The control plane is the rendezvous store (never released); its barriers time out naming the missing ranks.
- Fork: a child process starts with an empty journal and a fresh lock (groups inherited through fork are not
  usable there anyway).

Note [Why a wrapper]
    torch's ProcessGroup keeps one backend per backend *type* and never replaces it (``setBackend`` reuses an
    existing entry), and Python cannot construct a c10d ``Backend``; so a rebuilt NCCL backend cannot be put back
    into the user's original object. The wrapper is a real ProcessGroup subclass registered under the original
    name, so identity, rank helpers and name lookups stay stable; the native name registry points at the live inner
    so functional collectives and compiled graphs run on it without Python in the way.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import inspect
import json
import logging
import os
import re
import threading
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import ProcessGroup

from ..errors import InvalidArgumentError, StateError
from . import _strategy as S
from ._control import ControlPlane
from ._group import ReloadableGroup
from ._registry import _forget_registration, _global_ranks, _move_registration, _register_native
from ._report import GroupReport, Report, device_free_bytes

log = logging.getLogger("ebbtide.comm")

READY = "ready"
RELEASED = "released"
GONE = "gone"  # exchange marker: a member destroyed the group itself

_DEFAULT_TIMEOUT_S = float(os.environ.get("EBBTIDE_COMM_TIMEOUT", "300"))
_HEX40 = re.compile(r"^[0-9a-f]{40}$")


def _torch_version() -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _nccl_version() -> tuple[int, int, int] | None:
    try:
        if not torch.cuda.is_available():
            return None
        v = torch.cuda.nccl.version()
        return tuple(int(x) for x in v[:3]) if isinstance(v, tuple) else (v // 1000, v % 1000 // 100, v % 100)
    except Exception:
        return None


def _device_kind(dev) -> str:
    """Each rank binds its own GPU (cuda:0 on one, cuda:1 on the next): only the device type is rank-invariant."""
    if dev is None:
        return ""
    return getattr(dev, "type", None) or str(dev).split(":")[0]


def _td(t) -> str:
    return "" if t is None else f"{t.total_seconds():g}"


@dataclasses.dataclass(eq=False)  # identity semantics: entries are dict keys
class Entry:
    """One journaled creation call. ``call`` holds the arguments replayed on reload."""

    kind: str  # "world", "group" or "split"
    name: str  # c10d name at creation (the wrapper keeps it forever)
    ranks: tuple  # "world"/"group": global ranks (() for WORLD); "split": the ranks passed to split_group
    call: dict
    group: ReloadableGroup | None  # None on non-members
    local_sync: bool = False  # created by members only (new_group(use_local_synchronization=True))
    parent: ReloadableGroup | None = None  # split parent
    gidx: int = -1  # position among entries every rank has (non-local); -1 for local entries
    plan: str | None = None  # strategy agreed at release; None while live / when not released
    reason: str = ""
    initialized: bool = False  # a communicator existed at release (so reload connects it eagerly)
    freed: int | None = None

    def signature(self) -> str:
        """Rank-invariant description, hashed for the cross-rank agreement check."""
        c = self.call
        if self.kind == "split":
            parent = self.parent._ebt_name if self.parent else "?"
            return f"split|{parent}|{c.get('group_desc')}|{_td(c.get('timeout'))}"
        opts = c.get("backend_options")
        return "|".join([self.kind, ",".join(map(str, self.ranks)), str(c.get("backend")), _td(c.get("timeout")),
                         str(c.get("group_desc")), type(opts).__name__ if opts is not None else "",
                         _device_kind(c.get("device_id")), self.name])


# How a destroyed NCCL backend is torn down. "shutdown" (ncclCommFinalize, then destroy) is the default: measured
# on 2x H200 / NCCL 2.28.9 (2026-11-22 and -23), a concurrent release of WORLD's 7 subgroups took 0.51 s with it
# against 0.96-1.00 s with "abort", whose cost is the proxy thread noticing on its poll period, not work; the
# 10-cycle soak ran with it (0 drift). "abort" stays available (local, needs no peer progress).
TEARDOWNS = ("shutdown", "abort")
DEFAULT_TEARDOWN = "shutdown"


class Runtime:
    """Process-wide state. One instance (``RUNTIME``); every public entry point takes ``lock``."""

    def __init__(self):
        self.lock = threading.RLock()  # guards everything below
        self.pid = os.getpid()
        self.installed = False
        self.strategy = "auto"  # requested: "auto", "suspend", "destroy"
        self.teardown = DEFAULT_TEARDOWN  # how a destroyed NCCL backend is torn down: "abort" or "shutdown"
        self.concurrent_teardown = True  # see Note [Concurrent teardown]
        self.timeout = datetime.timedelta(seconds=_DEFAULT_TIMEOUT_S)
        self.state = READY
        self.generation = 0
        self.journal: list[Entry] = []
        self.world: ReloadableGroup | None = None
        self.store = None  # WORLD's rendezvous store (PrefixStore "default_pg"), the control plane's home
        self.control: ControlPlane | None = None
        self.replaying = False  # our own rebuild calls pass through the hooks
        self.inner_to_wrapper: dict = {}  # live inner -> wrapper, for Python-side name resolution
        self.orig: dict = {}  # (module, attribute) -> original object, restored by uninstall()
        self.helper_sig: inspect.Signature | None = None
        self.last_release: Report | None = None
        self._rebuilt_now: set = set()  # wrappers rebuilt by the reload in progress
        self._connected_now: set = set()  # ... of which the communicator exists now

    # ---- install / uninstall ------------------------------------------------------------------------------
    def install(self, *, strategy: str, teardown: str, timeout: float | None, check_env: bool,
                concurrent_teardown: bool = True) -> list[str]:
        if strategy not in S.REQUESTS:
            raise InvalidArgumentError(f"strategy must be one of {S.REQUESTS}, not {strategy!r}")
        if teardown not in TEARDOWNS:
            raise InvalidArgumentError(f"teardown must be one of {TEARDOWNS}, not {teardown!r}")
        if timeout is not None and not timeout > 0:
            raise InvalidArgumentError(f"timeout must be > 0 seconds, not {timeout!r}")
        with self.lock:
            self._check_pid()
            self.strategy, self.teardown = strategy, teardown
            self.concurrent_teardown = bool(concurrent_teardown)
            if timeout is not None:
                self.timeout = datetime.timedelta(seconds=float(timeout))
            warned: list[str] = []
            if check_env:
                for var, msg in S.env_warnings(os.environ, _nccl_version(), _torch_version()):
                    warnings.warn(f"ebbtide.comm: {msg}", RuntimeWarning, stacklevel=3)
                    warned.append(var)
            if self.installed:
                return warned
            self.helper_sig = inspect.signature(c10d._new_process_group_helper)
            self._patch(c10d, "_new_process_group_helper", self._hooked_helper)
            for mod in self._modules_with("batch_isend_irecv"):
                self._patch(mod, "batch_isend_irecv", _batch_isend_irecv)
            for mod in self._modules_with("split_group"):
                self._patch(mod, "split_group", _split_group)
            for mod in self._modules_with("_resolve_process_group"):
                self._patch(mod, "_resolve_process_group", _resolve_process_group)
            self.installed = True
            if dist.is_available() and dist.is_initialized() and not isinstance(c10d._world.default_pg,
                                                                                 ReloadableGroup):
                self._adopt_existing_world()
            return warned

    def uninstall(self) -> None:
        """Restore c10d's functions. Existing wrappers keep working; new groups are plain torch groups."""
        with self.lock:
            if self.state != READY:
                raise StateError("ebbtide.comm.uninstall(): groups are released; reload() first")
            for (mod, attr), obj in self.orig.items():
                setattr(mod, attr, obj)
            self.orig.clear()
            self.installed = False

    @staticmethod
    def _modules_with(attr: str):
        import sys

        names = ("torch.distributed.distributed_c10d", "torch.distributed", "torch.distributed.device_mesh",
                 "torch.distributed.tensor._collective_utils")
        for n in names:
            mod = sys.modules.get(n)
            if mod is not None and hasattr(mod, attr):
                yield mod

    def _patch(self, mod, attr: str, new) -> None:
        key = (mod, attr)
        if key not in self.orig:
            self.orig[key] = getattr(mod, attr)
        setattr(mod, attr, new)

    def original(self, attr: str):
        return self.orig[(c10d, attr)]

    def _check_pid(self) -> None:
        if os.getpid() != self.pid:  # register_at_fork normally resets first; this covers exotic forks
            self._reset_after_fork()

    def _reset_after_fork(self) -> None:
        self.lock = threading.RLock()
        self.pid = os.getpid()
        self.state, self.generation, self.journal = READY, 0, []
        self.world, self.store, self.control = None, None, None
        self.inner_to_wrapper = {}
        self.replaying = False

    def _reset_journal(self) -> None:
        self.state, self.generation, self.journal = READY, 0, []
        self.world, self.store, self.control = None, None, None
        self.inner_to_wrapper = {}

    # ---- creation hooks -----------------------------------------------------------------------------------
    def _hooked_helper(self, *args, **kwargs):
        orig = self.original("_new_process_group_helper")
        if self.replaying or not self.installed:
            return orig(*args, **kwargs)
        with self.lock:
            self._check_pid()
            bound = self.helper_sig.bind(*args, **kwargs)
            call = dict(bound.arguments)
            ranks = tuple(call.get("global_ranks_in_group") or ())
            is_world = len(ranks) == 0
            if is_world:
                self._reset_journal()  # a new WORLD starts a new history (init after destroy)
            elif self.state != READY:
                raise StateError("ebbtide.comm: cannot create a process group while groups are released; "
                                 "call ebbtide.comm.reload() first")
            pg, store = orig(*args, **kwargs)
            name = str(call.get("group_name"))
            local = (not is_world) and bool(_HEX40.match(name))
            if pg is None or pg == c10d.GroupMember.NON_GROUP_MEMBER:
                self._append(Entry("group", name, ranks, call, None, local_sync=local))
                return pg, store
            if type(pg) is not ProcessGroup:  # custom Python groups (fake/threaded backends): not ours to manage
                return pg, store
            wrapper = ReloadableGroup(pg, name=pg.group_name, desc=pg.group_desc, index=len(self.journal),
                                      runtime=self)
            _move_registration(pg, wrapper)
            self.inner_to_wrapper[pg] = wrapper
            self._append(Entry("world" if is_world else "group", name, ranks, call, wrapper, local_sync=local))
            if is_world:
                self.world = wrapper
                self.store = call.get("store")
            return wrapper, store

    def _append(self, e: Entry) -> None:
        if not e.local_sync:
            e.gidx = sum(1 for x in self.journal if not x.local_sync)
        self.journal.append(e)

    def split_from(self, parent: ReloadableGroup, ranks, args, kwargs):
        """ReloadableGroup.split_group: split the parent's live inner, journal the call, wrap the child."""
        with self.lock:
            self._check_pid()
            if self.state != READY or parent._ebt_inner is None:
                raise parent._ebt_released_error("split_group")
            dev = parent._ebt_inner.bound_device_id or parent.bound_device_id
            if dev is not None:  # a new split of a rebuilt WORLD needs its rank map too
                try:
                    backend = parent._ebt_inner._get_backend(dev)
                except Exception:
                    backend = None  # c10d raises its own error for a group that cannot split
                if backend is not None and getattr(backend, "supports_splitting", False):
                    _ensure_rank_map(backend, parent, f"split_group of '{parent._ebt_name}'")
            child = parent._ebt_inner.split_group(ranks, *args, **kwargs)
            call = {"args": args, "kwargs": dict(kwargs)}
            call.update({k: kwargs.get(k) for k in ("timeout", "group_desc")})
            if call["kwargs"].get("opts") is not None:
                # Never journal the native Options object: see Note [Split options are not replayed].
                call["kwargs"]["opts"] = _OptionsSnapshot.take(call["kwargs"]["opts"])
            if child is None:
                self._append(Entry("split", str(kwargs.get("group_name")), tuple(ranks), call, None, parent=parent))
                return None
            wrapper = ReloadableGroup(child, name=child.group_name, desc=child.group_desc, index=len(self.journal),
                                      runtime=self)
            self.inner_to_wrapper[child] = wrapper
            self._append(Entry("split", child.group_name, tuple(ranks), call, wrapper, parent=parent))
            return wrapper

    def user_destroyed(self, g: ReloadableGroup, how: str) -> None:
        """dist.destroy_process_group reached a wrapper: tear its inner down and forget the group."""
        with self.lock:
            if g is self.world:
                # c10d is destroying every group and will clear its registries. Children first (reverse journal
                # order, as c10d shuts groups down), then WORLD they were split from; start over at the next init.
                for e in reversed(self.journal):
                    if e.group is not None and e.group is not g and not e.group._ebt_destroyed:
                        self.user_destroyed(e.group, how)
            inner = g._ebt_inner if g._ebt_inner is not None else g._ebt_held
            g._ebt_inner, g._ebt_held, g._ebt_destroyed = None, None, True
            self.inner_to_wrapper.pop(inner, None)
            if inner is not None:
                try:
                    getattr(inner, how)()
                except Exception as e:  # destroying is best effort, as in c10d
                    log.warning("ebbtide.comm: %s of group %s failed: %s", how, g._ebt_name, e)
            if g is self.world:
                self._reset_journal()

    def _adopt_existing_world(self) -> None:
        """install() after init_process_group: wrap the existing WORLD so it can be released too."""
        world = c10d._world.default_pg
        backend, prefix_store = c10d._world.pg_map[world]
        store = getattr(prefix_store, "underlying_store", prefix_store)
        timeout = None
        for dev in world._device_types:
            with contextlib.suppress(Exception):
                timeout = world._get_backend(dev).options._timeout
                break
        call = {"group_size": world.size(), "group_rank": world.rank(), "global_ranks_in_group": [],
                "backend": backend, "store": store, "group_name": world.group_name,
                "timeout": timeout or c10d._get_default_timeout(backend), "device_id": world.bound_device_id,
                "group_desc": world.group_desc}
        others = [pg for pg in c10d._world.pg_map if pg is not world]
        self._reset_journal()
        wrapper = ReloadableGroup(world, name=world.group_name, desc=world.group_desc, index=0, runtime=self)
        _move_registration(world, wrapper)
        c10d._world.default_pg = wrapper
        self.inner_to_wrapper[world] = wrapper
        self._append(Entry("world", world.group_name, (), call, wrapper))
        self.world, self.store = wrapper, store
        if others:
            warnings.warn(f"ebbtide.comm.install() ran after {len(others)} process group(s) were created; those "
                          "stay plain torch groups and are never released. Call install() before "
                          "init_process_group to manage every group (WORLD was adopted; references to the "
                          "old WORLD object taken before install() are not managed).", RuntimeWarning, stacklevel=4)

    # ---- release ------------------------------------------------------------------------------------------
    def release(self, *, include_world: bool, include_cpu: bool, timeout: float | None) -> Report:
        t0 = time.perf_counter()
        with self.lock:
            self._check_pid()
            self._require_installed("release")
            if self.state == RELEASED:
                return Report("release", True, self.generation, time.perf_counter() - t0, 0.0, None, None)
            tmo = self._timeout(timeout)
            control = self._control()
            free_before = device_free_bytes()
            local = self._local_choices(include_world, include_cpu)
            # 1. Detach: from here every op on a target raises StateError instead of reaching NCCL.
            detached = {}
            for e, _choice, _reason in local:
                g = e.group
                detached[e] = g._ebt_inner
                g._ebt_inner, g._ebt_released_by = None, "pending"
            # 2. Drain outstanding device work (NCCL kernels run on internal streams; a device sync covers them).
            log.debug("ebbtide.comm: release: detached %s", [e.group._ebt_name for e in detached])
            _drain([e.group for e in detached if _has_accelerator(e.group)])
            log.debug("ebbtide.comm: release: drained; agreeing on the control plane")
            # 3. Agree: same journal, same options; each group's strategy is the weakest of its members' choices.
            payload = {"journal": self._journal_hash(), "opts": [include_world, include_cpu],
                       "choices": {str(e.gidx): c for e, c, _ in local if e.gidx >= 0},
                       "gone": [e.gidx for e in self.journal if e.group is not None and e.group._ebt_destroyed]}
            tb = time.perf_counter()
            try:
                everyone = self._exchange(control, "release", payload, tmo)
                self._check_agreement(everyone, "release")
                if len({json.dumps(p["opts"]) for p in everyone}) != 1:
                    raise StateError("ebbtide.comm.release(): ranks passed different include_world/include_cpu "
                                     f"arguments: {[p['opts'] for p in everyone]}")
            except BaseException:
                for e, inner in detached.items():  # nothing was torn down: put everything back
                    e.group._ebt_inner, e.group._ebt_released_by = inner, None
                raise
            barrier_s = time.perf_counter() - tb
            plans = _combine_plans(everyone)
            # 4. Tear down / suspend in reverse journal order: children before the group they were split from
            #    (as c10d's destroy_process_group does); one global order, so no cross-group wait cycle.
            log.debug("ebbtide.comm: release: agreed (%.3f s); plans %s", barrier_s, plans)
            reasons = {e: r for e, _c, r in local}
            choices = {e: c for e, c, _r in local}
            todo = []
            for e in reversed(self.journal):
                if e.local_sync:
                    e.plan = S.DESTROY if e in detached else None
                else:
                    e.plan = plans.get(e.gidx)
                if e.plan in (None, S.KEEP):
                    e.plan = None
                    if e in detached:  # agreed to keep after all: reattach
                        e.group._ebt_inner, e.group._ebt_released_by = detached[e], None
                    continue
                if e not in detached:
                    continue  # non-member (or a member that did not target it: impossible after agreement)
                e.reason = reasons.get(e, "")
                if e.plan != choices[e]:
                    e.reason = f"{choices[e]} here, {e.plan} on a peer: {e.reason}"
                todo.append(e)
            reports = self._release_all(todo, detached, tmo)
            reports.reverse()  # report in journal order
            for e in detached:
                if e.plan is not None:
                    # Name lookups now reach the wrapper, whose ops raise StateError.
                    _register_native(e.group._ebt_name, e.group)
            self.state = RELEASED  # before the barrier: a timeout there leaves a consistent RELEASED state
            # 5. Trailing barrier: return when every rank has torn down. NCCL's peer buffers are cuMem allocations
            #    exported by one rank and mapped by the others: the pages go only when every mapper has let go, so
            #    a rank that measures (or allocates) before its peers finish sees part of its memory still held.
            tb2 = time.perf_counter()
            control.barrier("released", tmo)
            barrier_s += time.perf_counter() - tb2
            rep = Report("release", False, self.generation, time.perf_counter() - t0, barrier_s, free_before,
                         device_free_bytes(), reports)
            self.last_release = rep
            log.info("%s", rep.summary())
            log.debug("ebbtide.comm: release: torch caching allocator reserved %s MiB after release (not ours: "
                      "NCCL memory never goes through it)", _reserved_mib())
            return rep

    def _local_choices(self, include_world: bool, include_cpu: bool):
        tv, nv = _torch_version(), _nccl_version()
        cumem = S.cumem_enabled(os.environ, nv)
        split_share_env = os.environ.get("NCCL_COMM_SPLIT_SHARE_RESOURCES", "").strip() == "1"
        out = []
        for e in self.journal:
            g = e.group
            if g is None or g._ebt_destroyed or g._ebt_inner is None:
                continue
            if e.kind == "world" and not include_world:
                continue
            facts = _facts(g, tv, nv, cumem, split_share_env, include_cpu)
            choice, reason = S.select_strategy(facts, self.strategy)
            if e.local_sync and choice == S.SUSPEND:  # members of local groups cannot be agreed on: destroy
                choice, reason = S.DESTROY, "local-synchronization group"
            if choice == S.KEEP:
                continue
            e.initialized = facts.comm_initialized or g._ebt_used
            out.append((e, choice, reason))
        return out

    def _release_all(self, todo: list[Entry], detached: dict, tmo: datetime.timedelta | None = None
                     ) -> list[GroupReport]:
        """Suspend or tear down ``todo`` (reverse journal order). With ``install(concurrent_teardown=False)``: one
        at a time in that order. Otherwise in waves by split level, deepest first, WORLD last (see Note
        [Concurrent teardown]); inside a wave the suspends (collective) run one at a time in reverse journal order,
        then the wave's teardowns run concurrently. Either way every child is handled before the group it was
        split from, whatever the two plans are (a suspended parent must not lose resources a child being aborted
        after it may still share), and every rank follows the same order."""
        if not self.concurrent_teardown:
            return [self._release_one(e, detached[e]) for e in todo]
        reports: dict[Entry, GroupReport] = {}
        by_group = {x.group: x for x in self.journal if x.group is not None}
        waves: dict[int, list[Entry]] = {}
        for e in todo:
            waves.setdefault(self._depth(e, by_group), []).append(e)
        for level in sorted(waves, reverse=True):
            destroy = []
            for e in waves[level]:
                if e.plan == S.SUSPEND:
                    reports[e] = self._release_one(e, detached[e])  # falls back to destroy itself on failure
                else:
                    destroy.append(e)
            if destroy:
                self._destroy_wave(level, destroy, detached, reports, tmo or self.timeout)
        return [reports[e] for e in todo]

    def _depth(self, e: Entry, by_group: dict) -> int:
        """Split level: WORLD 0; new_group groups 1 (ncclCommSplit children of a bound WORLD, or independent);
        a split_group child one below its parent."""
        if e.kind == "world":
            return 0
        if e.kind == "split" and e.parent is not None and e.parent in by_group:
            return 1 + self._depth(by_group[e.parent], by_group)
        return 1

    def _destroy_wave(self, level: int, wave: list[Entry], detached: dict, reports: dict,
                      tmo: datetime.timedelta) -> None:
        """Tear down the groups of one split level concurrently, one thread per group. The workers run on this
        thread's CUDA device (a new thread starts on device 0: see _timed_teardown). A teardown still running
        after ``tmo`` is logged as an error, naming the groups, every ``tmo`` while it lasts: an abort cannot be
        interrupted, so release keeps waiting, but a hang is never silent."""
        before = device_free_bytes()
        t0 = time.perf_counter()
        log.debug("ebbtide.comm: release: %s %d group(s) concurrently (split level %d): %s", self.teardown,
                  len(wave), level, [e.group._ebt_name for e in wave])
        for e in wave:
            self.inner_to_wrapper.pop(detached[e], None)
        if len(wave) == 1:
            secs = {wave[0]: _timed_teardown(detached[wave[0]], self.teardown)}
        else:
            from concurrent.futures import ThreadPoolExecutor

            dev = _current_cuda_device()
            with ThreadPoolExecutor(max_workers=min(len(wave), 64), thread_name_prefix="ebt-teardown") as pool:
                futs = {e: pool.submit(_timed_teardown, detached[e], self.teardown, dev) for e in wave}
                _report_slow_teardowns(futs, tmo)
            secs = {e: f.result() for e, f in futs.items()}
        after = device_free_bytes()
        freed = None if before is None or after is None else after - before
        log.debug("ebbtide.comm: release: wave at split level %d done in %.3f s (slowest group %.3f s), device "
                  "free %+.0f MiB", level, time.perf_counter() - t0, max(secs.values()),
                  (freed or 0) / 2**20)
        for e in wave:  # per-group bytes are not separable in a wave
            reports[e] = _released(e, secs[e], freed if len(wave) == 1 else None)

    def _release_one(self, e: Entry, inner: ProcessGroup) -> GroupReport:
        g = e.group
        t = time.perf_counter()
        log.debug("ebbtide.comm: release: %s group %s (%s)", e.plan, g._ebt_name, g._ebt_desc)
        before = device_free_bytes()
        if e.plan == S.SUSPEND:
            try:
                _suspend_backend(inner)
                g._ebt_held = inner
            except Exception as err:  # fall back to destroying it; reload() makes the peers agree (see there)
                log.warning("ebbtide.comm: suspend of group %s failed (%s); destroying it instead", g._ebt_name, err)
                e.plan, e.reason = S.DESTROY, f"suspend failed: {err}"
        if e.plan != S.SUSPEND:
            self.inner_to_wrapper.pop(inner, None)
            _teardown(inner, self.teardown)
            del inner
        after = device_free_bytes()
        return _released(e, time.perf_counter() - t, None if before is None or after is None else after - before)

    # ---- reload -------------------------------------------------------------------------------------------
    def reload(self, *, eager: bool, timeout: float | None) -> Report:
        t0 = time.perf_counter()
        with self.lock:
            self._check_pid()
            self._require_installed("reload")
            if self.state != RELEASED:
                return Report("reload", True, self.generation, time.perf_counter() - t0, 0.0, None, None)
            tmo = self._timeout(timeout)
            control = self._control()
            free_before = device_free_bytes()
            payload = {"journal": self._journal_hash(), "eager": bool(eager),
                       "connect": [e.gidx for e in self.journal if e.gidx >= 0 and e.plan and e.initialized],
                       "plans": {str(e.gidx): e.plan for e in self.journal
                                 if e.gidx >= 0 and e.plan and e.group is not None}}
            tb = time.perf_counter()
            log.debug("ebbtide.comm: reload: agreeing on the control plane")
            everyone = self._exchange(control, "reload", payload, tmo)
            self._check_agreement(everyone, "reload")
            barrier_s = time.perf_counter() - tb
            self._settle_plans(everyone)
            connect = set()
            for p in everyone:
                connect.update(p["connect"])
            self.generation += 1
            reports = []
            self._rebuilt_now, self._connected_now = set(), set()
            self.replaying = True
            try:
                # WORLD first: subgroups may split from it.
                order = sorted((e for e in self.journal if e.plan), key=lambda e: e.kind != "world")
                for e in order:
                    reports.extend(self._reload_one(e, eager and e.gidx in connect))
            finally:
                self.replaying = False
            tb2 = time.perf_counter()
            log.debug("ebbtide.comm: reload: rebuilt; trailing barrier")
            control.barrier("reloaded", tmo)
            barrier_s += time.perf_counter() - tb2
            self.state = RELEASED if any(e.plan and e.group is not None and e.group._ebt_inner is None
                                         for e in self.journal) else READY
            rep = Report("reload", False, self.generation, time.perf_counter() - t0, barrier_s, free_before,
                         device_free_bytes(), reports)
            log.info("%s", rep.summary())
            return rep

    def _settle_plans(self, everyone: list[dict]) -> None:
        """A member whose suspend failed destroyed its communicator instead; then every member must rebuild that
        group (a resume would wait for it forever): suspended peers tear down what they hold."""
        final: dict[int, str] = {}
        for p in everyone:
            for k, plan in p["plans"].items():
                final[int(k)] = S.combine([final.get(int(k), S.KEEP), plan])
        for e in self.journal:
            if e.gidx < 0 or not e.plan or final.get(e.gidx, e.plan) == e.plan:
                continue
            if e.plan == S.SUSPEND and e.group is not None and e.group._ebt_held is not None:
                held, e.group._ebt_held = e.group._ebt_held, None
                self.inner_to_wrapper.pop(held, None)
                _teardown(held, self.teardown)
            e.plan = final[e.gidx]
            e.reason = f"destroyed: a peer could not suspend ({e.reason})"

    def _reload_one(self, e: Entry, connect: bool) -> list[GroupReport]:
        g = e.group
        t = time.perf_counter()
        log.debug("ebbtide.comm: reload: %s entry %d %s '%s' (%s)", plan_word(e), e.gidx, e.kind, e.name,
                  "member" if g is not None else "non-member")
        before = device_free_bytes()
        plan, e.plan = e.plan, None
        if plan == S.SUSPEND:
            if g is None:
                return []
            inner, g._ebt_held = g._ebt_held, None
            _resume_backend(inner)
        else:
            inner = self._rebuild(e)
            if g is None:
                return []
            self._rebuilt_now.add(g)
            inner._set_group_name(g._ebt_name)
            with contextlib.suppress(Exception):
                inner._set_group_desc(g._ebt_desc)
            if g.bound_device_id is not None and inner.bound_device_id is None:
                inner.bound_device_id = g.bound_device_id
            if _creation_connects(e):
                # Replaying the creation already made the communicator; a second eager connect would make
                # another one (see _creation_connects).
                connect = _has_accelerator(g)
            else:
                log.debug("ebbtide.comm: reload: eager connect of %s", g._ebt_name)
                connect = connect and _connect(inner, g)
            if connect:
                self._connected_now.add(g)
        g._ebt_inner, g._ebt_released_by, g._ebt_used = inner, None, False
        self.inner_to_wrapper[inner] = g
        _register_native(g._ebt_name, inner)
        after = device_free_bytes()
        used = None if before is None or after is None else before - after
        return [GroupReport(g._ebt_name, g._ebt_desc, _global_ranks(g), plan, e.reason, time.perf_counter() - t,
                            used, connected=connect)]

    def _rebuild(self, e: Entry):
        """Replay one creation call under a fresh name (fresh store prefix) and strip the temporary group out of
        c10d's registries. Returns the new inner group, or None on non-members."""
        temp_name = f"{e.name}.ebt{self.generation}"
        if e.kind == "split":
            parent_inner = self._split_parent_ready(e)
            kwargs = dict(e.call["kwargs"])
            kwargs["group_name"] = temp_name
            kwargs["opts"] = _replay_split_options(parent_inner, kwargs.get("opts"), e)
            log.debug("ebbtide.comm: reload: split '%s' from live parent %s (bound %s)", e.name,
                      e.parent._ebt_name, parent_inner.bound_device_id)
            child = parent_inner.split_group(list(e.ranks), *e.call["args"], **kwargs)
            if child is not None and e.group is not None:
                with contextlib.suppress(Exception):
                    dev = e.group.bound_device_id or torch.device("cuda")
                    child._get_backend(dev)._set_sequence_number_for_group()
            return child
        call = dict(e.call)
        call["group_name"] = temp_name
        call["pg_tag"] = None  # a tag would find the existing wrapper instead of creating
        helper = self.original("_new_process_group_helper")
        saved_default = c10d._world.default_pg
        if e.kind == "world":
            # The helper would try to split the new WORLD from the (released) current one: hide it.
            c10d._world.default_pg = None
        try:
            pg, _store = helper(**call)
        finally:
            if e.kind == "world":
                c10d._world.default_pg = saved_default
        if pg is None or pg == c10d.GroupMember.NON_GROUP_MEMBER:
            return None
        _forget_registration(pg, temp_name)
        if e.kind == "world" and _has_accelerator(e.group):
            # Note [A rebuilt WORLD has no rank map]: give its NCCL backend the identity map now.
            with contextlib.suppress(Exception):
                dev = pg.bound_device_id or torch.device("cuda", torch.cuda.current_device())
                backend = pg._get_backend(dev)
                if not list(backend.options.global_ranks_in_group):
                    backend.options.global_ranks_in_group = list(range(pg.size()))
        return pg

    def _split_parent_ready(self, e: Entry) -> ProcessGroup:
        """The live inner of a split entry's parent, checked against ProcessGroupNCCL::split's preconditions, so an
        unmet one is a StateError here and never a crash or a hang inside native code: the parent is live, has a
        splitting backend on the device and a bound device (ncclCommSplit needs the parent's communicator on it),
        and - when the parent was itself rebuilt by this reload - its communicator exists on every parent rank
        (otherwise members would fall back to ncclCommInitRank while non-members' no-color split initialises the
        parent: the two never meet)."""
        parent = e.parent
        where = f"ebbtide.comm.reload(): cannot rebuild split group '{e.name}'"
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
        _ensure_rank_map(backend, parent, where)
        if parent in self._rebuilt_now and parent not in self._connected_now:
            log.debug("ebbtide.comm: reload: connecting rebuilt parent %s before splitting it", parent._ebt_name)
            backend.eager_connect_single_device(dev)
            self._connected_now.add(parent)
        return inner

    # ---- helpers ------------------------------------------------------------------------------------------
    def _require_installed(self, what: str) -> None:
        if not self.installed:
            raise StateError(f"ebbtide.comm.{what}(): call ebbtide.comm.install() first (before "
                             "init_process_group)")
        if self.world is None or self.store is None:
            raise StateError(f"ebbtide.comm.{what}(): no default process group; call "
                             "torch.distributed.init_process_group after ebbtide.comm.install()")

    def _timeout(self, timeout: float | None) -> datetime.timedelta:
        if timeout is None:
            return self.timeout
        if not timeout > 0:
            raise InvalidArgumentError(f"timeout must be > 0 seconds, not {timeout!r}")
        return datetime.timedelta(seconds=float(timeout))

    def _control(self) -> ControlPlane:
        if self.control is None:
            self.control = ControlPlane.create(self.store, self.world.rank(), self.world.size())
        return self.control

    def _journal_hash(self) -> list:
        sigs = [e.signature() for e in self.journal if not e.local_sync]
        return [len(sigs), hashlib.sha1("\n".join(sigs).encode()).hexdigest()[:16]]

    def _exchange(self, control: ControlPlane, tag: str, payload: dict, tmo) -> list[dict]:
        raw = control.allgather(tag, json.dumps(payload).encode(), tmo)
        return [json.loads(r.decode()) for r in raw]

    @staticmethod
    def _check_agreement(everyone: list[dict], what: str) -> None:
        ref = everyone[0]["journal"]
        bad = [r for r, p in enumerate(everyone) if p["journal"] != ref]
        if bad:
            raise StateError(
                f"ebbtide.comm.{what}(): ranks {bad} disagree with rank 0 about the process-group creation history "
                f"(rank 0: {ref[0]} groups, hash {ref[1]}; " +
                ", ".join(f"rank {r}: {everyone[r]['journal'][0]} groups, hash {everyone[r]['journal'][1]}"
                          for r in bad) + "); every rank must create the same groups in the same order")


def plan_word(e: Entry) -> str:
    return "resume" if e.plan == S.SUSPEND else "rebuild"


def _combine_plans(everyone: list[dict]) -> dict[int, str]:
    """gidx -> agreed strategy. A group any member destroyed itself is left alone by everyone."""
    choices: dict[int, list[str]] = {}
    gone = set()
    for p in everyone:
        gone.update(p["gone"])
        for k, c in p["choices"].items():
            choices.setdefault(int(k), []).append(c)
    return {k: S.combine(v) for k, v in choices.items() if k not in gone}


def _has_accelerator(g: ReloadableGroup | None) -> bool:
    """The group has a device-collective backend (NCCL, XCCL, a plugin). Gloo also serves CUDA tensors, so device
    types alone do not tell; the backend configuration does ("cpu:gloo,cuda:nccl", "cuda:gloo", ...)."""
    if g is None:
        return False
    config = str(c10d._world.pg_backend_config.get(g, ""))
    backends = {part.split(":")[-1].strip().lower() for part in config.split(",") if part.strip()}
    return bool(backends - {"gloo", "mpi", "undefined", ""})


def _facts(g: ReloadableGroup, tv, nv, cumem, split_share_env: bool, include_cpu: bool) -> S.Facts:
    accel = _has_accelerator(g)
    backend = None
    if accel:
        with contextlib.suppress(Exception):
            backend = g._ebt_inner._get_backend(torch.device("cuda"))
    has_suspend = backend is not None and type(backend).__name__ == "ProcessGroupNCCL" and hasattr(backend, "suspend")
    initialized = g._ebt_used  # an op went through the wrapper; memory_stats() tells exactly where it exists
    split_share = split_share_env
    if backend is not None:
        with contextlib.suppress(Exception):
            split_share = split_share or bool(backend.options.config.split_share)
        if has_suspend:
            try:
                backend.memory_stats()  # raises while the communicator is lazily pending
                initialized = True
            except Exception:
                initialized = False
    return S.Facts(accelerator=accel, torch_version=tv, nccl_version=nv, backend_has_suspend=has_suspend,
                   cumem=cumem, split_share=split_share, comm_initialized=initialized, include_cpu=include_cpu)


def _released(e: Entry, secs: float, freed: int | None) -> GroupReport:
    """Book entry ``e`` as released (``freed``: device bytes its release gave back, None when not measurable) and
    report it. A group whose release freed more than 1 MiB had a communicator: reload reconnects it."""
    g = e.group
    g._ebt_released_by = e.plan
    e.freed = freed
    if freed is not None and freed > (1 << 20):
        e.initialized = True
    return GroupReport(g._ebt_name, g._ebt_desc, _global_ranks(g), e.plan, e.reason, secs, freed)


def _drain(groups: list) -> None:
    """Wait for the device work of these groups: a synchronize of every device they are bound to, and of the
    current device (where unbound groups run). A bare ``torch.cuda.synchronize()`` covers the current device
    only, so a group bound to another device would still have kernels running while it is torn down."""
    if not groups:
        return
    devices = {g.bound_device_id for g in groups if g.bound_device_id is not None}
    with contextlib.suppress(Exception):
        devices.add(torch.device("cuda", torch.cuda.current_device()))
    for dev in devices:
        with contextlib.suppress(Exception):
            torch.cuda.synchronize(dev)


def _suspend_backend(inner: ProcessGroup) -> None:
    """Native suspend (torch >= 2.12: ``ncclCommSuspend(NCCL_SUSPEND_MEM)``): collective over the group's ranks,
    keeps connections and virtual addresses, frees the dynamic buffers."""
    inner._get_backend(torch.device("cuda")).suspend()


def _resume_backend(inner: ProcessGroup) -> None:
    inner._get_backend(torch.device("cuda")).resume()


def _teardown(inner: ProcessGroup, how: str) -> None:
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
        _sever_split_from(inner)


def _timed_teardown(inner: ProcessGroup, how: str, device: int | None = None) -> float:
    """``_teardown`` timed. ``device``: make it this thread's CUDA device first, as on the one-at-a-time path (the
    caller's thread). A new thread starts on device 0; teardown code that saves and restores the current device
    around its own cudaSetDevice, unguarded by torch (torch guards the communicators it keys by device, not every
    path), would restore device 0, and since CUDA 12 cudaSetDevice creates that device's primary context: a
    context of every rank of a node on GPU 0. Defensive: not observed, and not checkable without GPUs."""
    if device is not None:
        with contextlib.suppress(Exception):
            torch.cuda.set_device(device)
    t = time.perf_counter()
    _teardown(inner, how)
    return time.perf_counter() - t


# Note [Concurrent teardown]
#     Measured on 2 H200 (torch 2.11, NCCL 2.28.9; comm_run11 logs): one group's abort takes 0.05-0.9 s, mostly
#     ~0.51 s, with the phase of a 0.5 s period - consistent with NCCL's proxy service thread noticing the abort
#     flag only when its idle poll() times out (500 ms) - and finalize+destroy ~0.3 s. Done one after another that
#     is ~0.5 s per group (4 s for WORLD + 7 groups). Aborts of different communicators are independent, local
#     operations (NCCL is thread-safe across communicators; torch's abort/shutdown bindings drop the GIL), so one
#     release runs them concurrently, one thread per group, in waves by split level: every child is gone before
#     the parent it was split from (split-share children may use their parent's resources), WORLD last. All ranks
#     derive the same waves from the agreed journal. An abort is local; a shutdown's ncclCommFinalize waits for the
#     communicator to be globally quiescent, i.e. for the same group's other members, who run the same wave (or,
#     one at a time, the same reverse journal order restricted to their groups: Note [Ordering and deadlock
#     freedom] in comm/NOTES.md), so neither can deadlock overlapping groups. Concurrent finalizes measured
#     0.51 s for WORLD's 7 subgroups against ~1 s of concurrent aborts (one poll period per wave), hence
#     DEFAULT_TEARDOWN. ``install(concurrent_teardown=False)`` restores one-at-a-time, reverse journal order.


# Note [Split options are not replayed]
#     dist.split_group passes an Options object to ProcessGroupNCCL::split (the caller's, or the parent's own /
#     a copy of it), and split() writes into it: ``split_from`` = the parent backend (an owning pointer),
#     ``global_ranks_in_group``, ``split_color``, ``group_name``; the child keeps that same object as its options.
#     Replaying the journaled object after the parent was rebuilt (release(include_world=True)) hands NCCL a
#     structure that belongs to torn-down backends: split() overwrites ``split_from``, which can drop the last
#     reference to the old, aborted parent backend and destroy it in the middle of the new split; the config it
#     carries was filled in for the old communicator (the same kind of hazard as Note [A rebuilt WORLD has no
#     rank map]: a native structure outliving what it points at). So the journal keeps only the scalar settings a user can
#     choose (a snapshot), and
#     replay builds fresh options from the *live* parent's (what dist.split_group does for a new split) with the
#     snapshot applied. At teardown, ``split_from`` of the dying backend's options is cleared, so an old parent is
#     freed there (a controlled point, after its abort) rather than by a later split.
_OPT_SKIP = frozenset({"split_from", "split_color", "global_ranks_in_group", "group_name", "config", "backend"})


def _scalar_attrs(obj, skip=frozenset()) -> dict:
    """Public settable scalar attributes (bool/int/float/timedelta) of a pybind options/config object."""
    out = {}
    if obj is None:
        return out
    for name in dir(obj):
        if name in skip or (name.startswith("_") and name != "_timeout"):
            continue
        try:
            v = getattr(obj, name)
        except Exception:
            continue
        if isinstance(v, (bool, int, float, datetime.timedelta)):
            out[name] = v
    return out


@dataclasses.dataclass(frozen=True)
class _OptionsSnapshot:
    """The user-choosable scalar settings of a split's backend options (see Note [Split options are not
    replayed])."""

    type_name: str
    fields: dict
    config: dict

    @classmethod
    def take(cls, opts) -> "_OptionsSnapshot":
        return cls(type(opts).__name__, _scalar_attrs(opts, _OPT_SKIP),
                   _scalar_attrs(getattr(opts, "config", None)))

    def apply(self, opts) -> None:
        for k, v in self.fields.items():
            with contextlib.suppress(Exception):
                setattr(opts, k, v)
        cfg = getattr(opts, "config", None)
        if cfg is None or not self.config:
            return
        for k, v in self.config.items():
            with contextlib.suppress(Exception):
                setattr(cfg, k, v)
        with contextlib.suppress(Exception):
            opts.config = cfg  # where the property hands out a copy


def _replay_split_options(parent_inner: ProcessGroup, snap, e: Entry):
    """Fresh options for replaying split entry ``e`` on the live parent (Note [Split options are not replayed])."""
    dev = parent_inner.bound_device_id or (e.parent.bound_device_id if e.parent is not None else None)
    live = parent_inner._get_backend(dev).options
    import copy

    try:
        fresh = copy.deepcopy(live)
    except Exception as err:  # older torch without Options.__deepcopy__: a default-constructed object
        log.debug("ebbtide.comm: cannot copy the parent's options (%s); using defaults", err)
        fresh = type(live)()
        _OptionsSnapshot.take(live).apply(fresh)
    with contextlib.suppress(Exception):
        fresh.split_from = None  # split() sets it to the live parent; never carry an older one in
    if isinstance(snap, _OptionsSnapshot):
        snap.apply(fresh)
    return fresh


# Note [A rebuilt WORLD has no rank map]
#     ProcessGroupNCCL::split maps the requested group ranks to global ranks with ``groupRanks()[rank]``.
#     ``groupRanks()`` returns ``options.global_ranks_in_group``, except for the *first* ProcessGroupNCCL of the
#     process (``local_id_ == 0``) when that list is empty: then a static 0..size-1 list. c10d creates WORLD with an
#     empty list, which works only because WORLD is normally the first NCCL group of the process. A WORLD rebuilt by
#     reload() is not (local ids count up for the life of the process), so its groupRanks() is empty and split()
#     reads past the end of an empty vector and crashes the process (dist.split_group children rebuilt after
#     release(include_world=True); cycles with WORLD kept split the original WORLD, and new_group children of a
#     rebuilt WORLD never call split(), so neither is affected). The rebuilt WORLD gets
#     the identity map (what the static list holds), and every split parent is checked before split() runs.
def _ensure_rank_map(backend, parent: ReloadableGroup, where: str) -> None:
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


def _current_cuda_device() -> int | None:
    """The calling thread's CUDA device where CUDA is initialised (never initialises it)."""
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch.cuda.current_device()
    except Exception:
        pass
    return None


def _report_slow_teardowns(futs: dict, tmo: datetime.timedelta) -> None:
    """Wait for the teardown futures (Entry -> Future); every ``tmo`` some are still running, log them."""
    from concurrent.futures import wait

    pending = set(futs.values())
    waited = 0.0
    step = max(tmo.total_seconds(), 0.001)
    while pending:
        _done, pending = wait(pending, timeout=step)
        if pending:
            waited += step
            names = [e.group._ebt_name for e, f in futs.items() if f in pending]
            log.error("ebbtide.comm: release: teardown of group(s) %s still running after %.0f s (a hung NCCL "
                      "abort/shutdown?); release cannot interrupt it and keeps waiting", names, waited)


def _sever_split_from(inner: ProcessGroup) -> None:
    """Clear ``split_from`` in the options of a torn-down group's device backends (an owning pointer to the parent
    backend; with dist.split_group's default options it points at the group itself, a cycle that would keep the
    aborted backend alive forever)."""
    with contextlib.suppress(Exception):
        inner._get_backend(torch.device("cuda")).options.split_from = None


def _reserved_mib() -> str:
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return f"{torch.cuda.memory_reserved() / 2**20:.0f}"
    except Exception:
        pass
    return "n/a"


def _creation_connects(e: Entry) -> bool:
    """Does replaying this journal entry create its NCCL communicator by itself? True for split children
    (``ProcessGroupNCCL::split`` ends in ``eagerConnectSingleDevice``) and for groups created with a bound device
    (c10d's helper calls ``eager_connect_single_device(device_id)``; with a bound WORLD that is an
    ``ncclCommSplit`` of WORLD). Such groups must not be connected again: in torch 2.x ``eagerConnectSingleDevice``
    calls ``initNCCLComm``, which does not look at the cache and makes a *second* communicator (the first one
    leaks, never aborted) and, for a split child, issues a second ``ncclCommSplit`` on the parent that only the
    members call - the parent's non-members never join it, so the members hang. Derived from the journal only,
    so every rank decides the same way."""
    if e.kind == "split":
        return True
    return e.call.get("device_id") is not None


def _connect(inner: ProcessGroup, g: ReloadableGroup) -> bool:
    """Create the NCCL communicator now (collective over the group's ranks; every member reaches this entry in
    journal order). Returns True when a connect was issued."""
    if not _has_accelerator(g):
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


# ---- replacements installed into torch.distributed modules ------------------------------------------------------
RUNTIME = Runtime()


def _batch_isend_irecv(p2p_op_list):
    """batch_isend_irecv that coalesces on wrappers too (c10d only coalesces when ``type(group) is
    ProcessGroup``; without coalescing, NCCL send/recv pairs can deadlock)."""
    orig = RUNTIME.original("batch_isend_irecv")
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


def _split_group(*args, **kwargs):
    """split_group: c10d registers the returned wrapper under the name natively; point the name at the live inner
    instead so functional collectives run on it."""
    pg = RUNTIME.original("split_group")(*args, **kwargs)
    if isinstance(pg, ReloadableGroup) and pg._ebt_inner is not None:
        _register_native(pg._ebt_name, pg._ebt_inner)
    return pg


def _resolve_process_group(name):
    """Python-side name resolution returns the wrapper (stable, cacheable), never a generation's inner."""
    pg = RUNTIME.original("_resolve_process_group")(name)
    return RUNTIME.inner_to_wrapper.get(pg, pg)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: RUNTIME._reset_after_fork())
