"""ebbtide.comm release, steps 4 and 5: tear down (or suspend) the agreed groups, the trailing barrier and the
report, and their background forms for ``release(wait=False)``. Functions over the runtime (``rt``), which holds the
journal.

What holds:
- Every child is torn down (or suspended) before the group it was split from, on every path (:func:`waves`).
- ``release(wait=False)`` has two forms. With a SUSPEND plan the whole of steps 4 and 5 runs on one background
  thread (:func:`finish_release` under :func:`in_background`); the runtime's entry points join it before touching
  the journal. Without one, the bookkeeping is done on the caller's thread and only the teardowns of inners that
  nothing references any more run in the background (:func:`release_detached`, Note [Detached teardown]).
- A background failure is never silent: its Future holds it, it is logged when it happens, and the runtime raises it
  as StateError at the next entry point that joins it (:func:`joined`).
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
from concurrent.futures import Future

import torch
from torch._C._distributed_c10d import ProcessGroup

from . import _backend as B
from . import _strategy as S
from ._journal import Entry, split_depth
from ._registry import _global_ranks
from ._report import GroupReport, Report, device_free_bytes

log = logging.getLogger("ebbtide.comm")


def release_all(rt, todo: list[Entry], detached: dict, tmo: datetime.timedelta | None = None,
                measure: bool = True) -> list[GroupReport]:
    """Suspend or tear down ``todo`` (reverse journal order). With ``install(concurrent_teardown=False)``: one
    at a time in that order. Otherwise in waves by split level, deepest first, WORLD last (see Note
    [Concurrent teardown]); inside a wave the suspends (collective) run one at a time in reverse journal order,
    then the wave's teardowns run concurrently. Either way every child is handled before the group it was
    split from, whatever the two plans are (a suspended parent must not lose resources a child being aborted
    after it may still share), and every rank follows the same order."""
    if not rt.concurrent_teardown:
        return [_release_one(rt, e, detached[e], measure) for e in todo]
    reports: dict[Entry, GroupReport] = {}
    for level, wave in waves(rt, todo):
        destroy = []
        for e in wave:
            if e.plan == S.SUSPEND:
                reports[e] = _release_one(rt, e, detached[e], measure)  # falls back to destroy on failure
            else:
                destroy.append(e)
        if destroy:
            _destroy_wave(rt, level, destroy, detached, reports, tmo or rt._timeout(None), measure)
    return [reports[e] for e in todo]


def waves(rt, todo: list[Entry]) -> list[tuple[int, list[Entry]]]:
    """``todo`` (reverse journal order) as (split level, entries) waves, deepest level first, WORLD last (Note
    [Concurrent teardown]); with ``install(concurrent_teardown=False)`` one entry per wave, in ``todo``'s order."""
    by_group = {x.group: x for x in rt.journal if x.group is not None}
    if not rt.concurrent_teardown:
        return [(split_depth(e, by_group), [e]) for e in todo]
    levels: dict[int, list[Entry]] = {}
    for e in todo:
        levels.setdefault(split_depth(e, by_group), []).append(e)
    return [(level, levels[level]) for level in sorted(levels, reverse=True)]


def _destroy_wave(rt, level: int, wave: list[Entry], detached: dict, reports: dict,
                  tmo: datetime.timedelta, measure: bool = True) -> None:
    """Tear down the groups of one split level concurrently (``_backend.teardown_concurrently``)."""
    before = _free(measure)
    t0 = time.perf_counter()
    log.debug("ebbtide.comm: release: %s %d group(s) concurrently (split level %d): %s", rt.teardown,
              len(wave), level, [e.group._ebt_name for e in wave])
    for e in wave:
        rt.inner_to_wrapper.pop(detached[e], None)
    secs = B.teardown_concurrently({e: detached[e] for e in wave}, rt.teardown, tmo,
                                   {e: e.group._ebt_name for e in wave})
    after = _free(measure)
    freed = None if before is None or after is None else after - before
    log.debug("ebbtide.comm: release: wave at split level %d done in %.3f s (slowest group %.3f s), device "
              "free %+.0f MiB", level, time.perf_counter() - t0, max(secs.values()),
              (freed or 0) / 2**20)
    for e in wave:  # per-group bytes are not separable in a wave
        reports[e] = released_entry(e, secs[e], freed if len(wave) == 1 else None)


def _release_one(rt, e: Entry, inner: ProcessGroup, measure: bool = True) -> GroupReport:
    g = e.group
    t = time.perf_counter()
    log.debug("ebbtide.comm: release: %s group %s (%s)", e.plan, g._ebt_name, g._ebt_desc)
    before = _free(measure)
    if e.plan == S.SUSPEND:
        try:
            B.suspend(inner)
            g._ebt_hold(inner)
        except Exception as err:  # fall back to destroying it; reload() makes the peers agree (see there)
            log.warning("ebbtide.comm: suspend of group %s failed (%s); destroying it instead", g._ebt_name, err)
            e.plan, e.reason = S.DESTROY, f"suspend failed: {err}"
    if e.plan != S.SUSPEND:
        rt.inner_to_wrapper.pop(inner, None)
        B.teardown(inner, rt.teardown)
        del inner
    after = _free(measure)
    return released_entry(e, time.perf_counter() - t, None if before is None or after is None else after - before)


def _free(measure: bool) -> int | None:
    """Device free bytes, or None where the caller cannot attribute a difference to the teardown alone: a
    background teardown runs beside the caller's own work (an offload frees gigabytes meanwhile), and a freed
    count is also what marks a communicator as having existed (``released_entry``), so a wrong one would make
    reload connect a group that never had one."""
    return device_free_bytes() if measure else None


def finish_release(rt, todo: list[Entry], detached: dict, tmo, control, t0: float, barrier_s: float,
                   free_before: int | None, measure: bool = True) -> Report:
    """Steps 4 and 5 of release(): on the caller's thread, or on a background thread for release(wait=False) with a
    SUSPEND plan (then nothing else touches the journal until the runtime has joined it: every entry point settles
    first, and the released groups' own ops raise StateError)."""
    reports = release_all(rt, todo, detached, tmo, measure)
    reports.reverse()  # report in journal order
    reports += rt.deepep_reports
    rt.deepep_reports = []
    # 5. Trailing barrier: return when every rank has torn down. NCCL's peer buffers are cuMem allocations exported
    #    by one rank and mapped by the others: the pages go only when every mapper has let go, so a rank that
    #    measures (or allocates) before its peers finish sees part of its memory still held.
    tb2 = time.perf_counter()
    control.barrier("released", tmo)
    barrier_s += time.perf_counter() - tb2
    rep = Report("release", False, rt.generation, time.perf_counter() - t0, barrier_s,
                 free_before if measure else None, device_free_bytes() if measure else None, reports)
    rt.last_release = rep
    log.info("%s", rep.summary())
    log.debug("ebbtide.comm: release: torch caching allocator reserved %s MiB after release (not ours: NCCL memory "
              "never goes through it)", B.reserved_mib())
    return rep


# Note [Detached teardown]
#     release(wait=False) whose agreed plans hold no SUSPEND (agreed, so every rank takes this form or none does)
#     finishes on the caller's thread, before it returns, everything that touches the runtime: each wrapper is marked
#     released, its old inner leaves ``inner_to_wrapper``, the entries keep their plan and reason, the group reports
#     are made (freed None: nothing is measured beside the caller's work, see ``_free``), DeepEP's are taken. What is
#     left, the teardown of inner ProcessGroups that no wrapper, registry or journal entry refers to any more, runs
#     on a background thread that touches nothing of the runtime's but its own Future, the reports it made, and
#     ``last_release`` once at the end. So reload(), group creation and split_group need not wait for it: new
#     communicators are made while the old ones finish. What that relies on: torch's shutdown/abort bindings drop
#     the GIL; one thread tears communicators down while another creates and uses others on the same device, which
#     NCCL does not promise in general (its thread-safety notes warn against issuing operations to independent
#     communicators of one device from several threads) and which ran without a hang in the cycles measured below
#     and in the colocated loops (2026-11-28, NCCL 2.28.9), eager reloads (whose warm-up runs collectives on many
#     groups at once) included; a longer soak has not run. The new communicators share nothing with the
#     dying ones (a split needs a live parent, and no dying inner is anyone's parent any more); the dying ones keep
#     their order among themselves (children before the group they were split from, wave after wave, as on every
#     path); and what a finalize waits for is the same dying communicator on its peers, whose background threads run
#     the same waves whatever their main threads do, every wave even after one failed (the peers' later waves
#     wait for this rank's). A SUSPEND plan keeps the whole release on the background
#     thread, joined by every entry point: a group must be fully suspended (or its failed suspend turned into a
#     destroy, which changes what reload agrees on) before anything resumes it.
#     Who joins the detached teardowns (waits for them and raises their failure as StateError): release(), before
#     anything else, so two releases' teardowns never overlap and a failure is known before more is torn down (the
#     ranks put their failures into release's agreement, so every rank raises the same StateError and nothing is
#     released, rather than the failed ranks raising alone and their peers timing out; a repeated release() while
#     released is a no-op without an agreement and raises it on its own rank); uninstall(), the end of management,
#     after which no release would report it; dist.destroy_process_group of WORLD, which logs it (c10d's destroy
#     goes on, best effort). Nothing else: reload(), group creation
#     and split_group go ahead, reload's memory probes reporting None while this rank's teardowns run (they would
#     count their frees; a peer's late teardown can still move them). The price: the old communicators' memory is
#     still held while the new ones are made, and a process that exits with teardowns outstanding (no release()
#     or destroy_process_group after the last reload) ends inside them; ``release(wait=False)``'s mode is agreed
#     (its control-plane calls differ), as include_world and include_cpu are.
#     No trailing barrier: it would be a control-plane call from a second thread while the main thread's reload
#     exchanges on the same sequence-numbered keys (ControlPlane is not thread-safe, and interleaved calls would
#     pair different steps across ranks), and its purpose does not hold here: it lets a rank that measures or
#     allocates right after release() see its peers' mappings of its buffers gone, and nothing is measured. So the
#     Future is done when this rank's teardowns are; a peer's mappings of this rank's buffers go with the peer's own.
#     (A barrier on a namespace of its own would be correct too, and would buy a wait and nothing else.)
#     Measured (2 H200, NCCL 2.28.9, WORLD + 6 groups, a 0.36 s pause between release and reload, 24 cycles): from
#     the end of the pause to reload() done 0.58 s, against 1.11 s waiting for the Future first; reload itself takes
#     0.58 s beside the teardowns against 0.49 s alone; the collectives are exact and free memory settles the same
#     way as when joined (flat after 7 cycles).
def release_detached(rt, todo: list[Entry], detached: dict, tmo: datetime.timedelta, t0: float,
                     barrier_s: float) -> Future:
    """Book ``todo`` (reverse journal order, no SUSPEND plan) released on the caller's thread and tear down the
    detached inners on a background thread (Note [Detached teardown]). Returns the Future of the Report."""
    reports = [released_entry(e, 0.0, None) for e in todo]
    slot = {e: i for i, e in enumerate(todo)}
    work = [[(slot[e], detached[e]) for e in wave] for _level, wave in waves(rt, todo)]
    for e in todo:
        rt.inner_to_wrapper.pop(detached[e], None)
    extra, rt.deepep_reports = rt.deepep_reports, []
    how, generation = rt.teardown, rt.generation

    def teardowns() -> Report:
        # Every wave runs even after one failed: a finalize waits for the same communicator on the peers, whose
        # later waves (WORLD) would otherwise wait for this rank forever. The first failure is raised at the end.
        first = None
        for wave in work:
            try:
                secs = B.teardown_concurrently(dict(wave), how, tmo, {i: reports[i].name for i, _ in wave})
                for i, s in secs.items():
                    reports[i].seconds = s
            except BaseException as err:  # noqa: BLE001 (kept, raised once the other waves ran)
                log.error("ebbtide.comm: the background teardown of release(wait=False) failed (%s: %s); the "
                          "next release() raises it", type(err).__name__, err)
                first = first or err
            finally:
                wave.clear()  # the last references to these inners: they are freed here, not by the caller
        if first is not None:
            raise first
        rep = Report("release", False, generation, time.perf_counter() - t0, barrier_s, None, None,
                     reports[::-1] + extra)
        rt.last_release = rep
        log.info("%s", rep.summary())
        return rep

    fut = in_background(teardowns, B.current_cuda_device())
    log.debug("ebbtide.comm: release: %d group(s) booked released; their teardown continues in the background "
              "(detached)", len(todo))
    return fut


def failure_text(err: BaseException) -> str:
    return f"the background teardown of release(wait=False) failed: {type(err).__name__}: {err}"


def joined(fut: Future | None) -> BaseException | None:
    """Wait for a background release; its exception, or None (also for no Future). An interrupt of the wait
    propagates (the Future stays outstanding)."""
    return None if fut is None else fut.exception()


def done(value) -> Future:
    """A Future already holding ``value`` (release(wait=False) with nothing to tear down)."""
    fut: Future = Future()
    fut.set_result(value)
    return fut


def in_background(fn, device: int | None) -> Future:
    """Run ``fn`` on a daemon thread (on the caller's CUDA ``device``: a new thread starts on device 0); its
    result or exception goes to the returned Future."""
    fut: Future = Future()
    fut.set_running_or_notify_cancel()  # running from now: the caller cannot cancel it (the work would go on)

    def body():
        if device is not None:
            with contextlib.suppress(Exception):
                torch.cuda.set_device(device)
        try:
            fut.set_result(fn())
        except BaseException as err:  # delivered by settle() or the caller's result()
            fut.set_exception(err)

    threading.Thread(target=body, name="ebt-release", daemon=True).start()
    return fut


def released_entry(e: Entry, secs: float, freed: int | None) -> GroupReport:
    """Book entry ``e`` as released (``freed``: device bytes its release gave back, None when not measurable) and
    report it. A group whose release freed more than 1 MiB had a communicator: reload reconnects it."""
    g = e.group
    g._ebt_mark_released(e.plan)
    e.freed = freed
    if freed is not None and freed > (1 << 20):
        e.initialized = True
    return GroupReport(g._ebt_name, g._ebt_desc, _global_ranks(g), e.plan, e.reason, secs, freed)
