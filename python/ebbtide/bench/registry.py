"""The benchmark registry: suites register here, the runner walks them.

A suite is a function ``fn(ctx: Context) -> Iterable[Row]`` registered with :func:`suite`. Every row carries our
figure, the anchor's figure measured in the same run (or why there is none: "not installed", "n/a"), and the
physical limit measured in the same run (through ``ctx.limits``, which memoizes each probe for the whole run so all
suites compare against the same numbers).

Suites live in ``ebbtide.bench.suites.<name>`` and are imported lazily by the runner (``SUITE_MODULES``), so a
capability whose dependencies are missing only loses its own suite.
"""
from __future__ import annotations

import dataclasses
import inspect
import time
from typing import Callable, Iterable, Iterator

__all__ = ["Row", "Context", "Skip", "Suite", "suite", "registered", "timed", "SUITE_MODULES"]

# name -> module that registers it. Add a line when a capability lands its suite.
SUITE_MODULES: dict[str, str] = {
    "limits": "ebbtide.bench.suites.limits",
    "memory": "ebbtide.bench.suites.memory",
    "quant": "ebbtide.bench.suites.quant",
    "optim": "ebbtide.bench.suites.optim",
    "comm": "ebbtide.bench.suites.comm",
    "colocate": "ebbtide.bench.suites.colocate",
    "megatron": "ebbtide.bench.suites.megatron",
    "fsdp": "ebbtide.bench.suites.fsdp",
    "sync": "ebbtide.bench.suites.sync",
    "steady": "ebbtide.bench.suites.steady",
}


class Skip(Exception):
    """Raised by a suite (or a probe) that cannot run here; the message says why and is printed."""


@dataclasses.dataclass
class Row:
    """One measured figure beside its anchor and its limit.

    ``unit`` names the figure ("GB/s", "ms", "us", "s"); ``higher_is_better`` says how to read ratios.
    ``anchor`` is None when it was not measured, with ``anchor_note`` saying why ("not installed", "n/a").
    ``limit`` is the physical bound in the same unit, measured in this run, or None where no bound applies. A
    figure past its limit (``of_limit() > 1``) is marked in the table and the chart, with ``over_limit_why`` (or
    the report's general reason) beside it: never silently over 100%.
    """

    suite: str
    name: str
    unit: str
    ours: float | None
    higher_is_better: bool = True
    anchor: float | None = None
    anchor_name: str = ""
    anchor_note: str = ""
    limit: float | None = None
    limit_name: str = ""
    params: dict = dataclasses.field(default_factory=dict)
    note: str = ""
    # why the figure can pass its limit (of_limit() > 1), where the suite knows; the report says so beside it
    over_limit_why: str = ""

    def vs_anchor(self) -> float | None:
        """Speed-up over the anchor (> 1 means we are better), whatever the unit's direction."""
        if self.ours is None or self.anchor is None or self.ours == 0 or self.anchor == 0:
            return None
        return self.ours / self.anchor if self.higher_is_better else self.anchor / self.ours

    def of_limit(self) -> float | None:
        """Fraction of the physical limit reached (1.0 = at the limit)."""
        if self.ours is None or self.limit is None or self.ours == 0 or self.limit == 0:
            return None
        return self.ours / self.limit if self.higher_is_better else self.limit / self.ours

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["vs_anchor"] = self.vs_anchor()
        d["of_limit"] = self.of_limit()
        return d


@dataclasses.dataclass
class Suite:
    name: str
    fn: Callable[["Context"], Iterable[Row]]
    needs: str  # "cpu", "gpu" or "multigpu"
    description: str


_REGISTRY: dict[str, Suite] = {}


def suite(name: str, *, needs: str = "cpu", description: str = ""):
    """Register ``fn(ctx) -> Iterable[Row]`` as suite ``name``. ``needs`` is "cpu", "gpu" (one CUDA device) or
    "multigpu" (two or more)."""
    if needs not in ("cpu", "gpu", "multigpu"):
        raise ValueError(f"suite {name!r}: needs must be 'cpu', 'gpu' or 'multigpu', not {needs!r}")

    def deco(fn):
        # A suite is called as fn(ctx); catching a decorator on the wrong function here turns a GPU-only crash
        # (the suite would only run where a GPU is) into an import error every CPU run sees.
        params = [p for p in inspect.signature(fn).parameters.values() if p.default is p.empty]
        if len(params) != 1:
            raise TypeError(f"suite {name!r}: {fn.__qualname__} must take exactly one argument (ctx), "
                            f"has required parameters {[p.name for p in params]}")
        _REGISTRY[name] = Suite(name, fn, needs, description or (fn.__doc__ or "").strip().split("\n")[0])
        return fn

    return deco


def registered() -> dict[str, Suite]:
    return dict(_REGISTRY)


class Context:
    """What a suite sees: run options, the machine, the shared limit probes, and a progress printer."""

    def __init__(self, *, quick: bool, gpus: int, limits, log: Callable[[str], None]):
        self.quick = quick
        self.gpus = gpus
        self.limits = limits
        self._log = log
        self.skipped: list[tuple[str, str]] = []  # (what, why) for parts of a suite that could not run

    def note_skip(self, what: str, why: str) -> None:
        """Record a part of a suite that was skipped; the runner prints it under the table."""
        self.skipped.append((what, why))

    @property
    def has_gpu(self) -> bool:
        return self.gpus > 0

    def progress(self, msg: str) -> None:
        """One line of progress for long work (stderr, so the table on stdout stays clean)."""
        self._log(msg)

    def require_gpu(self, n: int = 1) -> None:
        if self.gpus < n:
            raise Skip(f"needs {n} CUDA GPU(s), found {self.gpus}")


def timed(fn: Callable[[], object], *, repeats: int, warmup: int = 1) -> Iterator[float]:
    """Wall-clock seconds of each of ``repeats`` calls after ``warmup`` untimed ones (CPU work only: GPU suites
    time with CUDA events)."""
    for _ in range(warmup):
        fn()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        yield time.perf_counter() - t0
