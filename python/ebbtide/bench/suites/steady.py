"""Suite `steady`: the steady phases -- decode and training -- with ebbtide beside the same code without it.

ebbtide wins the transitions; this suite checks that it costs nothing between them. Every row runs the same code
(the colocated loop's model, KV cache and ``GraphDecoder``: ``ebbtide.testing.models``) in a fresh process per memory setup
(``_steady_worker.MODES``): ``plain`` (no memory library: the anchor of every row), ebbtide's LD_PRELOAD shim with
a process default tag (the colocated rollout's setup), ebbtide's in-process regions, the
``torch_memory_saver``-compatible module, and torch_memory_saver itself in its torch and preload hook modes where it
is installed (in the notes). The setups run interleaved, ``rounds`` times each, so drift of the machine spreads over
all of them; rows give the median over every measurement and the spread (min-max of the per-round medians).

Rows: CUDA-graph decode (generate of ``new_tokens`` after an eager prefill) in steady state and as the first
generate after a pause/resume cycle, the decode step replayed alone right after the cycle against a steady one,
eager decode, a training forward + backward (also with ``OffloadedAdam`` attached, its gradient download overlapped
with the backward and not), and the allocation path under the caching allocator (``torch.empty`` that reaches the
allocator below it, per size class: the engine through the shim's default tag against the driver's ``cudaMalloc``;
a region of ebbtide against one of torch_memory_saver); and, in the plain process, the decode right after a weight
update received through ``ebbtide.sync`` against the same decode after the anchor's load of the same bytes; and the
FSDP2 loop's rollout decode (transformers' Qwen3, eager, at the loop's size) steady and right after a pause/resume
cycle, with the decoding thread's CPU time (where transformers is installed).
"""
from __future__ import annotations

import importlib.util
import os
import statistics

from ...testing import spawn
from ..registry import Row, Skip, suite
from ._steady_worker import ALLOC_SIZES

THEIR_MODES = ("tms-torch", "tms-preload")
PARTS = {  # what each setup measures (eager decode is host-bound: the setups that differ in the host path)
    "plain": ("decode", "eager", "train", "alloc", "update", "hf"),
    "ebbtide-preload": ("decode", "eager", "train", "alloc", "hf"),
    "ebbtide-torch": ("decode", "eager", "train", "alloc", "hf"),
    "compat-torch": ("decode", "train"),
    "tms-torch": ("decode", "eager", "train", "alloc", "hf"),
    "tms-preload": ("decode", "alloc"),
}
WORKER_PARTS = ("decode", "train", "alloc", "update", "hf")  # the worker's parts, in the order it runs them
OURS = ("ebbtide-preload", "ebbtide-torch", "compat-torch")
LABEL = {"ebbtide-preload": "ebbtide LD_PRELOAD shim, default tag", "ebbtide-torch": "ebbtide in-process regions",
         "compat-torch": "ebbtide.compat.torch_memory_saver", "tms-torch": "torch_memory_saver torch mode",
         "tms-preload": "torch_memory_saver preload mode", "plain": "no memory library"}
ANCHOR = "same code, no memory library"
DEFAULT_TAG = "steady_scratch"


def sizes(quick: bool) -> dict:
    """The worker spec's sizes: the colocated loop's default model and decode, or its quick model (--quick)."""
    import dataclasses  # noqa: PLC0415

    from ..colocate.config import model_for  # noqa: PLC0415

    model = dataclasses.asdict(model_for("toy", quick))
    hf = dict(hf_model=dataclasses.asdict(model_for("fsdp", quick)), hf_reps=2)  # the FSDP2 loop's rollout
    if quick:
        return dict(model=model, batch=8, prompt_len=64, new_tokens=64, cycles=2, reps=2, train_batch=4,
                    train_seq=256, train_reps=3, rounds=2, hf_batch=8, hf_prompt_len=64, hf_new_tokens=32, **hf)
    return dict(model=model, batch=16, prompt_len=128, new_tokens=128, cycles=3, reps=3, train_batch=8,
                train_seq=512, train_reps=5, rounds=3, hf_batch=16, hf_prompt_len=128, hf_new_tokens=32, **hf)


def worker_env(mode: str) -> dict:
    """The worker's environment: this one without LD_PRELOAD, plus the setup's shim."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if mode == "ebbtide-preload":
        import ebbtide.memory as em  # noqa: PLC0415

        return em.preload_env(em.without_expandable_segments(env), default_tag=DEFAULT_TAG)
    if mode == "tms-preload":
        from ...anchors.tms import preload_library  # noqa: PLC0415

        lib = preload_library()
        if lib is None:
            raise Skip("torch_memory_saver's preload library not found")
        env["LD_PRELOAD"] = lib
    return env


def run_worker(mode: str, spec: dict, timeout: float = 900, skip: tuple = ()) -> tuple[dict | None, str]:
    """One worker process (``skip``: parts left out); (its JSON, "") or (None, why it failed)."""
    parts = [p for p in PARTS[mode] if p not in skip]
    decodes = [d for d, p in (("graph", "decode"), ("eager", "eager")) if p in parts]
    wspec = dict(spec, mode=mode, decodes=decodes,
                 parts=[p for p in WORKER_PARTS if p in parts or (p == "decode" and decodes)])
    try:
        return spawn.call("measure", wspec, module="ebbtide.bench.suites._steady_worker", env=worker_env(mode),
                          timeout=timeout, teardown=False), ""
    except spawn.WorkerFailed as e:
        return None, e.brief


def brief(res: dict) -> str:
    """One worker's headline medians (ms), for the progress line."""
    out = []
    for key, path in (("graph decode", ("decode", "graph", "generate_s")),
                      ("its device time", ("decode", "graph", "decode_gpu_s")),
                      ("after a cycle", ("decode", "graph", "first_after_cycle_s")),
                      ("eager decode", ("decode", "eager", "generate_s")), ("fwd+bwd", ("train", "fwd_bwd_s")),
                      ("hf decode", ("hf", "generate_s")), ("its CPU", ("hf", "cpu_s")),
                      ("hf after a cycle", ("hf", "after_cycle_s"))):
        s = summary([res], path, 1e3)
        if s:
            out.append(f"{key} {s['median']:.1f}")
    return ", ".join(out) + " ms" if out else "no figures"


def collect(runs: list[dict], path: tuple) -> tuple[list, list]:
    """Every value under ``path`` across the rounds, and each round's median."""
    every, per_round = [], []
    for r in runs:
        v = r
        for k in path:
            v = v.get(k) if isinstance(v, dict) else None
        if v:
            vals = v if isinstance(v, list) else [v]
            every += vals
            per_round.append(statistics.median(vals))
    return every, per_round


def summary(runs: list[dict], path: tuple, scale: float = 1.0) -> dict | None:
    every, per_round = collect(runs, path)
    if not every:
        return None
    return {"median": statistics.median(every) * scale, "lo": min(per_round) * scale, "hi": max(per_round) * scale,
            "n": len(every)}


def _spread(s: dict | None, unit: str) -> str:
    return f"{s['median']:.1f} {unit} (rounds {s['lo']:.1f}-{s['hi']:.1f}, n={s['n']})" if s else "n/a"


@suite("steady", needs="gpu", description="steady phases: decode and training with ebbtide vs the same code without")
def run(ctx):
    ctx.require_gpu()
    spec = sizes(ctx.quick)
    rounds = spec.pop("rounds")
    modes = list(PARTS)
    have_tms = importlib.util.find_spec("torch_memory_saver") is not None
    if not have_tms:
        modes = [m for m in modes if m not in THEIR_MODES]
        ctx.note_skip("steady: torch_memory_saver setups", "not installed")
    skip = ()
    if importlib.util.find_spec("transformers") is None:
        skip = ("hf",)
        ctx.note_skip("steady: the FSDP2 loop's rollout decode", "transformers is not installed")
    runs: dict = {m: [] for m in modes}
    failed: dict = {}
    for r in range(rounds):
        for m in modes:
            if m in failed:
                continue
            ctx.progress(f"steady: round {r + 1}/{rounds}, {m} ...")
            try:
                res, why = run_worker(m, spec, skip=skip)
            except Skip as e:
                res, why = None, str(e)
            if res is None:
                failed[m] = why
                ctx.note_skip(f"steady: {m}", why)
                continue
            runs[m].append(res)
            ctx.progress(f"steady: {m}: {brief(res)}")  # the figures survive a run stopped before the table
    if not runs["plain"]:
        raise Skip(f"the reference setup failed: {failed.get('plain')}")
    params = {k: spec[k] for k in ("batch", "prompt_len", "new_tokens", "train_batch", "train_seq")}
    params.update(model=spec["model"], rounds=rounds)
    yield from decode_rows(runs, params)
    yield from train_rows(runs, params)
    yield from alloc_rows(runs)
    yield from update_rows(runs["plain"], params)
    yield from hf_rows(runs, {k: spec[k] for k in ("hf_model", "hf_batch", "hf_prompt_len", "hf_new_tokens")})


def _row(name, ours, anchor, unit, params, note, anchor_name=ANCHOR):
    return Row("steady", name, unit, ours["median"] if ours else None, higher_is_better=False,
               anchor=anchor["median"] if anchor else None, anchor_name=anchor_name if anchor else "",
               anchor_note="" if anchor else "n/a", params=params, note=note)


def _others(runs: dict, path: tuple, scale: float, unit: str) -> str:
    """torch_memory_saver's figures for the same measurement (notes only: it is not the anchor of these rows)."""
    out = [f"{LABEL[m]} {_spread(summary(runs[m], path, scale), unit)}" for m in THEIR_MODES if runs.get(m)]
    return "; ".join(out)


def decode_rows(runs: dict, params: dict):
    plain = runs["plain"]
    for label, key, path in (("CUDA-graph decode, steady", "graph", ("decode", "graph", "generate_s")),
                             ("CUDA-graph decode, first generate after a pause/resume cycle", "graph",
                              ("decode", "graph", "first_after_cycle_s")),
                             ("eager decode, steady", "eager", ("decode", "eager", "generate_s"))):
        base = summary(plain, path, 1e3)
        gpu_path = path[:2] + ("decode_gpu_s",)
        for m in OURS:
            if not runs.get(m) or summary(runs[m], path) is None:
                continue
            ours = summary(runs[m], path, 1e3)
            gpu, gpu_base = summary(runs[m], gpu_path, 1e3), summary(plain, gpu_path, 1e3)
            note = f"ours {_spread(ours, 'ms')}, plain {_spread(base, 'ms')}"
            if key == "graph" and gpu and gpu_base:
                note += f"; device time of the steps {gpu['median']:.1f} vs {gpu_base['median']:.1f} ms"
            other = _others(runs, path, 1e3, "ms")
            yield _row(f"{label} ({LABEL[m]})", ours, base, "ms", dict(params, mode=m),
                       note + (f"; {other}" if other else ""))
    for m in OURS[:2]:
        steady = summary(runs.get(m, []), ("decode", "graph", "step_us"))
        after = summary(runs.get(m, []), ("decode", "graph", "step_after_cycle_us"))
        if steady and after:
            yield _row(f"decode step replayed right after a pause/resume cycle ({LABEL[m]})", after, steady, "us",
                       dict(params, mode=m), f"goal: within 5% of a steady step; plain "
                       f"{_spread(summary(plain, ('decode', 'graph', 'step_us')), 'us')}",
                       anchor_name="a steady step, same process")


def train_rows(runs: dict, params: dict):
    base = summary(runs["plain"], ("train", "fwd_bwd_s"), 1e3)
    for m in OURS:
        ours = summary(runs.get(m, []), ("train", "fwd_bwd_s"), 1e3)
        if ours:
            other = _others(runs, ("train", "fwd_bwd_s"), 1e3, "ms")
            yield _row(f"training forward + backward ({LABEL[m]})", ours, base, "ms", dict(params, mode=m),
                       f"ours {_spread(ours, 'ms')}, plain {_spread(base, 'ms')}" + (f"; {other}" if other else ""))
    for m in ("ebbtide-torch",):
        for how, key in (("gradient download overlapped with the backward", "fwd_bwd_offloaded_overlap_s"),
                         ("gradient download after the backward", "fwd_bwd_offloaded_plain_s")):
            ours = summary(runs.get(m, []), ("train", key), 1e3)
            if ours:
                yield _row(f"training forward + backward with OffloadedAdam, {how}", ours, base, "ms",
                           dict(params, mode=m), f"ours {_spread(ours, 'ms')}; the step itself is not timed "
                           "(with overlap the backward also launches the device-to-host copies)")


def update_rows(plain: list, params: dict):
    """Decode right after a weight update: ebbtide.sync's receive against the anchor's load of the same bytes."""
    ours = summary(plain, ("update", "ebbtide", "generate_s"), 1e3)
    theirs = summary(plain, ("update", "torch", "generate_s"), 1e3)
    if not ours or not theirs:
        return
    dev = {c: summary(plain, ("update", c, "decode_gpu_s"), 1e3) for c in ("ebbtide", "torch")}
    load = {c: summary(plain, ("update", c, "load_s"), 1e3) for c in ("ebbtide", "torch")}
    yield _row("CUDA-graph decode right after a weight update (ebbtide.sync receive vs the anchor's load)", ours,
               theirs, "ms", params,
               f"device time of the steps {dev['ebbtide']['median']:.1f} vs {dev['torch']['median']:.1f} ms; the "
               f"loads themselves {_spread(load['ebbtide'], 'ms')} vs {_spread(load['torch'], 'ms')}; another "
               "context works before each load, as the trainer does (a kernel-running private stream in the "
               "receiver made this 1.10x on an H100)",
               anchor_name="same decode after the anchor's load (one copy + torch formula, caller's stream)")


def alloc_rows(runs: dict):
    def cold(mode, where, size):
        return summary(runs.get(mode, []), ("alloc", f"{where}/{size}", "cold_us"))

    def warm(mode, where, size):
        return summary(runs.get(mode, []), ("alloc", f"{where}/{size}", "warm_us"))

    for size in ALLOC_SIZES:
        human = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB" if size >= 1024 else f"{size} B"
        ours, base = cold("ebbtide-preload", "default", size), cold("plain", "default", size)
        if ours:
            w, wb = warm("ebbtide-preload", "default", size), warm("plain", "default", size)
            floor = {k: summary(runs.get("plain", []), ("alloc", "vmm", str(size), k))
                     for k in ("total_us", "create_us", "map_us", "access_us")}
            row = _row(f"torch.empty {human} reaching the allocator (shim default tag vs cudaMalloc)", ours, base,
                       "us", {"bytes": size, **{f"vmm_{k}": round(v["median"], 1) for k, v in floor.items() if v}},
                       f"a cached block: {_spread(w, 'us')} vs {_spread(wb, 'us')}",
                       anchor_name="the driver's cudaMalloc")
            if floor["total_us"]:
                row.limit = floor["total_us"]["median"]
                row.limit_name = "the driver's VMM calls alone (cuMemCreate + Map + SetAccess + Release)"
            yield row
        ours, tms = cold("ebbtide-torch", "region", size), cold("tms-torch", "region", size)
        if ours:
            yield _row(f"torch.empty {human} reaching the allocator in a region (ebbtide vs torch_memory_saver)",
                       ours, tms, "us", {"bytes": size}, "each try in a fresh tag, paused afterwards",
                       anchor_name="torch_memory_saver torch mode")


def hf_rows(runs: dict, params: dict):
    """The FSDP2 loop's rollout decode (transformers' Qwen3, eager) in each ebbtide setup beside the plain process,
    steady and right after a pause/resume cycle; the thread's CPU time in the note (host-bound: it is the wall time,
    so a slower host path shows there)."""
    plain = runs["plain"]
    for label, wall, cpu in (("steady", "generate_s", "cpu_s"),
                             ("first generate after a pause/resume cycle", "after_cycle_s", "after_cycle_cpu_s")):
        base = summary(plain, ("hf", wall), 1e3)
        for m in ("ebbtide-preload", "ebbtide-torch"):
            ours = summary(runs.get(m, []), ("hf", wall), 1e3)
            if not ours or not base:
                continue
            c_ours, c_base = summary(runs[m], ("hf", cpu), 1e3), summary(plain, ("hf", cpu), 1e3)
            note = f"ours {_spread(ours, 'ms')}, plain {_spread(base, 'ms')}"
            if c_ours and c_base:
                note += f"; the thread's CPU time {c_ours['median']:.1f} vs {c_base['median']:.1f} ms"
            other = _others(runs, ("hf", wall), 1e3, "ms")
            yield _row(f"transformers Qwen3 eager decode, {label} (the FSDP2 loop's rollout; {LABEL[m]})", ours,
                       base, "ms", dict(params, mode=m), note + (f"; {other}" if other else ""))
