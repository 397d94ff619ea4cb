"""ebbtide.comm release, step 4: the teardown of the agreed groups' old inners, on the caller's thread
(``release()``) or on one background thread (``release(wait=False)``, Note [Detached teardown]). The runtime books
the groups released first and hands over a :class:`Teardown`: the old inners, this release's group reports and
what its Report needs, nothing of the runtime's.

What holds:
- Every child is torn down before the group it was split from, on every path (:func:`waves`).
- Every wave runs even after one failed: a finalize waits for the same communicator on the peers, whose later waves
  (WORLD) would otherwise wait for this rank forever. The first failure is raised once the other waves ran.
- A background failure is never silent: its Future holds it, it is logged when the teardown ends, and the runtime
  raises it as StateError at the next entry point that joins it (:func:`joined`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import threading
import time
from concurrent.futures import Future

import torch
from torch._C._distributed_c10d import ProcessGroup

from . import _backend as B
from ._journal import Entry, split_depth
from ._report import GroupReport, Report, device_free_bytes

log = logging.getLogger("ebbtide.comm")


def waves(journal: list[Entry], todo: list[Entry], concurrent: bool) -> list[tuple[int, list[Entry]]]:
    """``todo`` (reverse journal order) as (split level, entries) waves, deepest level first, WORLD last (Note
    [Concurrent teardown] in ``_backend.py``); with ``concurrent`` False (``install(concurrent_teardown=False)``)
    one entry per wave, in ``todo``'s order. Either way every child comes before the group it was split from, and
    every rank derives the same waves from the agreed journal."""
    by_group = {x.group: x for x in journal if x.group is not None}
    if not concurrent:
        return [(split_depth(e, by_group), [e]) for e in todo]
    levels: dict[int, list[Entry]] = {}
    for e in todo:
        levels.setdefault(split_depth(e, by_group), []).append(e)
    return [(level, levels[level]) for level in sorted(levels, reverse=True)]


def _free(measure: bool) -> int | None:
    """Device free bytes, or None where the caller cannot attribute a difference to the teardown alone: a
    background teardown runs beside the caller's own work (an offload frees gigabytes meanwhile), and a freed
    count is also what marks a communicator as having existed (the runtime's ``_note_freed``), so a wrong one would
    make reload connect a group that never had one."""
    return device_free_bytes() if measure else None


@dataclasses.dataclass
class Teardown:
    """The rest of one release once its groups are booked released. ``waves``: (split level, [(slot, inner)]),
    deepest level first; ``groups``: the group reports by slot (reverse journal order), whose ``seconds`` (and,
    measured, ``bytes``) :meth:`run` fills in; ``extra``: reports of what the release freed before (DeepEP
    buffers). It holds the last references to the old inners and drops each wave's once torn down."""

    waves: list[tuple[int, list[tuple[int, ProcessGroup]]]]
    how: str  # "shutdown" or "abort" (``_backend.TEARDOWNS``)
    tmo: datetime.timedelta  # a teardown running longer is logged, naming its groups, every period
    groups: list[GroupReport]
    extra: list[GroupReport]
    generation: int
    t0: float  # perf_counter() when release() started
    barrier_s: float  # control-plane waits so far

    def run(self, measure: bool) -> dict[int, int]:
        """Tear every wave down, in order, its groups concurrently (``_backend.teardown_concurrently``). With
        ``measure``: the device bytes a wave of one group gave back, by slot (a wave's bytes are not separable per
        group). Raises the first failure after every wave ran."""
        freed: dict[int, int] = {}
        first = None
        for level, wave in self.waves:
            names = {slot: self.groups[slot].name for slot, _ in wave}
            log.debug("ebbtide.comm: release: %s %d group(s) (split level %d): %s", self.how, len(wave), level,
                      list(names.values()))
            before, t = _free(measure), time.perf_counter()
            try:
                secs = B.teardown_concurrently(dict(wave), self.how, self.tmo, names)
                for slot, s in secs.items():
                    self.groups[slot].seconds = s
            except BaseException as err:  # noqa: BLE001 (kept, raised once the other waves ran)
                first = first or err
            finally:
                wave.clear()  # the last references to these inners: they are freed here
            after = _free(measure)
            if before is not None and after is not None:
                log.debug("ebbtide.comm: release: wave at split level %d done in %.3f s, device free %+.0f MiB",
                          level, time.perf_counter() - t, (after - before) / 2**20)
                if len(names) == 1:
                    (slot,) = names
                    freed[slot] = self.groups[slot].bytes = after - before
        if first is not None:
            raise first
        return freed

    def report(self, free_before: int | None = None, free_after: int | None = None,
               trailing_s: float = 0.0) -> Report:
        """The release's Report, groups in journal order, then ``extra``; ``trailing_s``: its trailing barrier."""
        return Report("release", False, self.generation, time.perf_counter() - self.t0, self.barrier_s + trailing_s,
                      free_before, free_after, self.groups[::-1] + self.extra)


# Note [Detached teardown]
#     release(wait=False) finishes on the caller's thread, before it returns, everything that touches the runtime:
#     each wrapper is marked released, its old inner leaves ``inner_to_wrapper``, the entries keep their plan and
#     reason, the group reports are made, DeepEP's buffers are freed. What is left, a Teardown of inner
#     ProcessGroups that no wrapper, registry or journal entry refers to any more, runs on a background thread that
#     touches nothing but the Teardown and its own Future (no device-free probes: they would count what the caller
#     frees meanwhile, see ``_free``). So reload(), group creation and split_group need not wait for it: new
#     communicators are made while the old ones finish. What that relies on: torch's shutdown/abort bindings drop
#     the GIL; one thread tears communicators down while another creates and uses others on the same device, which
#     NCCL does not promise in general (its thread-safety notes warn against issuing operations to independent
#     communicators of one device from several threads) and which ran without a hang in the cycles measured and in
#     the colocated loops (docs/comm.md), eager reloads (whose warm-up runs collectives on many groups) included; a
#     long soak has not run. The new communicators share nothing with the dying ones (a split needs a live parent,
#     and no dying inner is anyone's parent any more); the dying ones keep their order among themselves (children
#     before the group they were split from, wave after wave, as on every path); and what a finalize waits for is
#     the same dying communicator on its peers, whose background threads run the same waves whatever their main
#     threads do, every wave even after one failed (the peers' later waves wait for this rank's).
#     Who joins the detached teardowns (waits for them and raises their failure as StateError): release(), before
#     anything else, so two releases' teardowns never overlap and a failure is known before more is torn down (the
#     ranks put their failures into release's agreement, so every rank raises the same StateError and nothing is
#     released, rather than the failed ranks raising alone and their peers timing out; a repeated release() while
#     released is a no-op without an agreement and raises it on its own rank); uninstall(), the end of management,
#     after which no release would report it; dist.destroy_process_group of WORLD, which logs it (c10d's destroy
#     goes on, best effort). Nothing else: reload(), group creation and split_group go ahead, reload's memory
#     probes reporting None while this rank's teardowns run (they would count their frees; a peer's late teardown
#     can still move them). The price: the old communicators' memory is still held while the new ones are made, and
#     a process that exits with teardowns outstanding (no release() or destroy_process_group after the last reload)
#     ends inside them; ``release(wait=False)``'s mode is agreed (its control-plane calls differ), as include_world
#     and include_cpu are.
#     No trailing barrier: it would be a control-plane call from a second thread while the main thread's reload
#     exchanges on the same sequence-numbered keys (ControlPlane is not thread-safe, and interleaved calls would
#     pair different steps across ranks), and its purpose does not hold here: it lets a rank that measures or
#     allocates right after release() see its peers' mappings of its buffers gone, and nothing is measured. So the
#     Future is done when this rank's teardowns are; a peer's mappings of this rank's buffers go with the peer's own.
#     (A barrier on a namespace of its own would be correct too, and would buy a wait and nothing else.)
def detach(work: Teardown, device: int | None) -> Future:
    """Run ``work`` on a background thread (Note [Detached teardown]); returns the Future of its Report."""

    def body() -> Report:
        try:
            work.run(measure=False)
        except BaseException as err:
            log.error("ebbtide.comm: the background teardown of release(wait=False) failed (%s: %s); the next "
                      "release() raises it", type(err).__name__, err)
            raise
        rep = work.report()
        log.info("%s", rep.summary())
        return rep

    return in_background(body, device)


def failure_text(err: BaseException) -> str:
    return f"the background teardown of release(wait=False) failed: {type(err).__name__}: {err}"


def joined(fut: Future | None) -> BaseException | None:
    """Wait for a background teardown; its exception, or None (also for no Future). An interrupt of the wait
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
        except BaseException as err:  # delivered by the runtime's join or the caller's result()
            fut.set_exception(err)

    threading.Thread(target=body, name="ebt-release", daemon=True).start()
    return fut
