"""A streamed push: an update filled while its producer is still writing the new weights (``Sender.streamed``).

Policies:
- ``Sender.streamed(version)`` begins update ``version`` on the sender's thread (as ``open(wait=False)``) and returns
  a ``StreamedPush``. Whoever writes the new weights (an optimizer's bucket hook: ``OffloadedAdam.add_bucket_hook``)
  calls ``ready(begin, end, event)`` for each range of byte addresses that holds its new values once ``event`` (a
  CUDA event; None: already there) has completed. Plan sources whose every byte has been reported are filled into
  their buckets on the stream's own thread, on the sender's CUDA stream after a wait for their events, in parts of
  1/8 of the update (Note [Streamed parts]), and a bucket whose sources are all filled goes to the transport.
  ``ready`` only queues: it returns in microseconds and never raises, so it can run between an optimizer's CPU
  kernel calls.
- ``finish()`` (the producer is done) fills every source not reported yet, ordered after the caller's current
  stream as a push is (the last part among them), commits, and returns the ``PushReport`` with ``streamed``
  (sources filled before the finish) and ``stream_fill_s`` (the thread's host time): the receiver holds the
  version when it returns. The sources that no range covers (not contiguous, or outside the producer's buffer) are
  simply filled there.
- Ranges must not overlap (each byte reported once per update): a range that overlaps an earlier one is an error.
- Only transports that take a whole update in one buffer stream (``streams(device)``: CUDA IPC, and the host
  transport for CPU tensors): buckets fill in the producer's order, not the plan's, so a transport that recycles
  bucket buffers in plan order would wait forever. Senders with tensor- or expert-parallel gathers are refused
  (their gathers are collectives that pair up in plan order on every rank).
- Failures: an error on the thread (the begin, a fill, a bad range) stops the filling; later ranges are ignored and
  ``finish()`` raises it after closing the transport, so the receiver keeps its version. ``abort()`` (the producer
  failed: nothing must be committed) stops the thread and closes the transport the same way. Either way nothing is
  committed: a receiver never holds a mix of two versions.
"""
from __future__ import annotations

import bisect
import queue
import threading
import time

import torch

from ..errors import InvalidArgumentError, StateError
from ._fill import BucketFill

__all__ = ["StreamedPush", "PushReport"]


class PushReport(dict):
    """``{"version", "seconds", "buckets", "wire_bytes", "source_bytes", "begin_s", "fill_s", "commit_s"}`` of one
    push (and ``open_s`` after an ``open``): ``begin_s`` the transport's begin (e.g. the IPC round trip that maps
    the receiver's staging) or, after an ``open``, the push's wait for it; ``open_s`` the begin's own time; ``fill_s``
    the host time queueing the gathers, fills and sends of every bucket, ``commit_s`` the commit (the receiver's
    apply included where the transport waits for it). A streamed push's adds ``streamed`` (sources filled before its
    finish), ``stream_fill_s`` (its thread's host time) and ``stream_s`` (from its start to its finish); its
    ``fill_s`` is the finish's."""


# Note [Streamed parts]
# The fills run on a Python thread beside the producer's (an optimizer stepping on the CPU between short GIL-free kernel
# calls). Every fill holds the GIL for its launches, and a producer that returns from a kernel while the fill holds it
# waits: filling each of the optimizer's buckets as it landed made the step longer by more than the fills saved
# (docs/results.md, the Megatron loop's --sync-fill runs). So completed sources wait until they make up 1/PARTS of the
# update's source bytes and go in one fill per bucket, and the thread takes every range queued meanwhile at once;
# finish() fills the last part after the producer is done (its GPU work then is one part's quantization).
PARTS = 8


class StreamedPush:
    """One update filled as its sources become ready (see the module policies). Made by ``Sender.streamed``."""

    def __init__(self, sender, version: int, opened):
        self.sender, self.version, self._opened = sender, version, opened
        self._t0 = time.perf_counter()
        tensors = sender._tensors()
        plan = sender.plan
        self._items = {it.source: (b, it) for b in plan.buckets for it in b.items}
        self._left = {b.index: len(b.items) for b in plan.buckets}  # sources of each bucket not filled yet
        self._filled: set = set()
        # every contiguous source by its address range, sorted; bytes still to be reported per source
        spans = []
        for it in plan.items:
            t = tensors[it.source]
            if t.is_contiguous() and t.numel() > 0:
                lo = t.data_ptr()
                spans.append((lo, lo + t.numel() * t.element_size(), it.source))
        spans.sort()
        self._lo = [s[0] for s in spans]
        self._spans = spans
        self._missing = {name: hi - lo for lo, hi, name in spans}
        self._bytes = dict(self._missing)
        # sources complete but not filled yet, their bytes and the events they wait for (Note [Streamed parts])
        self._pending, self._pending_bytes, self._events = [], 0, []
        self._part_bytes = max(1, plan.source_bytes // PARTS)
        self._reported: list = []  # sorted (begin, end) ranges reported so far
        self._fills: dict = {}  # (bucket index, sources) -> BucketFill of that part
        self._tensors = tensors
        self._error: BaseException | None = None
        self._stream_fill_s = 0.0
        self._streamed = 0
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._done = False
        self._thread = threading.Thread(target=self._run, name="ebbtide-sync-stream", daemon=True)
        self._thread.start()

    # ---- the producer's side -----------------------------------------------------------------------------------
    def ready(self, begin: int, end: int, event=None) -> None:
        """Bytes ``[begin, end)`` hold the new values once ``event`` completes (see the module policies)."""
        if not self._done:
            self._q.put((int(begin), int(end), event))

    __call__ = ready  # the stream itself is an OffloadedAdam bucket hook

    # ---- the thread ----------------------------------------------------------------------------------------------
    def _run(self) -> None:
        s = self.sender
        try:
            self._opened.result()  # the transport's begin: the receiver's buffer is there
            if s.cuda:
                torch.cuda.set_device(s.device)
        except BaseException as e:  # noqa: BLE001  (raised again by finish)
            self._error = e
        while True:
            batch = [self._q.get()]  # and whatever else is queued: one fill per bucket for all of it
            while True:
                try:
                    batch.append(self._q.get_nowait())
                except queue.Empty:
                    break
            ranges = [m for m in batch if m is not None]
            if ranges and self._error is None:
                try:
                    t0 = time.perf_counter()
                    self._take(ranges)
                    self._stream_fill_s += time.perf_counter() - t0
                except BaseException as e:  # noqa: BLE001
                    self._error = e
            if len(ranges) < len(batch):
                return

    def _covered(self, begin: int, end: int) -> list:
        """The sources whose last missing bytes ``[begin, end)`` reports, in address order."""
        if end <= begin:
            raise InvalidArgumentError(f"an empty or reversed range [{begin:#x}, {end:#x})")
        i = bisect.bisect_left(self._reported, (begin, end))
        if (i > 0 and self._reported[i - 1][1] > begin) or (i < len(self._reported) and self._reported[i][0] < end):
            raise InvalidArgumentError(f"range [{begin:#x}, {end:#x}) overlaps one reported before (each byte once "
                                       f"per update)")
        self._reported.insert(i, (begin, end))
        done = []
        j = max(0, bisect.bisect_right(self._lo, begin) - 1)
        while j < len(self._spans) and self._spans[j][0] < end:
            lo, hi, name = self._spans[j]
            n = min(hi, end) - max(lo, begin)
            if n > 0:
                self._missing[name] -= n
                if self._missing[name] == 0:
                    done.append(name)
            j += 1
        return done

    @torch.no_grad()
    def _take(self, ranges) -> None:
        """Account ``ranges``; once the sources they completed reach a part of the update (Note [Streamed parts]),
        fill them after their events."""
        for begin, end, event in ranges:
            done = self._covered(begin, end)
            if done:
                self._pending += done
                self._pending_bytes += sum(self._bytes[n] for n in done)
                if event is not None:
                    self._events.append(event)
        if self._pending_bytes < self._part_bytes:
            return
        s = self.sender
        if s.cuda:
            for ev in self._events:
                s.stream.wait_event(ev)
            with torch.cuda.stream(s.stream):
                self._fill(self._pending)
        else:
            self._fill(self._pending)
        self._streamed += len(self._pending)
        self._pending, self._pending_bytes, self._events = [], 0, []

    def _fill(self, names) -> None:
        """Fill ``names`` (sources not filled yet) into their buckets, one fill per bucket; hand every bucket that
        is then complete to the transport."""
        s, end = self.sender, self.sender.transport
        by_bucket: dict = {}
        for n in names:
            if n not in self._filled:
                b, it = self._items[n]
                by_bucket.setdefault(b.index, (b, []))[1].append(it)
        for idx, (b, items) in by_bucket.items():
            key = (idx, tuple(it.source for it in items))
            fill = self._fills.get(key)
            if fill is None:
                fill = self._fills[key] = BucketFill(s.plan, b, items)
            buf = end.buffer(b, s.stream)
            fill(self._tensors, buf)
            self._filled.update(key[1])
            self._left[idx] -= len(items)
            if self._left[idx] == 0:
                end.send(b, buf, s.stream)

    def _stop(self) -> None:
        if not self._done:
            self._done = True
            self._q.put(None)
        self._thread.join()

    # ---- the end ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def finish(self):
        """Fill what is left, commit and return the ``PushReport`` (see the module policies)."""
        s = self.sender
        if self._done:
            raise StateError(f"streamed update {self.version} already finished or aborted")
        t0 = time.perf_counter()
        self._stop()
        s._streaming = None
        if self._error is not None:
            s.transport.close()  # nothing committed: the receiver's update ends, it keeps its version
            raise self._error
        open_s = self._opened.result()
        t1 = time.perf_counter()
        rest = [it.source for it in s.plan.items if it.source not in self._filled]
        try:
            if rest:
                if s.cuda:
                    s.stream.wait_stream(torch.cuda.current_stream(s.device))
                    for ev in self._events:  # the last part's producer events (not always on the caller's stream)
                        s.stream.wait_event(ev)
                    with torch.cuda.stream(s.stream):
                        self._fill(rest)
                else:
                    self._fill(rest)
            t2 = time.perf_counter()
            s.transport.commit(self.version)
        except BaseException:
            s.transport.close()
            raise
        t3 = time.perf_counter()
        plan = s.plan
        return PushReport(version=self.version, seconds=t3 - t0, buckets=len(plan.buckets), wire_bytes=plan.nbytes,
                          source_bytes=plan.source_bytes, begin_s=t1 - t0, open_s=open_s, fill_s=t2 - t1,
                          commit_s=t3 - t2, streamed=self._streamed, stream_fill_s=self._stream_fill_s,
                          stream_s=t0 - self._t0)

    def abort(self) -> None:
        """Give the update up (the producer failed): nothing is committed, the receiver keeps its version."""
        if self._done:
            return
        self._stop()
        self.sender._streaming = None
        self._opened.exception()  # the begin has ended before the transport is touched again
        self.sender.transport.close()
