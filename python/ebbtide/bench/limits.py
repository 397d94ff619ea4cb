"""The physical limits, measured once per run and shared by every suite (memoized).

- host_triad_gbps: in-place triad a += s*b (native, all affinity threads): the host's streaming bandwidth.
- host_stream_gbps: the bytes per second of one kernel's own mix of streams (``MIXES``: the Adam steps' fp32
  param and moments updated in place, the gradient read, the bf16 copy written with non-temporal stores), walked
  together as the kernel walks them: the bound of that CPU kernel. Counting the bytes DRAM really moves for the mix
  (an in-place update reads and writes its line; a streamed write costs no write-allocate read) keeps a kernel's
  "of limit" a fraction of what its own access pattern can reach.
- d2d_gbps: device-to-device copy, bytes read + written: the bound of memory-bound kernels.
- h2d_gbps / d2h_gbps: pinned host <-> device copies: the bound of offload and CPU backup.
- bidir_gbps: H2D and D2H at once on two streams, aggregate: the bound of an overlapped pause + resume.
GPU probes use torch and CUDA events; each raises Skip with the reason where it cannot run.
"""
from __future__ import annotations

import statistics
from typing import Callable

from .registry import Skip

GB = 1e9


def host_triad(nbytes: int, threads: int = 0, passes: int = 8) -> float:
    """GB/s of the in-place triad a += s*b over ``nbytes`` arrays on ``threads`` threads (0: every thread of this
    process's CPU affinity), best of ``passes``: the bound of a CPU optimizer step. The native probe itself (no
    public API measures the host: it is the bench's limit, not something ebbtide offers)."""
    from .. import _native  # noqa: PLC0415

    C = _native.load()
    return C.host_triad_bandwidth(nbytes, threads or C.cpu_affinity_count(), passes) / GB


# A kernel's stream mix: (fp32 read, fp32 updated in place, bf16 read, bf16 updated in place, bf16 written) arrays,
# the counts ebt_host_stream_bandwidth takes; each with the bytes it moves per element and what it stands for.
MIXES: dict[str, tuple[tuple[int, int, int, int, int], int, str]] = {
    "adam_fp32_grads": ((1, 3, 0, 0, 0), 28, "Adam stream mix: fp32 grad read, param + moments updated"),
    "adam_bf16_grads": ((0, 3, 1, 0, 1), 28, "Adam stream mix: bf16 grad read, fp32 param + moments updated, "
                                             "bf16 copy written"),
    "adam_bf16_moments": ((0, 1, 1, 2, 1), 20, "Adam stream mix: bf16 grad read, fp32 param + bf16 moments "
                                               "updated, bf16 copy written"),
}


def host_stream(mix: str, total_bytes: int, threads: int = 0, passes: int = 8) -> float:
    """GB/s of the stream mix ``MIXES[mix]`` over arrays of ``total_bytes`` together, best of ``passes``."""
    from .. import _native  # noqa: PLC0415

    C = _native.load()
    counts, per_element, _ = MIXES[mix]
    return C.host_stream_bandwidth(*counts, total_bytes // per_element, threads or C.cpu_affinity_count(),
                                   passes) / GB


class Limits:
    def __init__(self, *, quick: bool, log: Callable[[str], None] = lambda s: None):
        self.quick = quick
        self._log = log
        self._cache: dict[str, float] = {}

    def measured(self) -> dict[str, float]:
        """Every limit probed so far in this run (GB/s)."""
        return dict(self._cache)

    def _memo(self, key: str, probe: Callable[[], float]) -> float:
        if key not in self._cache:
            self._log(f"measuring limit {key} ...")
            self._cache[key] = probe()
        return self._cache[key]

    # ---- host ------------------------------------------------------------------------------------------------
    def host_triad_gbps(self, threads: int = 0) -> float:
        from .. import _native  # noqa: PLC0415

        # "All threads" is keyed by its actual count, so every suite asking for the same thread count compares
        # with the same probe (two probes of one machine differed by 24% in one run on a VM).
        threads = threads or _native.load().cpu_affinity_count()

        def probe() -> float:
            # Arrays well past any L3 (quick runs too: a cached triad would overstate the limit); best of many
            # passes, since a limit must not be a pessimistic sample.
            return host_triad((256 if self.quick else 1024) << 20, threads, 8 if self.quick else 20)

        return self._memo(f"host_triad_gbps[t={threads}]", probe)

    def host_stream_gbps(self, mix: str, threads: int = 0) -> float:
        """GB/s of a CPU kernel's own stream mix (``MIXES``) on ``threads`` threads (0: the affinity count)."""
        from .. import _native  # noqa: PLC0415

        if mix not in MIXES:
            raise KeyError(f"unknown stream mix {mix!r}; the mixes: {', '.join(MIXES)}")
        threads = threads or _native.load().cpu_affinity_count()
        total = (512 if self.quick else 2048) << 20  # all arrays together, well past any L3
        return self._memo(f"host_stream_gbps[{mix},t={threads}]",
                          lambda: host_stream(mix, total, threads, 8 if self.quick else 20))

    @staticmethod
    def host_stream_name(mix: str, threads: int) -> str:
        return f"{MIXES[mix][2]} ({threads} threads)"

    # ---- GPU -------------------------------------------------------------------------------------------------
    def _torch_cuda(self):
        try:
            import torch  # noqa: PLC0415
        except ImportError as e:
            raise Skip("torch is not installed") from e
        if not torch.cuda.is_available():
            raise Skip("no CUDA GPU visible to torch")
        return torch

    def _time_copies(self, torch, fns: list, repeats: int) -> float:
        """Median seconds for running every fn once (each on its own stream), timed with events."""
        streams = [torch.cuda.Stream() for _ in fns]
        for fn, s in zip(fns, streams):  # warm-up
            with torch.cuda.stream(s):
                fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            cur = torch.cuda.current_stream()
            start.record(cur)
            for fn, s in zip(fns, streams):
                s.wait_stream(cur)
                with torch.cuda.stream(s):
                    fn()
            for s in streams:
                cur.wait_stream(s)
            end.record(cur)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    def _nbytes(self) -> int:
        return (256 if self.quick else 2048) << 20

    def d2d_gbps(self, device: int = 0) -> float:
        def probe() -> float:
            torch = self._torch_cuda()
            n = self._nbytes()
            with torch.cuda.device(device):
                src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
                dst = torch.empty_like(src)
                t = self._time_copies(torch, [lambda: dst.copy_(src)], 10 if self.quick else 30)
            return 2 * n / t / GB

        return self._memo(f"d2d_gbps[cuda:{device}]", probe)

    def _pinned_pair(self, torch, device: int):
        n = self._nbytes()
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(n, dtype=torch.uint8, device=f"cuda:{device}")
        return n, host, dev

    def h2d_gbps(self, device: int = 0) -> float:
        def probe() -> float:
            torch = self._torch_cuda()
            with torch.cuda.device(device):
                n, host, dev = self._pinned_pair(torch, device)
                t = self._time_copies(torch, [lambda: dev.copy_(host, non_blocking=True)], 5 if self.quick else 15)
            return n / t / GB

        return self._memo(f"h2d_gbps[cuda:{device}]", probe)

    def d2h_gbps(self, device: int = 0) -> float:
        def probe() -> float:
            torch = self._torch_cuda()
            with torch.cuda.device(device):
                n, host, dev = self._pinned_pair(torch, device)
                t = self._time_copies(torch, [lambda: host.copy_(dev, non_blocking=True)], 5 if self.quick else 15)
            return n / t / GB

        return self._memo(f"d2h_gbps[cuda:{device}]", probe)

    def bidir_gbps(self, device: int = 0) -> float:
        def probe() -> float:
            torch = self._torch_cuda()
            with torch.cuda.device(device):
                n, host_a, dev_a = self._pinned_pair(torch, device)
                _, host_b, dev_b = self._pinned_pair(torch, device)
                t = self._time_copies(torch, [lambda: dev_a.copy_(host_a, non_blocking=True),
                                              lambda: host_b.copy_(dev_b, non_blocking=True)],
                                      5 if self.quick else 15)
            return 2 * n / t / GB

        return self._memo(f"bidir_gbps[cuda:{device}]", probe)
