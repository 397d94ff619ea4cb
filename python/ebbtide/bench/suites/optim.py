"""Suite `optim`: the CPU Adam kernel and the offloaded optimizer, each beside its anchor and limit (same run).

CPU rows (effective GB/s = bytes a one-pass step must move per param / step time; 28 B for fp32 grads, and for
bf16 grads + bf16 copy-out; higher is better), at 1, half and all threads of the process's affinity set:
  - ours fast vs torch fused AdamW (``fused=True``, torch.set_num_threads to the same count), timed in
    alternating blocks (``_block_median_times``)
  - ours fast vs DeepSpeed CPUAdam (where deepspeed is missing: no row, one skip line with how to install it;
    anchor_note says why a present install failed)
  - ours exact vs ours fast (the goal: exact within 10% of fast)
  - ours bf16 grads + fused bf16 copy-out vs torch's three passes (grad.float(), fused step, p.to(bf16))
  - the same step with bf16 moments (``moments_dtype=torch.bfloat16``: 20 B/param, effective GB/s at 20 B) vs
    the same fp32-moment step timed alternately with it, its time also counted at 20 B/param, so value/anchor is
    the speed-up; the note gives both times and the ratio to torch fused fp32 AdamW
  - ours fast vs torch for-loop AdamW (foreach=False: the CPU default), all threads only
  limit: the kernel's own stream mix (``limits.MIXES``) measured in this run with the same thread count; only
  ebbtide's figures are in the ebbtide column (torch's and DeepSpeed's are anchors).
GPU rows (seconds per step, lower is better) for ~1B bf16 params (quick: 64M): OffloadedAdam.step beside the
naive sequence (grad D2H, cast, torch fused AdamW on CPU, cast, H2D), limit max(CPU floor at 28 B/param over
the triad bandwidth, PCIe floor: 2 B/param down and up at the measured pinned rates).
"""
from __future__ import annotations

import gc
import os
import statistics
import time

from ..registry import Row, Skip, suite

GB = 1e9
SUITE = "optim"


def _median_time(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _paired_median_times(fa, fb, repeats: int) -> tuple[float, float]:
    """Median times of fa and fb run alternately (one warm-up each)."""
    fa()
    fb()
    ta, tb = [], []
    for _ in range(repeats):
        for fn, acc in ((fa, ta), (fb, tb)):
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def _block_median_times(fa, fb, blocks: int, per_block: int, settle: float = 0.05) -> tuple[float, float]:
    """Median times of fa and fb measured in alternating blocks of back-to-back calls, each block after a pause of
    `settle` seconds and one untimed call. Two thread pools in one process (ours and torch's OpenMP workers) each
    spin for a while after a call, so timing a's call right after b's measures a with b's workers still holding
    cores (on a 2-vCPU host our step measured 10-15% slow that way); a block measures each in its own steady
    state, as a training loop's consecutive steps see it, and alternating the blocks spreads a drifting machine
    over both."""
    ta, tb = [], []
    for _ in range(blocks):
        for fn, acc in ((fa, ta), (fb, tb)):
            time.sleep(settle)
            fn()
            for _ in range(per_block):
                t0 = time.perf_counter()
                fn()
                acc.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def _set_openmp_threads(torch, n: int) -> None:
    """Set the thread count of every OpenMP runtime in the process. torch's CUDA wheels bundle a renamed libgomp,
    while DeepSpeed's JIT-built op links the system one, so torch.set_num_threads alone would leave DeepSpeed on
    all cores."""
    import ctypes  # noqa: PLC0415

    torch.set_num_threads(n)
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line}
    except OSError:
        return
    for lib in libs:
        try:
            ctypes.CDLL(lib).omp_set_num_threads(n)
        except (OSError, AttributeError):
            pass


def _deepspeed_adam(torch, params):
    """DeepSpeed's CPUAdam over `params`, or (None, why)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: PLC0415
    except ImportError:
        return None, "not installed"
    except Exception as e:  # noqa: BLE001  (a broken install must not kill the suite)
        return None, f"import failed: {type(e).__name__}: {e}"[:160]
    try:
        opt = DeepSpeedCPUAdam(params, lr=1e-3, weight_decay=0.1, adamw_mode=True)
        opt.step()
        return opt, ""
    except Exception as e:  # noqa: BLE001  (its JIT build fails on many hosts: DeepSpeed #4257, #1846)
        return None, f"failed to build/load: {type(e).__name__}: {e}"[:160]


def _cpu_rows(ctx, torch):
    from ...optim import CPUAdam  # noqa: PLC0415  (ebbtide.optim)

    affinity = len(os.sched_getaffinity(0))
    thread_counts = sorted({1, max(1, affinity // 2), affinity})
    sizes = [(4 << 20, "4M")] if ctx.quick else [(16 << 20, "16M"), (128 << 20, "128M")]
    torch_threads = torch.get_num_threads()
    for n, label in sizes:
        reps = 3 if ctx.quick or n > (64 << 20) else 7
        gen = torch.Generator().manual_seed(0)
        p_ours = torch.randn(n, generator=gen)
        g32 = torch.randn(n, generator=gen) * 1e-2
        g16 = g32.to(torch.bfloat16)
        out16 = torch.empty(n, dtype=torch.bfloat16)
        p_ref = p_ours.clone().requires_grad_()
        p_ref.grad = g32.clone()
        fused = torch.optim.AdamW([p_ref], lr=1e-3, weight_decay=0.1, fused=True)
        for t in thread_counts:
            ctx.progress(f"optim: kernel n={label} threads={t}")
            params = {"n": n, "threads": t}
            fast = CPUAdam([p_ours], lr=1e-3, weight_decay=0.1, mode="fast", threads=t)
            exact = CPUAdam([p_ours], lr=1e-3, weight_decay=0.1, mode="exact", threads=t)
            torch.set_num_threads(t)
            try:  # torch at t threads, as ours
                t_fast, t_fused = _block_median_times(lambda: fast.step(grads={p_ours: g32}), fused.step,
                                                      blocks=6, per_block=2 if reps <= 3 else 3)
            finally:
                torch.set_num_threads(torch_threads)
            t_exact = _median_time(lambda: exact.step(grads={p_ours: g32}), reps)
            fast.attach_bf16_copy(p_ours, out16)
            t_bf16 = _median_time(lambda: fast.step(grads={p_ours: g16}), reps)
            fast.attach_bf16_copy(p_ours, None)
            m16 = CPUAdam([p_ours], lr=1e-3, weight_decay=0.1, mode="fast", threads=t, moments_dtype=torch.bfloat16)
            m16.attach_bf16_copy(p_ours, out16)
            fast.attach_bf16_copy(p_ours, out16)
            # interleaved, so both see the same machine state (the ratio is the result)
            t_m32, t_m16 = _paired_median_times(lambda: fast.step(grads={p_ours: g16}),
                                                lambda: m16.step(grads={p_ours: g16}), max(reps, 9))
            fast.attach_bf16_copy(p_ours, None)
            del m16
            torch.set_num_threads(t)
            try:
                def three_pass():
                    p_ref.grad = g16.float()
                    fused.step()
                    out16.copy_(p_ref.detach())

                t_three = _median_time(three_pass, reps)
                p_ref.grad = g32
            finally:
                torch.set_num_threads(torch_threads)
            eff = lambda sec: 28.0 * n / sec / GB  # noqa: E731
            common = _limit(ctx, "adam_fp32_grads", t, params)
            yield Row(SUITE, f"AdamW step fp32 grads, {label}, {t} thr (fast)", "GB/s", eff(t_fast),
                      anchor=eff(t_fused), anchor_name="torch fused AdamW", note=f"{t_fast * 1e3:.2f} ms",
                      **common)
            yield Row(SUITE, f"AdamW step exact mode, {label}, {t} thr", "GB/s", eff(t_exact), anchor=eff(t_fast),
                      anchor_name="ours, fast mode", note=f"{t_exact * 1e3:.2f} ms; goal: within 10% of fast",
                      **common)
            yield Row(SUITE, f"bf16 grad + bf16 copy-out, one pass, {label}, {t} thr", "GB/s", eff(t_bf16),
                      anchor=eff(t_three), anchor_name="torch 3 passes (cast, fused step, cast)",
                      note=f"{t_bf16 * 1e3:.2f} ms vs {t_three * 1e3:.2f} ms; goal >= 1.7x",
                      **_limit(ctx, "adam_bf16_grads", t, params))
            eff20 = lambda sec: 20.0 * n / sec / GB  # noqa: E731
            yield Row(SUITE, f"bf16 moments, bf16 grad + copy-out (20 B/param), {label}, {t} thr", "GB/s",
                      eff20(t_m16), anchor=eff20(t_m32), anchor_name="ours, fp32 moments (time at 20 B/param)",
                      note=(f"{t_m16 * 1e3:.2f} ms vs {t_m32 * 1e3:.2f} ms fp32 moments (interleaved); "
                            f"{t_fused / t_m16:.2f}x torch fused fp32 ({t_fused * 1e3:.2f} ms); goal >= 1.3x"),
                      **_limit(ctx, "adam_bf16_moments", t, params))
            yield from _deepspeed_row(ctx, torch, n, label, t, eff(t_fast), common)
            if t == affinity:
                p_loop = p_ours.clone().requires_grad_()
                p_loop.grad = g32
                loop = torch.optim.AdamW([p_loop], lr=1e-3, weight_decay=0.1, foreach=False)
                torch.set_num_threads(t)
                try:
                    t_loop = _median_time(loop.step, 2 if n > (64 << 20) else reps)
                finally:
                    torch.set_num_threads(torch_threads)
                yield Row(SUITE, f"AdamW step fp32 grads vs the CPU default, {label}, {t} thr (fast)", "GB/s",
                          eff(t_fast), anchor=eff(t_loop), anchor_name="torch for-loop AdamW (foreach=False)",
                          note=f"{t_fast * 1e3:.2f} ms vs {t_loop * 1e3:.2f} ms", **common)
                del p_loop, loop
        del p_ours, g32, g16, out16, p_ref, fused


def _limit(ctx, mix: str, threads: int, params: dict) -> dict:
    """A CPU row's limit: its kernel's stream mix on the same thread count, measured in this run."""
    return dict(limit=ctx.limits.host_stream_gbps(mix, threads=threads),
                limit_name=ctx.limits.host_stream_name(mix, threads), params=params)


_DEEPSPEED_MISSING = "not installed (pip install deepspeed; its CPUAdam op builds on first use)"


def _deepspeed_row(ctx, torch, n, label, t, ours_gbps, common):
    if any(what == "optim: DeepSpeed CPUAdam anchor" for what, _ in ctx.skipped):
        return  # said once already: not installed
    try:
        import deepspeed  # noqa: F401,PLC0415
    except ImportError:
        ctx.note_skip("optim: DeepSpeed CPUAdam anchor", _DEEPSPEED_MISSING)
        return
    except Exception:  # noqa: BLE001  (a broken install: _deepspeed_adam says why in the row)
        pass
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n) * 1e-2
    torch_threads = torch.get_num_threads()
    _set_openmp_threads(torch, t)  # DeepSpeed's loop is `omp parallel for`
    try:
        opt, why = _deepspeed_adam(torch, [p])
        if opt is not None:
            _set_openmp_threads(torch, t)  # its op (and maybe another libgomp) is loaded now
        sec = _median_time(opt.step, 3 if ctx.quick or n > (64 << 20) else 7) if opt else None
    finally:
        _set_openmp_threads(torch, torch_threads)
    yield Row(SUITE, f"AdamW step fp32 grads vs DeepSpeed, {label}, {t} thr (fast)", "GB/s", ours_gbps,
              anchor=28.0 * n / sec / GB if sec else None, anchor_name="DeepSpeed CPUAdam", anchor_note=why,
              **common)


def _gpu_rows(ctx, torch):
    from ...optim import OffloadedAdam  # noqa: PLC0415

    n_tensors, per = (8, 8 << 20) if ctx.quick else (128, 8 << 20)  # 64M / 1.07B params (Megatron HDO's setup)
    total = n_tensors * per
    ctx.progress(f"optim: offloaded step, {total / 1e9:.2f}B params")
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(per, device="cuda", generator=gen).to(torch.bfloat16))
              for _ in range(n_tensors)]
    opt = OffloadedAdam(params, lr=1e-3, weight_decay=0.1, mode="fast")
    for p in params:
        p.grad.normal_(generator=gen)
    reps = 3 if ctx.quick else 5

    def ours():
        opt.step()
        torch.cuda.synchronize()

    t_ours = _median_time(ours, reps)
    # The naive sequence: whole-buffer D2H, cast, torch fused AdamW on CPU fp32 masters, cast, H2D.
    flat_p = torch.cat([p.detach().reshape(-1) for p in params])
    flat_g = torch.cat([p.grad.reshape(-1) for p in params])
    del opt, params  # params <-> optimizer (grad hooks) form a cycle: collect it to free 12 B/param of host RAM
    gc.collect()
    master = flat_p.float().cpu().requires_grad_()
    g_host = torch.empty(total, dtype=torch.bfloat16, pin_memory=True)
    up_host = torch.empty(total, dtype=torch.bfloat16, pin_memory=True)
    naive_opt = torch.optim.AdamW([master], lr=1e-3, weight_decay=0.1, fused=True)

    def naive():
        g_host.copy_(flat_g)
        master.grad = g_host.float()
        naive_opt.step()
        up_host.copy_(master.detach())
        flat_p.copy_(up_host, non_blocking=True)
        torch.cuda.synchronize()

    t_naive = _median_time(naive, reps)
    cpu_floor = 28.0 * total / (ctx.limits.host_triad_gbps() * GB)
    pcie_floor = max(2.0 * total / (ctx.limits.d2h_gbps() * GB), 2.0 * total / (ctx.limits.h2d_gbps() * GB))
    yield Row(SUITE, f"offloaded AdamW step, {total / 1e9:.2f}B bf16 params", "s", t_ours, higher_is_better=False,
              anchor=t_naive, anchor_name="naive: D2H, cast, torch fused AdamW, cast, H2D",
              limit=max(cpu_floor, pcie_floor), limit_name="max(CPU 28 B/param at triad, PCIe 2+2 B/param)",
              params={"params": total, "cpu_floor_s": cpu_floor, "pcie_floor_s": pcie_floor},
              note="goal: within 1.15x of the limit")


@suite(SUITE, needs="cpu", description="CPU Adam kernel vs torch fused/for-loop/DeepSpeed; offloaded step on GPU")
def run(ctx):
    try:
        import torch  # noqa: PLC0415
    except ImportError as e:
        raise Skip("torch is not installed") from e
    yield from _cpu_rows(ctx, torch)
    if not ctx.has_gpu:
        ctx.note_skip("optim: offloaded step", "no CUDA GPU")
        return
    yield from _gpu_rows(ctx, torch)
