"""ebbtide.comm release, steps 4 and 5's teardown half: tear down (or suspend) the agreed groups, and run it on a
background thread for ``release(wait=False)``. Functions over the runtime (``rt``), which holds the journal."""
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
from ._report import GroupReport, device_free_bytes

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
    by_group = {x.group: x for x in rt.journal if x.group is not None}
    waves: dict[int, list[Entry]] = {}
    for e in todo:
        waves.setdefault(split_depth(e, by_group), []).append(e)
    for level in sorted(waves, reverse=True):
        destroy = []
        for e in waves[level]:
            if e.plan == S.SUSPEND:
                reports[e] = _release_one(rt, e, detached[e], measure)  # falls back to destroy on failure
            else:
                destroy.append(e)
        if destroy:
            _destroy_wave(rt, level, destroy, detached, reports, tmo or rt._timeout(None), measure)
    return [reports[e] for e in todo]


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


def done(value) -> Future:
    """A Future already holding ``value`` (release(wait=False) with nothing to tear down)."""
    fut: Future = Future()
    fut.set_result(value)
    return fut


def in_background(fn, device: int | None) -> Future:
    """Run ``fn`` on a daemon thread (on the caller's CUDA ``device``: a new thread starts on device 0); its
    result or exception goes to the returned Future."""
    fut: Future = Future()

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
