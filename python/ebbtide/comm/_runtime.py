"""ebbtide.comm runtime: the release/reload state machine over the journaled groups.

What holds (the caller's contract is in ``__init__.py``):
- Creation goes through one hooked chokepoint (``_hooks.py``) plus ``ReloadableGroup.split_group``; every call is
  journaled in order with all its arguments (``_journal.py``), including calls on ranks that are not members.
- Every journaled group is returned to the user as a :class:`ReloadableGroup` registered in c10d under the group's
  own name; the torch group doing the work is its *inner* (Note [Why a wrapper] in comm/NOTES.md: torch never
  replaces a group's backend, so a rebuilt one cannot go back into the user's object). The group owns its state
  (entry, inner, status); the runtime holds the journal and changes a group's state only through its transition
  methods.
- release() and reload() are collective over WORLD: every rank calls them, in the same order, with the same
  arguments. They are idempotent (a repeated call returns a no-op report) and serialised by one lock.
- Order of release: detach the inners (ops now raise StateError) -> drain the device (bounded: device work that
  never finishes fails the release on every rank, everything re-attached) -> agree on the CPU control
  plane (journal hash, options, per-group strategy) -> book the groups released -> tear down the old inners in
  reverse journal order (children before the WORLD they were split from, as c10d does; a global order, so
  overlapping groups never wait on each other in a cycle; teardowns of one split level run concurrently, Note
  [Concurrent teardown] in ``_backend.py``) -> trailing barrier (peers' mappings of our buffers are gone too).
  With ``wait=False`` the teardown (and only it: no trailing barrier) runs on a background thread
  (``teardowns``, Note [Detached teardown] in ``_teardown.py``). Joined, its failure raised as StateError, by
  release() before anything else (through the agreement: every rank raises, nothing released) and by
  uninstall(); dist.destroy_process_group of WORLD joins and logs it. reload(), group creation and split_group
  go ahead beside it.
- The runtime owns its state: only its methods write its fields. What one release or reload works on lives in
  that call (a :class:`~._teardown.Teardown`, a :class:`_Reloading`), not in fields.
- Order of reload: agree (journal hash, which communicators existed, which groups are gone) -> rebuild WORLD first
  (subgroups split from it) -> every journal entry in order, with a fresh store prefix per generation
  (``<name>.ebt<gen>``) -> eager connect of communicators that existed before release, except where replaying the
  creation connected them already (``_journal.creation_connects``) -> trailing barrier, so no rank races into a
  collective a peer has not rebuilt yet.
- The control plane is the rendezvous store (never released); its barriers time out naming the missing ranks.
- Fork: a child process starts with an empty journal and a fresh lock (groups inherited through fork are not
  usable there anyway).

"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
from concurrent.futures import Future
import inspect
import json
import logging
import os
import threading
import time
import warnings

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import ProcessGroup

from .. import settings
from ..errors import InvalidArgumentError, StateError
from . import _backend as B
from . import _deepep
from . import _strategy as S
from ._control import ControlPlane
from ._group import ReloadableGroup
from ._hooks import Hooks
from ._journal import (Entry, OptionsSnapshot, check_agreement, combine_plans, creation_connects, is_local_name,
                       journal_hash)
from ._registry import (_forget_registration, _global_ranks, _move_registration, _register_native,
                        _world_creation_call)
from ._report import GroupReport, Report, device_free_bytes
from ._teardown import Teardown, detach, done, failure_text, joined, waves

log = logging.getLogger("ebbtide.comm")

READY = "ready"
RELEASED = "released"

TIMEOUT = settings.declare("EBBTIDE_COMM_TIMEOUT", settings.parse_float(0, lo_open=True), 300.0,
                           "seconds ebbtide.comm's control-plane barriers wait for every rank "
                           "(install(timeout=...) overrides it)")


@dataclasses.dataclass
class _Reloading:
    """What one reload() works on (made by it, gone when it returns)."""

    measure: bool  # its memory probes are meaningful (no detached teardown of this rank beside them)
    rebuilt: set = dataclasses.field(default_factory=set)  # wrappers rebuilt so far
    connected: set = dataclasses.field(default_factory=set)  # ... of which the communicator exists now
    warm: set = dataclasses.field(default_factory=set)  # ... to warm up (the same groups on every member)

    def probe(self) -> int | None:
        return device_free_bytes() if self.measure else None


# A group whose release gave back more than this had a communicator: reload connects it eagerly.
_CONNECTED_BYTES = 1 << 20


class Runtime:
    """Process-wide state. One instance (``RUNTIME``); every public entry point takes ``lock``."""

    def __init__(self):
        self.lock = threading.RLock()  # guards everything below
        self.pid = os.getpid()
        self.strategy = "auto"  # requested: "auto" or "destroy" (_strategy.REQUESTS)
        self.teardown = B.DEFAULT_TEARDOWN  # how a destroyed NCCL backend is torn down: "abort" or "shutdown"
        self.concurrent_teardown = True  # see Note [Concurrent teardown]
        self.timeout: datetime.timedelta | None = None  # None: EBBTIDE_COMM_TIMEOUT, read when first needed
        self.state = READY
        self.generation = 0
        self.journal: list[Entry] = []
        self.world: ReloadableGroup | None = None
        self.store = None  # WORLD's rendezvous store, the control plane's home
        self.control: ControlPlane | None = None
        self.replaying = False  # our own rebuild calls pass through the hooks
        self.inner_to_wrapper: dict = {}  # live inner -> wrapper, for Python-side name resolution
        self.hooks = Hooks(lambda pg: self.inner_to_wrapper.get(pg, pg))
        self.helper_sig: inspect.Signature | None = None
        self.teardowns: Future | None = None  # a release(wait=False)'s detached teardown (Note [Detached teardown])

    @property
    def installed(self) -> bool:
        return self.hooks.installed

    # ---- install / uninstall ------------------------------------------------------------------------------
    def install(self, *, strategy: str, teardown: str, timeout: float | None, check_env: bool,
                concurrent_teardown: bool = True) -> list[str]:
        S.check_request(strategy)
        settings.check_component("comm")  # EBBTIDE_COMM_TIMEOUT and _WARMUP fail here, not at a later barrier
        if teardown not in B.TEARDOWNS:
            raise InvalidArgumentError(f"teardown must be one of {B.TEARDOWNS}, not {teardown!r}")
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
                for var, msg in S.env_warnings(os.environ):
                    warnings.warn(f"ebbtide.comm: {msg}", RuntimeWarning, stacklevel=3)
                    warned.append(var)
            if self.installed:
                return warned
            self.helper_sig = inspect.signature(c10d._new_process_group_helper)
            self.hooks.install(self._hooked_helper)
            _deepep.install_hook()  # DeepEP buffers built from now on go and come back with the groups
            if dist.is_available() and dist.is_initialized() and not isinstance(c10d._world.default_pg,
                                                                                 ReloadableGroup):
                self._adopt_existing_world()
            return warned

    def uninstall(self) -> None:
        """Restore c10d's functions. Existing wrappers keep working; new groups are plain torch groups."""
        with self.lock:
            if self.state != READY:
                raise StateError("ebbtide.comm.uninstall(): groups are released; reload() first")
            err = self._join_teardowns()
            if err is not None:
                raise StateError(f"ebbtide.comm.uninstall(): {failure_text(err)}") from err
            self.hooks.uninstall()

    def original(self, attr: str):
        return self.hooks.original(attr)

    def _check_pid(self) -> None:
        if os.getpid() != self.pid:  # register_at_fork normally resets first; this covers exotic forks
            self._reset_after_fork()

    def _reset_after_fork(self) -> None:
        self.lock = threading.RLock()
        self.pid = os.getpid()
        self.teardowns = None  # the teardown thread is not in the child
        self._reset_journal()
        self.replaying = False

    def _reset_journal(self) -> None:
        self.state, self.generation, self.journal = READY, 0, []
        self.world, self.store, self.control = None, None, None
        self.inner_to_wrapper = {}

    # ---- creation -----------------------------------------------------------------------------------------
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
            local = (not is_world) and is_local_name(name)
            if pg is None or pg == c10d.GroupMember.NON_GROUP_MEMBER:
                self._append(Entry("group", name, ranks, call, None, local_sync=local))
                return pg, store
            if type(pg) is not ProcessGroup:  # custom Python groups (fake/threaded backends): not ours to manage
                return pg, store
            wrapper = self._wrap(pg)
            _move_registration(pg, wrapper)
            self._append(Entry("world" if is_world else "group", name, ranks, call, wrapper, local_sync=local))
            if is_world:
                self.world = wrapper
                self.store = call.get("store")
            return wrapper, store

    def _wrap(self, pg: ProcessGroup) -> ReloadableGroup:
        wrapper = ReloadableGroup(pg, name=pg.group_name, desc=pg.group_desc, index=len(self.journal), runtime=self)
        self.inner_to_wrapper[pg] = wrapper
        return wrapper

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
                backend = B.splitting_backend(parent._ebt_inner, dev)
                if backend is not None:
                    B.ensure_rank_map(backend, parent, f"split_group of '{parent._ebt_name}'")
            child = parent._ebt_inner.split_group(ranks, *args, **kwargs)
            call = {"args": args, "kwargs": dict(kwargs)}
            call.update({k: kwargs.get(k) for k in ("timeout", "group_desc")})
            if call["kwargs"].get("opts") is not None:
                # Never journal the native Options object: see Note [Split options are not replayed].
                call["kwargs"]["opts"] = OptionsSnapshot.take(call["kwargs"]["opts"])
            if child is None:
                self._append(Entry("split", str(kwargs.get("group_name")), tuple(ranks), call, None, parent=parent))
                return None
            wrapper = self._wrap(child)
            self._append(Entry("split", child.group_name, tuple(ranks), call, wrapper, parent=parent))
            return wrapper

    def user_destroyed(self, g: ReloadableGroup, how: str) -> None:
        """dist.destroy_process_group reached a wrapper: tear its inner down and forget the group. WORLD's destroy
        joins a detached teardown first (Note [Detached teardown]); a failure there is logged, as c10d's destroy is
        best effort and goes on."""
        with self.lock:
            if g is self.world:
                err = self._join_teardowns()
                if err is not None:
                    log.error("ebbtide.comm: dist.destroy_process_group: the background teardown of "
                              "release(wait=False) had failed: %s: %s", type(err).__name__, err)
                # c10d is destroying every group and will clear its registries. Children first (reverse journal
                # order, as c10d shuts groups down), then WORLD they were split from; start over at the next init.
                for e in reversed(self.journal):
                    if e.group is not None and e.group is not g and not e.group._ebt_destroyed:
                        self.user_destroyed(e.group, how)
            inner = g._ebt_destroy("dist.destroy_process_group")
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
        call = _world_creation_call(world)
        store = call["store"]
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
    def release(self, *, include_world: bool, include_cpu: bool, timeout: float | None,
                wait: bool = True) -> Report | Future:
        t0 = time.perf_counter()
        with self.lock:
            self._check_pid()
            self._require_installed("release")
            failed = self._join_teardowns()  # Note [Detached teardown]: before anything is torn down again
            if self.state == RELEASED:
                if failed is not None:
                    raise StateError(f"ebbtide.comm.release(): {failure_text(failed)}") from failed
                rep = Report("release", True, self.generation, time.perf_counter() - t0, 0.0, None, None)
                return rep if wait else done(rep)
            tmo = self._timeout(timeout)
            control = self._control()
            free_before = device_free_bytes()
            local = B.local_choices(self.journal, self.strategy, include_world, include_cpu)
            # 1. Detach: from here every op on a target raises StateError instead of reaching NCCL.
            detached = {e: e.group._ebt_detach() for e, _choice, _reason in local}
            # 2. Drain outstanding device work (NCCL kernels run on internal streams; a device sync covers them).
            log.debug("ebbtide.comm: release: detached %s", [e.group._ebt_name for e in detached])
            # 3. Agree: same journal, same options (wait too: the detached form makes no trailing barrier call, Note
            #    [Detached teardown]); a group is released where any of its members releases it.
            payload = {"journal": journal_hash(self.journal), "opts": [include_world, include_cpu, bool(wait)],
                       "choices": {str(e.gidx): c for e, c, _ in local if e.gidx >= 0},
                       "gone": [e.gidx for e in self.journal if e.group is not None and e.group._ebt_destroyed],
                       "deepep": _deepep.describe(), "teardown": failure_text(failed) if failed else ""}
            tb = time.perf_counter()
            try:
                # Bounded by half the timeout, so a rank whose device never drains still reaches the agreement
                # while its peers wait there: every rank then fails with the same reason and the same call count.
                try:
                    B.drain([e.group for e in detached if B.has_accelerator(e.group)], tmo.total_seconds() / 2)
                    payload["drain"] = ""
                except Exception as e:  # noqa: BLE001 (reported to the peers: every rank then fails the same way)
                    payload["drain"] = str(e) if isinstance(e, StateError) else \
                        f"ebbtide.comm.release(): the device drain failed ({type(e).__name__}: {e})"
                log.debug("ebbtide.comm: release: drained; agreeing on the control plane")
                everyone = self._exchange(control, "release", payload, tmo)
                stuck = [r for r, p in enumerate(everyone) if p.get("drain")]
                if stuck:
                    raise StateError(f"ebbtide.comm.release(): on ranks {stuck} " +
                                     everyone[stuck[0]]["drain"].split("release(): ", 1)[-1])
                bad = [r for r, p in enumerate(everyone) if p.get("teardown")]
                if bad:  # every rank raises: no rank releases alone while its peers give up
                    raise StateError(f"ebbtide.comm.release(): on ranks {bad} {everyone[bad[0]]['teardown']}; "
                                     "nothing was released now and the groups are usable (the communicators that "
                                     "teardown held may not be freed)") from failed
                check_agreement(everyone, "release")
                if len({json.dumps(p["opts"]) for p in everyone}) != 1:
                    raise StateError("ebbtide.comm.release(): ranks passed different include_world/include_cpu/wait "
                                     f"arguments: {[p['opts'] for p in everyone]}")
                why = _deepep.disagreement(everyone)
                if why:
                    raise StateError(f"ebbtide.comm.release(): ranks hold different DeepEP buffers: {why}")
                # DeepEP's destroy is collective among each buffer's ranks (a device barrier): all ranks agreed
                # above, so every peer is here too. Before any communicator goes.
                deepep = _deepep.release_buffers()
            except BaseException:
                for e, inner in detached.items():  # nothing was torn down: put everything back
                    e.group._ebt_attach(inner)
                raise
            barrier_s = time.perf_counter() - tb
            plans = combine_plans(everyone, S.combine)
            # 4. Tear down in reverse journal order: children before the group they were split from (as c10d's
            #    destroy_process_group does); one global order, so no cross-group wait cycle.
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
                        e.group._ebt_attach(detached[e])
                    continue
                if e not in detached:
                    continue  # non-member (or a member that did not target it: impossible after agreement)
                e.reason = reasons.get(e, "")
                if e.plan != choices[e]:
                    e.reason = f"{choices[e]} here, {e.plan} on a peer: {e.reason}"
                todo.append(e)
            for e in detached:
                if e.plan is not None:
                    # Name lookups now reach the wrapper, whose ops raise StateError.
                    _register_native(e.group._ebt_name, e.group)
            # Before the teardown: from here every entry point (reload, release, group creation) sees RELEASED,
            # and a timeout in the trailing barrier leaves a consistent RELEASED state.
            self.state = RELEASED
            work = self._book_released(todo, detached, deepep, tmo, t0, barrier_s)
            del detached  # the Teardown holds the last references to the old inners
            if not wait:  # agreed: every rank takes the same form
                self.teardowns = detach(work, B.current_cuda_device())
                log.debug("ebbtide.comm: release: %d group(s) booked released; their teardown continues in the "
                          "background", len(todo))
                return self.teardowns
            for slot, freed in work.run(measure=True).items():
                if freed > _CONNECTED_BYTES:
                    todo[slot].initialized = True
            # 5. Trailing barrier: return when every rank has torn down. NCCL's peer buffers are cuMem allocations
            #    exported by one rank and mapped by the others: the pages go only when every mapper has let go, so
            #    a rank that measures (or allocates) before its peers finish sees part of its memory still held.
            tb2 = time.perf_counter()
            control.barrier("released", tmo)
            rep = work.report(free_before, device_free_bytes(), time.perf_counter() - tb2)
            log.info("%s", rep.summary())
            log.debug("ebbtide.comm: release: torch caching allocator reserved %s MiB after release (not ours: NCCL "
                      "memory never goes through it)", B.reserved_mib())
            return rep

    def _book_released(self, todo: list[Entry], detached: dict, deepep: list[GroupReport],
                       tmo: datetime.timedelta, t0: float, barrier_s: float) -> Teardown:
        """Mark ``todo``'s groups (reverse journal order, plans agreed) released and hand their old inners over to
        a Teardown: from here nothing of the runtime's refers to them (Note [Detached teardown])."""
        groups = []
        for e in todo:
            g = e.group
            g._ebt_mark_released(e.plan)
            self.inner_to_wrapper.pop(detached[e], None)
            groups.append(GroupReport(g._ebt_name, g._ebt_desc, _global_ranks(g), e.plan, e.reason, 0.0, None))
        slot = {e: i for i, e in enumerate(todo)}
        plan = [(level, [(slot[e], detached[e]) for e in wave])
                for level, wave in waves(self.journal, todo, self.concurrent_teardown)]
        return Teardown(plan, self.teardown, tmo, groups, deepep, self.generation, t0, barrier_s)

    def _join_teardowns(self) -> BaseException | None:
        """Wait for a release(wait=False)'s detached teardown; its failure (once: the Future is dropped), or None."""
        err, self.teardowns = joined(self.teardowns), None
        return err

    # ---- reload -------------------------------------------------------------------------------------------
    def reload(self, *, eager: bool, timeout: float | None, warm: bool = True) -> Report:
        t0 = time.perf_counter()
        with self.lock:
            self._check_pid()
            self._require_installed("reload")
            if self.state != RELEASED:
                return Report("reload", True, self.generation, time.perf_counter() - t0, 0.0, None, None)
            tmo = self._timeout(timeout)
            control = self._control()
            # Not beside a detached teardown: the probes would count its frees (Note [Detached teardown]).
            op = _Reloading(measure=self.teardowns is None or self.teardowns.done())
            free_before = op.probe()
            payload = {"journal": journal_hash(self.journal), "eager": bool(eager),
                       "connect": [e.gidx for e in self.journal if e.gidx >= 0 and e.plan and e.initialized],
                       "gone": [e.agreement_key() for e in self.journal
                                if e.plan and e.group is not None and e.group._ebt_destroyed]}
            tb = time.perf_counter()
            log.debug("ebbtide.comm: reload: agreeing on the control plane")
            everyone = self._exchange(control, "reload", payload, tmo)
            check_agreement(everyone, "reload")
            barrier_s = time.perf_counter() - tb
            self._forget_destroyed(everyone)
            connect = set()
            for p in everyone:
                connect.update(p["connect"])
            self.generation += 1
            reports = []
            self.replaying = True
            try:
                # WORLD first: subgroups may split from it.
                order = sorted((e for e in self.journal if e.plan), key=lambda e: e.kind != "world")
                for e in order:
                    reports.extend(self._reload_one(e, eager and e.gidx in connect, op))
                warm_s = 0.0
                if eager and warm:  # Note [Concurrent warm-up] in _backend.py; before DeepEP's handle exchange
                    warm_s = B.warm_up(list(op.warm), B.current_cuda_device())
                reports.extend(_deepep.reload_buffers())  # over their reloaded groups
            finally:
                self.replaying = False
            tb2 = time.perf_counter()
            log.debug("ebbtide.comm: reload: rebuilt; trailing barrier")
            control.barrier("reloaded", tmo)
            barrier_s += time.perf_counter() - tb2
            self.state = RELEASED if any(e.plan and e.group is not None and e.group._ebt_inner is None
                                         for e in self.journal) else READY
            rep = Report("reload", False, self.generation, time.perf_counter() - t0, barrier_s, free_before,
                         op.probe(), reports, warmup_seconds=warm_s)
            log.info("%s", rep.summary())
            return rep

    def _forget_destroyed(self, everyone: list[dict]) -> None:
        """A group destroyed while released (dist.destroy_process_group) stays destroyed: no rank rebuilds it, on
        members and non-members alike (a rebuild is collective). A member that had not destroyed it itself marks
        it destroyed too, so its ops raise StateError naming it instead of waiting for peers that left."""
        gone = {k for p in everyone for k in p["gone"]}
        for e in self.journal:
            if not e.plan or e.agreement_key() not in gone:
                continue
            e.plan = None
            g = e.group
            if g is not None and not g._ebt_destroyed:  # released: its old inner went at release, none to tear down
                g._ebt_destroy("dist.destroy_process_group on a peer rank while released")
            log.debug("ebbtide.comm: reload: group '%s' was destroyed while released: not rebuilt", e.name)

    def _reload_one(self, e: Entry, connect: bool, op: _Reloading) -> list[GroupReport]:
        g = e.group
        asked = connect  # agreed on every rank (unlike whether this rank's eager connect succeeded)
        t = time.perf_counter()
        log.debug("ebbtide.comm: reload: rebuild entry %d %s '%s' (%s)", e.gidx, e.kind, e.name,
                  "member" if g is not None else "non-member")
        before = op.probe()
        plan, e.plan = e.plan, None
        inner = self._rebuild(e, op)
        if g is None:
            return []
        op.rebuilt.add(g)
        inner._set_group_name(g._ebt_name)
        with contextlib.suppress(Exception):
            inner._set_group_desc(g._ebt_desc)
        if g.bound_device_id is not None and inner.bound_device_id is None:
            inner.bound_device_id = g.bound_device_id
        if creation_connects(e):
            # Replaying the creation already made the communicator; a second eager connect would make another one
            # (see creation_connects).
            connect = B.has_accelerator(g)
        else:
            log.debug("ebbtide.comm: reload: eager connect of %s", g._ebt_name)
            connect = connect and B.connect(inner, g)
        if connect:
            op.connected.add(g)
        if B.has_accelerator(g) and (creation_connects(e) or asked):
            op.warm.add(g)  # the same groups on every member: each warm-up pairs up
        g._ebt_attach(inner, fresh=True)
        self.inner_to_wrapper[inner] = g
        _register_native(g._ebt_name, inner)
        after = op.probe()
        used = None if before is None or after is None else before - after
        return [GroupReport(g._ebt_name, g._ebt_desc, _global_ranks(g), plan, e.reason, time.perf_counter() - t,
                            used, connected=connect)]

    def _rebuild(self, e: Entry, op: _Reloading):
        """Replay one creation call under a fresh name (fresh store prefix) and strip the temporary group out of
        c10d's registries. Returns the new inner group, or None on non-members."""
        temp_name = f"{e.name}.ebt{self.generation}"
        if e.kind == "split":
            parent_inner = B.split_parent_ready(e.parent, e.name, op.rebuilt, op.connected)
            kwargs = dict(e.call["kwargs"])
            kwargs["group_name"] = temp_name
            kwargs["opts"] = B.replay_split_options(parent_inner, kwargs.get("opts"), e.parent)
            log.debug("ebbtide.comm: reload: split '%s' from live parent %s (bound %s)", e.name,
                      e.parent._ebt_name, parent_inner.bound_device_id)
            child = parent_inner.split_group(list(e.ranks), *e.call["args"], **kwargs)
            if child is not None and e.group is not None:
                B.set_split_sequence_number(child, e.group.bound_device_id)
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
        if e.kind == "world" and B.has_accelerator(e.group):
            B.give_world_rank_map(pg)  # Note [A rebuilt WORLD has no rank map]
        return pg

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
            if self.timeout is None:
                self.timeout = datetime.timedelta(seconds=settings.get(TIMEOUT))
            return self.timeout
        if not timeout > 0:
            raise InvalidArgumentError(f"timeout must be > 0 seconds, not {timeout!r}")
        return datetime.timedelta(seconds=float(timeout))

    def _control(self) -> ControlPlane:
        if self.control is None:
            self.control = ControlPlane.create(self.store, self.world.rank(), self.world.size())
        return self.control

    def _exchange(self, control: ControlPlane, tag: str, payload: dict, tmo) -> list[dict]:
        raw = control.allgather(tag, json.dumps(payload).encode(), tmo)
        return [json.loads(r.decode()) for r in raw]


RUNTIME = Runtime()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: RUNTIME._reset_after_fork())
