"""Suite `quant`: FP8 block / group and INT4 kernels in effective GB/s (bytes read + written by the operation),
each beside the torch formula (the DeepGEMM / slime reference code, ``ebbtide.anchors.quant``, run on the same GPU
in the same run) and the device-copy bandwidth measured in the same run.

Timing: CUDA events around `reps` back-to-back calls queued behind a GPU sleep, so host-side launch overhead is
hidden and the figure is device time per call; median of several such measurements, after warm-up. Every tensor
is at least twice the L2 size in the full run (quick runs use small tensors: a smoke test, cache-resident).
Engine kernels (sgl-kernel, vLLM) are compared only where installed.

The rows run the kernel variant this GPU runs by default (``params["kernels"]``: sm90 on 8.9+, portable below). On a
GPU that runs the sm90 variant, the "portable kernels" rows measure the portable variant (the software FP8
conversion that A100 / A10-class GPUs run) beside the sm90 one as the anchor, in the same run: the cost of
portability on this GPU.
"""
from __future__ import annotations

import statistics

from ..registry import Row, Skip, suite

GB = 1e9


def _timer(torch, fn, reps: int, rounds: int) -> float:
    """Median device seconds per call of fn."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(10_000_000)  # ~6 ms of GPU time: the host queues everything below before it ends
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(times)


def _same_size_copy(torch, nbytes: int, reps: int, rounds: int) -> float:
    """GB/s (read + write) of a device copy of nbytes / 2 bytes, timed like the kernels (back-to-back calls)."""
    n = nbytes // 2
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return nbytes / _timer(torch, lambda: dst.copy_(src), reps, rounds) / GB


# ---- cases -----------------------------------------------------------------------------------------------------
def _cases(quick: bool):
    """(name, kind, params, bytes moved). Shapes: 7168^2 and >= 256 MB weights, 16384x7168
    activations, a 100-tensor list, a MoE batch, UE8M0 variants, INT4 fake-quant and pack."""
    if quick:
        W, BIG, ACT, MOE = (1024, 1024), (2048, 2048), (2048, 1024), (4, 512, 1024)
    else:
        W, BIG, ACT, MOE = (7168, 7168), (16384, 8192), (16384, 7168), (32, 2048, 7168)
    out = []
    for name, shape, scale in ((f"block {W[0]}x{W[1]} fp32", W, "fp32"),
                               (f"block {W[0]}x{W[1]} ue8m0 packed", W, "ue8m0_packed"),
                               (f"block {BIG[0]}x{BIG[1]} ({BIG[0] * BIG[1] * 2 >> 20} MiB) fp32", BIG, "fp32")):
        n, k = shape
        sbytes = (n * (-(-k // 512)) * 4) if scale == "ue8m0_packed" else (-(-n // 128)) * (-(-k // 128)) * 4
        out.append((name, "block", {"shape": shape, "scale": scale}, n * k * 3 + sbytes))
    n, k = W
    out.append((f"block {n}x{k} fp32 via the list kernel", "list1", {"shape": W},
                n * k * 3 + (-(-n // 128)) * (-(-k // 128)) * 4))
    e, n, k = MOE
    out.append((f"block MoE [{e}, {n}, {k}] one launch", "moe", {"shape": MOE}, e * n * k * 3 + e * n * k // 4096))
    m, k = ACT
    for layout, scale in (("row", "fp32"), ("mn_major", "fp32"), ("mn_major", "ue8m0_packed")):
        sb = m * (-(-k // 512)) * 4 if scale == "ue8m0_packed" else m * k // 128 * 4
        out.append((f"group {m}x{k} {layout} {scale}", "group", {"shape": ACT, "layout": layout, "scale": scale},
                    m * k * 3 + sb))
    m, k = BIG
    out.append((f"group {m}x{k} ({m * k * 2 >> 20} MiB) mn_major fp32", "group",
                {"shape": BIG, "layout": "mn_major", "scale": "fp32"}, m * k * 3 + m * k // 32))
    if not quick:  # the long-row activation shape a plain Triton kernel is usually timed on
        m, k = 4096, 131072
        out.append((f"group {m}x{k} (1 GiB) mn_major fp32", "group",
                    {"shape": (m, k), "layout": "mn_major", "scale": "fp32"}, m * k * 3 + m * k // 32))
    out.append(("block list: 100 tensors, one launch", "list", {"quick": quick}, None))
    for shape in (W, BIG):
        n, k = shape
        out.append((f"int4 fake-quant {n}x{k} g128", "int4_fq", {"shape": shape}, n * k * 4 + n * k // 64))
        out.append((f"int4 pack (export) {n}x{k} g128", "int4_pack", {"shape": shape},
                    n * k * 2 + n * k // 2 + n * k // 64))
    n, k = W
    out.append((f"block dequant {n}x{k}", "dequant", {"shape": W}, n * k * 3 + (n // 128) * (k // 128) * 4))
    return out


def _list_shapes(quick: bool):
    """A 100-tensor mix shaped like a few transformer layers (ragged shapes included)."""
    if quick:
        base = [(256, 512), (512, 256), (128, 512), (300, 200)]
    else:
        base = [(7168, 2048), (2048, 7168), (1536, 7168), (576, 7168), (7168, 1536), (4096, 7168), (129, 7168),
                (7168, 300), (256, 7168), (1000, 1000)]
    return [base[i % len(base)] for i in range(100)]


@suite("quant", needs="gpu", description="FP8 block/group and INT4 quant kernels vs the torch formulas, in GB/s")
def run(ctx):
    ctx.require_gpu()
    try:
        import torch  # noqa: PLC0415
    except ImportError as e:
        raise Skip("torch is not installed") from e
    import ebbtide.quant as Q  # noqa: PLC0415

    from ...anchors.quant import torch_block_dequant, torch_block_quant, torch_group_quant, torch_int4  # noqa: PLC0415

    limit = ctx.limits.d2d_gbps()
    reps, rounds = (5, 3) if ctx.quick else (20, 7)
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=dev, generator=g, dtype=torch.float32).to(torch.bfloat16)

    from ebbtide.quant import _dispatch  # noqa: PLC0415

    variant = Q.kernels()["fp8"]
    for name, kind, p, nbytes in _cases(ctx.quick):
        ctx.progress(f"quant: {name}")
        try:
            if kind in ("block", "moe"):
                x = randn(*p["shape"])
                scale = p.get("scale", "fp32")
                ours = lambda: Q.fp8_block_quant(x, scale=scale)  # noqa: E731
                anchor = lambda: torch_block_quant(x)  # noqa: E731
                anchor_name = "torch formula (DeepGEMM per_block_cast_to_fp8)"
            elif kind == "list1":
                x = randn(*p["shape"])
                ours = lambda: Q.fp8_block_quant_list([x])  # noqa: E731
                anchor = lambda: torch_block_quant(x)  # noqa: E731
                anchor_name = "torch formula (DeepGEMM per_block_cast_to_fp8)"
            elif kind == "group":
                x = randn(*p["shape"])
                ours = lambda: Q.fp8_group_quant(x, scale_layout=p["layout"], scale=p["scale"])  # noqa: E731
                anchor = lambda: torch_group_quant(x, mn_major=p["layout"] == "mn_major")  # noqa: E731
                anchor_name = "torch formula (DeepGEMM per_token_cast_to_fp8)"
            elif kind == "list":
                ts = [randn(*s) for s in _list_shapes(p["quick"])]
                nbytes = sum(t.numel() * 3 + (-(-t.shape[0] // 128)) * (-(-t.shape[1] // 128)) * 4 for t in ts)
                ours = lambda: Q.fp8_block_quant_list(ts)  # noqa: E731
                anchor = lambda: [torch_block_quant(t) for t in ts]  # noqa: E731
                anchor_name = "torch formula, per tensor"
                name = f"{name} ({nbytes / GB:.2f} GB)"
                t_loop = _timer(torch, lambda: [Q.fp8_block_quant(t) for t in ts], max(2, reps // 4), rounds)
                p = {**p, "per_tensor_launches_us": round(t_loop * 1e6, 1)}
            elif kind in ("int4_fq", "int4_pack"):
                x = randn(*p["shape"]) * 0.02
                if kind == "int4_fq":
                    ours = lambda: Q.int4_fake_quant(x)  # noqa: E731
                    anchor = lambda: torch_int4(x)  # noqa: E731
                else:
                    ours = lambda: Q.int4_pack(x)  # noqa: E731
                    anchor = lambda: torch_int4(x, pack=True)  # noqa: E731
                anchor_name = "torch formula (slime fake-quant / packer)"
            elif kind == "dequant":
                q, s = Q.fp8_block_quant(randn(*p["shape"]))
                ours = lambda: Q.fp8_block_dequant(q, s)  # noqa: E731
                anchor = lambda: torch_block_dequant(q, s)  # noqa: E731
                anchor_name = "torch formula (float(q) * expanded s)"
            else:  # pragma: no cover
                raise AssertionError(kind)
            t_ours = _timer(torch, ours, reps, rounds)
            try:
                t_anchor = _timer(torch, anchor, max(2, reps // 4), rounds)
                anote = ""
            except torch.cuda.OutOfMemoryError:
                t_anchor, anote = None, "out of memory"
        except torch.cuda.OutOfMemoryError as e:
            yield Row("quant", name, "GB/s", None, note=f"skipped: out of memory ({e})")
            continue
        finally:
            torch.cuda.empty_cache()
        same = {}
        if kind in ("block", "list1"):  # a device copy moving the same bytes: the limit's own small-size share
            same = {"copy_same_bytes_gbps": round(_same_size_copy(torch, nbytes, reps, rounds), 1)}
        yield Row("quant", name, "GB/s", nbytes / t_ours / GB,
                  anchor=None if t_anchor is None else nbytes / t_anchor / GB, anchor_name=anchor_name,
                  anchor_note=anote, limit=limit, limit_name="device copy (read + write)",
                  params={"bytes": nbytes, "us": t_ours * 1e6, "kernels": variant, **same,
                          "anchor_us": None if t_anchor is None else t_anchor * 1e6, **{k: str(v) for k, v in p.items()}},
                  note=f"{t_ours * 1e6:.1f} us" + ("" if t_anchor is None else f" vs {t_anchor * 1e6:.1f} us")
                  + (f"; a copy of the same bytes: {same['copy_same_bytes_gbps']:.0f} GB/s" if same else ""))
    if variant == "sm90":
        yield from _portable_rows(ctx, torch, Q, _dispatch, randn, limit, reps, rounds)


def _portable_rows(ctx, torch, Q, dispatch, randn, limit, reps, rounds):
    """The portable variant beside the sm90 one, same tensors, same run."""
    W, BIG, ACT = ((1024, 1024), (2048, 2048), (2048, 1024)) if ctx.quick else \
        ((7168, 7168), (16384, 8192), (16384, 7168))
    cases = [(f"block {W[0]}x{W[1]} fp32", W, lambda x: Q.fp8_block_quant(x), 3, 4 / (128 * 128)),
             (f"block {BIG[0]}x{BIG[1]} fp32", BIG, lambda x: Q.fp8_block_quant(x), 3, 4 / (128 * 128)),
             (f"group {ACT[0]}x{ACT[1]} mn_major fp32", ACT, lambda x: Q.fp8_group_quant(x, scale_layout="mn_major"),
              3, 4 / 128),
             (f"block dequant {W[0]}x{W[1]}", W, None, 3, 4 / (128 * 128))]
    for name, shape, fn, per_elem, scale_per_elem in cases:
        ctx.progress(f"quant: {name}, portable kernels")
        try:
            x = randn(*shape)
            if fn is None:  # dequant of the block quant's output
                q, s = Q.fp8_block_quant(x)
                fn = lambda _x, q=q, s=s: Q.fp8_block_dequant(q, s)  # noqa: E731
            nbytes = int(x.numel() * (per_elem + scale_per_elem))
            times = {}
            for v in ("sm90", "portable"):
                with dispatch.forced(v):
                    times[v] = _timer(torch, lambda: fn(x), reps, rounds)
        except torch.cuda.OutOfMemoryError as e:
            yield Row("quant", f"{name}, portable kernels", "GB/s", None, note=f"skipped: out of memory ({e})")
            continue
        finally:
            torch.cuda.empty_cache()
        yield Row("quant", f"{name}, portable kernels (software FP8 conversion)", "GB/s",
                  nbytes / times["portable"] / GB, anchor=nbytes / times["sm90"] / GB,
                  anchor_name="sm90 kernels (hardware FP8 conversion), same run", limit=limit,
                  limit_name="device copy (read + write)",
                  params={"bytes": nbytes, "us": times["portable"] * 1e6, "sm90_us": times["sm90"] * 1e6,
                          "kernels": "portable"},
                  note=f"{times['portable'] * 1e6:.1f} us vs {times['sm90'] * 1e6:.1f} us for the sm90 variant")
