"""Measurements of the colocated loop: phase records, NVML per-process GPU memory, summaries, checks, the table and
the PNG timeline. Pure Python (no torch) except where a probe needs the driver, so the logic is CPU-tested.

Policies:
- A phase is a named interval on one rank's wall clock (``time.perf_counter``), ending after the device work it
  started is complete. The trainer drives the rollout by RPC, so rollout phases are timed from the trainer (what the
  loop pays) and the rollout also reports its own time inside the call.
- Per-step time is the sum of the step's phases (the verification work between phases is excluded); across ranks
  the slowest rank's step counts. Summaries take the median over steps after ``warmup``.
- GPU memory per process comes from NVML (``nvmlDeviceGetComputeRunningProcesses``). Containers often report host
  PIDs, so a process NVML does not list under its own PID is identified by appearance: the launcher snapshots the
  PIDs on every GPU before starting anything ("other"), then each process's PIDs are those that appear right
  after it made its context. Each process also reports its own view (ebbtide: bytes active in the engine).
- Growth check: device memory used (NVML, else cudaMemGetInfo) at the end of every step after ``warmup`` must stay
  within ``GROWTH_TOLERANCE`` of the first such step.
"""
from __future__ import annotations

import statistics
import time

__all__ = ["PHASES", "MEGATRON_PHASES", "held_above_context", "STEADY_PHASES", "Recorder", "NvmlProbe", "nvml_all_pids", "summarize",
           "growth_check", "steady_check", "format_report", "plot_timeline", "GROWTH_TOLERANCE", "STEADY_TOLERANCE",
           "PATHS", "path_lines"]

# The order of one RL step of the toy loop. "comm_*" only run with 2+ GPUs.
PHASES = ("train", "optimizer", "sync_pack", "trainer_pause", "comm_release", "rollout_resume", "sync_load", "generate",
          "rollout_pause", "trainer_resume", "comm_reload")
# The Megatron loop's step (one GPU; Megatron's groups are released and reloaded there too).
MEGATRON_PHASES = ("train", "optimizer", "rollout_resume", "sync", "comm_release", "offload", "generate",
                   "rollout_pause", "onload", "comm_reload")
KNOWN_PHASES = tuple(dict.fromkeys(PHASES + MEGATRON_PHASES))
# The phases that run the same code in every variant (forward + backward; the rollout's generation): ebbtide must
# not make them slower. The default tolerance of the loop's guard (ebbtide's median over the anchor's).
STEADY_PHASES = ("train", "generate")
STEADY_TOLERANCE = 0.03
# What the rollout reports of its generation, ebbtide's optimizer of its CPU pipeline, its sender of a push and its
# training state of an offload besides the phase's time (medians kept in the summary's "detail").
# What a generate reply carries into its phase: the time inside, the tokens, the device spans (graph decode), the
# caching allocator's mallocs and the generating thread's own CPU time and context switches (a decode slower by as
# much as its thread's CPU time is: more host work; slower with the same CPU time: the thread waited or was preempted).
GENERATE_KEYS = ("tokens", "inside_s", "prefill_gpu_s", "decode_gpu_s", "host_enqueue_s", "prefill_host_s",
                 "device_mallocs", "host_cpu_s", "switches_voluntary", "switches_involuntary")
DETAIL_KEYS = ("inside_s", "decode_gpu_s", "prefill_gpu_s", "host_enqueue_s", "prefill_host_s", "device_mallocs",
               "host_cpu_s", "switches_voluntary", "switches_involuntary",
               "prepare_s", "norm_s", "hooks_s", "update_s", "pipeline_s", "kernel_s", "copy_wait_s", "kernel_gbps",
               "begin_s", "open_s", "fill_s", "commit_s", "close_s", "drain_s", "empty_cache_s", "pause_s", "trim_s",
               "sm_clock_mhz")
ROLLOUT_PHASES = ("rollout_resume", "sync_load", "generate", "rollout_pause")
GROWTH_TOLERANCE = 16 << 20  # bytes: a few driver pages of slack; everything above is reported as growth


class Recorder:
    """Collects phase intervals and memory samples for one rank."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.phases: list[dict] = []
        self.memory: list[dict] = []
        self._origin = clock()

    def phase(self, step: int, name: str):
        rec = self

        class _Span:
            def __enter__(self):
                self.info = {}
                self.t0 = rec.clock()
                return self.info

            def __exit__(self, et, ev, tb):
                if et is None:
                    t1 = rec.clock()
                    rec.phases.append({"step": step, "phase": name, "t0": self.t0 - rec._origin,
                                       "t1": t1 - rec._origin, "s": t1 - self.t0, **self.info})
                return False

        if name not in KNOWN_PHASES:
            raise ValueError(f"unknown phase {name!r} (known: {KNOWN_PHASES})")
        return _Span()

    def sample(self, step: int, phase: str, mem: dict):
        self.memory.append({"step": step, "phase": phase, **mem})


class NvmlProbe:
    """Per-process GPU memory on one device, each process named by its role (trainer, rollout, ...). Never
    raises: ``why`` says what is missing. NVML itself is ``ebbtide._nvml`` (the package's one reader of it; NVML
    is not an API ebbtide offers, so the bench reads it through the package's own private helper)."""

    def __init__(self, *, uuid: str | None = None, index: int | None = None):
        from ..._nvml import Device  # noqa: PLC0415

        self._dev = Device(uuid=uuid, index=index)
        self.roles: dict[int, str] = {}

    @classmethod
    def unavailable(cls, why: str) -> "NvmlProbe":
        probe = cls.__new__(cls)
        probe._dev, probe.roles = None, {}
        probe._why = why
        return probe

    @property
    def why(self) -> str:
        return self._dev.why if self._dev is not None else self._why

    @property
    def ok(self) -> bool:
        return self._dev is not None and self._dev.ok

    def processes(self) -> dict[int, int]:
        """{pid: bytes used} as NVML reports them (None bytes when the driver hides them)."""
        return (self._dev.processes() if self._dev is not None else None) or {}

    def device_used(self) -> int | None:
        return self._dev.memory_used() if self._dev is not None else None

    def sm_clock_mhz(self) -> int | None:
        """The device's SM clock now (MHz), or None. A GPU left idle (a CPU optimizer step) clocks down, and the
        first kernels after it run slower until it clocks up again."""
        return self._dev.sm_clock_mhz() if self._dev is not None else None

    def assign(self, pids, role: str) -> None:
        for p in pids:
            self.roles.setdefault(int(p), role)

    def claim(self, role: str, pid: int | None = None) -> list[int]:
        """Assign ``pid`` to ``role`` when NVML lists it (same PID namespace); otherwise every PID NVML lists that
        has no role yet (containers: NVML shows host PIDs; call right after that process made its context)."""
        procs = self.processes()
        new = [pid] if pid is not None and pid in procs else [p for p in procs if p not in self.roles]
        for p in new:
            self.roles[p] = role
        return new

    def sample(self) -> dict:
        procs = self.processes()
        by_role: dict[str, int] = {}
        unknown = {}
        for pid, used in procs.items():
            role = self.roles.get(pid)
            if role is None:
                unknown[str(pid)] = used
            elif used is not None:
                by_role[role] = by_role.get(role, 0) + used
        out = {"nvml": by_role, "device_used": self.device_used()}
        if unknown:
            out["nvml_unknown"] = unknown
        return out


def nvml_all_pids() -> list[int]:
    """PIDs with a compute context on any GPU, as NVML reports them ([] without NVML)."""
    from ..._nvml import compute_pids  # noqa: PLC0415

    return compute_pids()


# ---- summaries -----------------------------------------------------------------------------------------------
def step_times(phases: list[dict]) -> dict[int, float]:
    """step -> seconds (sum of that step's phases on one rank)."""
    out: dict[int, float] = {}
    for p in phases:
        out[p["step"]] = out.get(p["step"], 0.0) + p["s"]
    return out


# The colocated step's two critical paths (phases of the Megatron loop, in step order): from the backward done to
# the rollout holding the new weights, and from the rollout paused to the trainer's first forward.
PATHS = {"update": ("optimizer", "rollout_resume", "sync"), "restart": ("onload", "comm_reload")}


def _paths(ranks: list[dict], measured: list[int]) -> dict:
    """path -> median over the measured steps of the slowest rank's sum of the path's phases (where all ran)."""
    out = {}
    for name, parts in PATHS.items():
        per_step = []
        for s in measured:
            sums = []
            for r in ranks:
                got = {p["phase"]: p["s"] for p in r["phases"] if p["step"] == s and p["phase"] in parts}
                if len(got) == len(parts):
                    sums.append(sum(got.values()))
            if sums:
                per_step.append(max(sums))
        if per_step:
            out[name] = statistics.median(per_step)
    return out


def summarize(ranks: list[dict], warmup: int) -> dict:
    """Combine per-rank results (each {"phases": [...], "memory": [...], ...}) into medians over steps >= warmup.
    A phase's time for a step is the slowest rank's; so is the step time. Phases keep the order of the step."""
    if not ranks:
        raise ValueError("no rank results to summarize")
    order = list(dict.fromkeys(p["phase"] for p in ranks[0]["phases"]))
    steps = sorted({p["step"] for p in ranks[0]["phases"]})
    measured = [s for s in steps if s >= warmup] or steps
    per_phase: dict[str, list[float]] = {}
    for name in order:
        vals = []
        for s in measured:
            xs = [p["s"] for r in ranks for p in r["phases"] if p["step"] == s and p["phase"] == name]
            if xs:
                vals.append(max(xs))
        if vals:
            per_phase[name] = vals
    totals = []
    for s in measured:
        totals.append(max(step_times([p for p in r["phases"] if p["step"] == s]).get(s, 0.0) for r in ranks))
    bytes_moved: dict[str, float] = {}
    for name in order:
        xs = [p.get("bytes", 0) for p in ranks[0]["phases"] if p["phase"] == name and p["step"] in measured]
        if xs and any(xs):
            bytes_moved[name] = statistics.median(xs)
    mem: dict[str, dict] = {}
    for name in order:
        rows = [m for m in ranks[0]["memory"] if m["phase"] == name and m["step"] in measured]
        if rows:
            mem[name] = _mem_median(rows)
    detail: dict[str, dict] = {}
    for name in order:
        for key in DETAIL_KEYS:
            xs = [p[key] for p in ranks[0]["phases"] if p["phase"] == name and p["step"] in measured and key in p]
            if xs:
                detail.setdefault(name, {})[key] = statistics.median(xs)
    return {
        "steps": len(measured),
        "phase_s": {k: statistics.median(v) for k, v in per_phase.items()},
        "phase_s_all": per_phase,  # each measured step's (slowest rank's) time, in step order
        "detail": detail,
        "step_s": statistics.median(totals) if totals else None,
        "step_s_all": totals,
        "bytes": bytes_moved,
        "memory": mem,
        "losses": [p["loss"] for p in ranks[0]["phases"] if p["phase"] == "train" and "loss" in p],
        "paths_s": _paths(ranks, measured),
    }


def held_above_context(vr: dict):
    """A variant's result (``run_variant`` + its summary): its rank 0 trainer's NVML bytes while the rollout
    generates (median) above the trainer's CUDA context; None where either was not read."""
    m = (vr.get("summary") or {}).get("memory", {}).get("generate", {}).get("trainer_nvml")
    c = ((vr.get("ranks") or [{}])[0].get("setup") or {}).get("context_bytes")
    return None if m is None or c is None else m - c


def _mem_median(rows: list[dict]) -> dict:
    out = {}
    for role in ("trainer", "rollout"):
        xs = [r["nvml"][role] for r in rows if role in r.get("nvml", {})]
        if xs:
            out[f"{role}_nvml"] = statistics.median(xs)
        xs = [r["self"][role] for r in rows if role in r.get("self", {})]
        if xs:
            out[f"{role}_self"] = statistics.median(xs)
    xs = [r["device_used"] for r in rows if r.get("device_used") is not None]
    if xs:
        out["device_used"] = statistics.median(xs)
    return out


def growth_check(memory: list[dict], warmup: int, *, phase: str = "comm_reload", fallback: str = "trainer_resume",
                 tolerance: int = GROWTH_TOLERANCE) -> dict:
    """Device memory at the end of each step (the last phase present) must not grow after the warm-up steps."""
    have = {m["phase"] for m in memory}
    end = phase if phase in have else fallback
    series = [(m["step"], m.get("device_used")) for m in memory if m["phase"] == end and m["step"] >= warmup]
    series = [(s, v) for s, v in series if v is not None]
    if len(series) < 2:
        return {"ok": None, "why": f"need 2+ steps after warm-up with a device reading (have {len(series)})",
                "series": series}
    base = series[0][1]
    growth = max(v for _, v in series) - base
    return {"ok": growth <= tolerance, "growth_bytes": growth, "tolerance": tolerance, "phase": end,
            "series": series}


def steady_check(results: dict, tolerance: float = STEADY_TOLERANCE) -> list[dict]:
    """The steady phases of the ebbtide variant against every other variant that ran them (medians over the same
    measured steps): one entry per (phase, anchor) with the ratio ours / anchor and ``ok`` (ratio <= 1 +
    tolerance). Empty when ebbtide or every anchor is missing."""
    v = results.get("variants", {})
    ours = (v.get("ebbtide") or {}).get("summary")
    out = []
    if not ours:
        return out
    setup = ((v["ebbtide"].get("ranks") or [{}])[0] or {}).get("setup", {})
    # the Megatron loop's ebbtide variant uploads its weights under the first forward: its train phase holds that
    # upload's tail, so it is not the same code as an anchor's train (reported, not guarded)
    unguarded = {"train"} if setup.get("onload_overlaps_train") else set()
    for name, info in v.items():
        anchor = info.get("summary")
        if name == "ebbtide" or not anchor:
            continue
        for ph in STEADY_PHASES:
            a, b = ours["phase_s"].get(ph), anchor["phase_s"].get(ph)
            if not a or not b:
                continue
            entry = {"phase": ph, "anchor": name, "ours_s": a, "anchor_s": b, "ratio": a / b,
                     "ok": ph in unguarded or a / b <= 1 + tolerance, "guarded": ph not in unguarded}
            da, db = (s.get("detail", {}).get(ph, {}).get("decode_gpu_s") for s in (ours, anchor))
            if da and db:
                entry.update(ours_device_s=da, anchor_device_s=db)
            entry.update(_spread(ours, anchor, ph, tolerance))
            out.append(entry)
    return out


def _spread(ours: dict, anchor: dict, phase: str, tolerance: float) -> dict:
    """Each side's range over its measured steps, and ``within_spread``: the two ranges overlap and one of them is
    wider than the tolerance, so the medians of these few steps cannot tell the two apart by that much (the verdict
    stands; the report says to run more steps)."""
    xs, ys = ((s.get("phase_s_all") or {}).get(phase) or [] for s in (ours, anchor))
    if len(xs) < 2 or len(ys) < 2:
        return {}
    wide = max(max(xs) / min(xs), max(ys) / min(ys)) - 1 > tolerance
    return {"ours_range_s": [min(xs), max(xs)], "anchor_range_s": [min(ys), max(ys)],
            "within_spread": wide and min(xs) <= max(ys) and min(ys) <= max(xs)}


def steady_lines(checks: list[dict], tolerance: float) -> list[str]:
    if not checks:
        return []
    lines = ["", f"== steady phases (the same code in every variant; guard: ebbtide at most {tolerance:.0%} slower)"]
    for c in checks:
        dev = (f"; decode on the device {c['ours_device_s'] * 1e3:.1f} vs {c['anchor_device_s'] * 1e3:.1f} ms"
               if "ours_device_s" in c else "")
        verdict = ("not guarded: includes the tail of the weights' upload (restore(overlap_forward=True))"
                   if not c.get("guarded", True) else "ok" if c["ok"] else "SLOWER")
        lines.append(f"{c['phase']:<10} ebbtide {c['ours_s'] * 1e3:8.1f} ms  {c['anchor']:<14} "
                     f"{c['anchor_s'] * 1e3:8.1f} ms  ratio {c['ratio']:.3f}  {verdict}{dev}")
        if c.get("within_spread"):
            (a0, a1), (b0, b1) = c["ours_range_s"], c["anchor_range_s"]
            lines.append(f"{'':<10} steps ranged {a0 * 1e3:.1f}-{a1 * 1e3:.1f} vs {b0 * 1e3:.1f}-{b1 * 1e3:.1f} ms: "
                         f"within the step-to-step spread, more steps (--steps) tell them apart")
    return lines


# ---- report --------------------------------------------------------------------------------------------------
def _ms(x):
    return f"{'-':>9}" if x is None else f"{1e3 * x:9.1f}"


def _gb(x):
    return "-" if x is None else f"{x / 1e9:6.2f}"


def format_report(results: dict) -> str:
    """results: {"variants": {name: {"summary": ..., "checks": ..., "setup": ...}}, "config": ...}."""
    v = results["variants"]
    names = sorted((n for n in v if v[n].get("summary")), key=lambda n: n != "ebbtide")  # ebbtide first
    lines = []
    hdr = f"{'phase':<16}" + "".join(f"{n + ' ms':>14}" for n in names)
    # one ratio column per anchor (anchor time / ebbtide time), when ebbtide ran
    ratios = names[1:] if names and names[0] == "ebbtide" else []
    hdr += "".join(f"{'speed-up' if len(ratios) == 1 else 'vs ' + n:>12}" for n in ratios)
    decode = (results.get("config") or {}).get("decode", "eager")
    lines += [f"== per-phase time (median over measured steps; slowest rank; rollout decode: {decode})", hdr]
    order = list(dict.fromkeys(ph for n in names for ph in v[n]["summary"]["phase_s"]))
    for ph in order + ["step"]:
        vals = [(v[n]["summary"]["step_s"] if ph == "step" else v[n]["summary"]["phase_s"].get(ph)) for n in names]
        if all(x is None for x in vals):
            continue
        row = f"{ph:<16}" + "".join(f"{_ms(x):>14}" for x in vals)
        for i in range(1, len(ratios) + 1):
            row += f"{vals[i] / vals[0]:>11.2f}x" if vals[0] and vals[i] else f"{'-':>12}"
        lines.append(row)
    for n in names:
        s = v[n]["summary"]
        lines += ["", f"== {n}: GPU memory after each phase (GB; NVML per process, self-reported in brackets)",
                  f"{'after phase':<16}{'trainer':>18}{'rollout':>18}{'device used':>13}"]
        for ph, m in s["memory"].items():
            if not m:
                continue
            t = f"{_gb(m.get('trainer_nvml'))} [{_gb(m.get('trainer_self'))}]"
            r = f"{_gb(m.get('rollout_nvml'))} [{_gb(m.get('rollout_self'))}]"
            lines.append(f"{ph:<16}{t:>18}{r:>18}{_gb(m.get('device_used')):>13}")
        if s["bytes"]:
            lines.append("bytes moved per step: " + ", ".join(f"{k} {b / 1e9:.3f} GB" for k, b in s["bytes"].items()))
        setup = (v[n].get("ranks") or [{}])[0].get("setup", {})
        held, ctx = s["memory"].get("generate", {}).get("trainer_nvml"), setup.get("context_bytes")
        if held is not None and ctx is not None:
            lines.append(f"trainer GPU memory while the rollout generates: {(held - ctx) / 1e9:.3f} GB above its CUDA "
                         f"context ({held / 1e9:.3f} GB held, context {ctx / 1e9:.3f} GB)")
        if s.get("losses"):
            lines.append(f"losses (every step, rank 0): {', '.join(f'{x:.4f}' for x in s['losses'])}")
        lines += _check_lines(v[n].get("checks", {}))
        if setup:
            keys = ("device_name", "params", "optimizer", "sync_bytes", "sync_bf16_bytes", "context_bytes", "nvml")
            lines.append("setup: " + ", ".join(f"{k}={setup[k]}" for k in keys if k in setup))
            if setup.get("rollout"):
                lines.append(f"rollout: {setup['rollout']}")
    lines += _decode_lines(v)
    lines += path_lines(v, names)
    tol = (results.get("config") or {}).get("steady_tolerance", STEADY_TOLERANCE)
    lines += steady_lines(steady_check(results, tol), tol)
    goals = results.get("goals")
    if goals:
        lines += ["", "== goals"] + [f"{k}: {g}" for k, g in goals.items()]
    for n, info in v.items():
        if not info.get("summary"):
            lines.append(f"{n}: not measured ({info.get('why', 'unknown reason')})")
    return "\n".join(lines)


def path_lines(v: dict, names: list) -> list:
    """The critical paths of each variant beside its optimizer step alone and the step's host-memory floor."""
    rows = []
    for n in names:
        s, setup = v[n]["summary"], (v[n].get("ranks") or [{}])[0].get("setup", {})
        paths, opt = s.get("paths_s") or {}, s["phase_s"].get("optimizer")
        if not paths:
            continue
        up, rs, floor = paths.get("update"), paths.get("restart"), setup.get("optimizer_floor_s")
        ratio = f"{up / opt:.2f}x the optimizer step" if up and opt else "-"
        rows.append(f"{n:<14}{_ms(up)}{_ms(rs)} {_ms(opt)}{_ms(floor)}   update = {ratio}; moments "
                    f"{setup.get('moments', '?')}, host triad {setup.get('host_triad_gbps', '?')} GB/s")
    if not rows:
        return []
    return ["", "== critical paths (ms, median over measured steps): update = optimizer + rollout resume + sync "
                "(backward done -> the rollout holds the new weights); restart = onload + group reload (rollout "
                "paused -> the first forward)",
            f"{'variant':<14}{'update':>9}{'restart':>9}{'optimizer':>10}{'floor':>9}"] + rows


def _decode_lines(v: dict) -> list:
    """How each variant's rollout decoded, and the CUDA graph memory it captured (the anchor keeps it paused)."""
    out = []
    for n in v:
        ro = ((v.get(n, {}).get("ranks") or [{}])[0].get("setup") or {}).get("rollout") or {}
        if not ro.get("decode_used"):
            continue
        line = f"{n} rollout decode: {ro['decode_used']}"
        if ro.get("graph_bytes") is not None:
            held = ("released by its pause (ebbtide.memory.graph, tag kv_cache)" if ro.get("graph_pausable") else
                    "HELD while paused (torch_memory_saver's torch hook mode cannot pause a graph pool)")
            line += f", graph memory {ro['graph_bytes'] / 1e9:.3f} GB, {held}"
        out.append(line)
    return [""] + out if out else []


def _check_lines(ck: dict) -> list:
    if not ck:
        return []
    out = [f"check correctness (rollout after sync == trainer's weights dequantized): {ck.get('correct')}"]
    if ck.get("ranks_in_sync") is not None:
        out.append(f"check data-parallel ranks hold the same weights at each verified step: {ck['ranks_in_sync']}")
    for e in ck.get("verify", []):
        out.append(f"  rank {e.get('rank', 0)} step {e['step']}: weights bitwise equal {e['weights_bitwise_equal']}"
                   f"{' (mismatch: ' + ', '.join(e['mismatching_weights']) + ')' if e['mismatching_weights'] else ''}"
                   f", logits bitwise equal {e['logits_bitwise_equal']}, max |diff| {e['logits_max_abs_diff']:.3g} "
                   f"(atol {e['logits_atol']}); cached decode vs full forward max |diff| "
                   f"{e['decode_vs_full_max_abs']}, argmax equal {e['decode_vs_full_argmax_equal']}"
                   + (f"; vs eager decode: tokens equal {e['decode_vs_eager_tokens_equal']}"
                      f" (first differing token {e.get('decode_vs_eager_first_diff')}, last logits max |diff| "
                      f"{e.get('decode_vs_eager_max_abs')})" if "decode_vs_eager_tokens_equal" in e else ""))
    out.append(f"check no memory growth: {ck.get('no_growth')} "
               + "; ".join(f"growth {g.get('growth_bytes')} B (tolerance {g.get('tolerance')}) after {g.get('phase')}"
                           if g.get("ok") is not None else str(g.get("why")) for g in ck.get("growth", [])))
    return out


_COLORS = {"train": "#4c72b0", "sync_pack": "#dd8452", "trainer_pause": "#55a868", "comm_release": "#c44e52",
           "rollout_resume": "#8172b3", "sync_load": "#937860", "generate": "#da8bc3", "rollout_pause": "#8c8c8c",
           "trainer_resume": "#ccb974", "comm_reload": "#64b5cd", "optimizer": "#1f3b73", "sync": "#dd8452",
           "offload": "#55a868", "onload": "#ccb974"}


def plot_timeline(results: dict, path: str) -> str:
    """One lane per (variant, process) over the measured steps, phases coloured. Returns "" or why not drawn."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return "matplotlib not installed"
    warmup = results.get("config", {}).get("warmup", 0)
    lanes = []
    for n, info in results["variants"].items():
        ranks = info.get("ranks") or []
        phases = [p for p in (ranks[0].get("phases", []) if ranks else []) if p["step"] >= warmup]
        if phases:
            lanes.append((n, phases))
    if not lanes:
        return "nothing measured"
    fig, axes = plt.subplots(len(lanes), 1, figsize=(12, 1.8 + 1.3 * len(lanes)), squeeze=False)
    for ax, (n, phases) in zip(axes[:, 0], lanes):
        t_start = min(p["t0"] for p in phases)
        for p in phases:
            y = 0 if p["phase"] in ROLLOUT_PHASES else 1
            ax.broken_barh([(p["t0"] - t_start, p["s"])], (y + 0.1, 0.8), color=_COLORS.get(p["phase"], "k"))
        ax.set_yticks([0.5, 1.5], ["rollout", "trainer"])
        step_s = (results["variants"][n].get("summary") or {}).get("step_s")
        ax.set_title(f"{n} (rank 0, steps after warm-up; median step {step_s * 1e3:.1f} ms; gaps: untimed checks "
                     f"and memory sampling)" if step_s else n, loc="left", fontsize=9)
        ax.set_xlabel("seconds")
    shown = [k for k in _COLORS if any(p["phase"] == k for _, phases in lanes for p in phases)]
    handles = [plt.Rectangle((0, 0), 1, 1, color=_COLORS[k]) for k in shown]
    fig.legend(handles, shown, ncol=5, loc="lower center", fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return ""
