"""Which quant kernels a CUDA tensor runs: the one place that chooses (quant/launchers.h, "Variants").

Every FP8 kernel is built in two variants with the same bits for every input (tests/quant): ``sm90`` uses the FP8
conversion instructions that GPUs of compute capability 8.9 and later have (L4 / L20 / L40 / RTX 40xx, H100 / H200
/ H20, and newer GPUs through its compute_90 PTX); ``portable`` converts in integer arithmetic and runs on every GPU
from 8.0 (A100, A10 / A40 / RTX 30xx). The INT4 kernels and the segment copy use no FP8 instruction: they have the
portable variant only, on every GPU from 8.0.

Rules (``choose`` is a pure function of the device's facts and the setting; tests/quant/test_dispatch.py walks
every branch):

- Compute capability below 8.0: UnsupportedError naming the kernel, the GPU and what is needed.
- ``EBBTIDE_QUANT_KERNELS=auto`` (the default): FP8 kernels run ``sm90`` on 8.9+ where the build has code this GPU
  loads, else ``portable`` (with one warning per GPU when a 8.9+ GPU falls back because the build lacks the code).
- ``=portable``: every kernel runs ``portable`` (the portable path on any GPU: for tests and comparisons).
- ``=sm90``: FP8 kernels run ``sm90`` or raise UnsupportedError, never fall back; the INT4 and copy kernels are
  unaffected.
- A variant the build has no code for on this GPU, or a driver too old for the CUDA runtime or PTX the kernels were
  built with: UnsupportedError saying which, and what to rebuild with or update.

The device's facts (capability, name, what it loads of each variant) are read once per device; the setting is read
on every call (``ebbtide.settings`` caches it), so ``settings.reset`` takes effect at once.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging

from .. import _native, settings
from ..errors import UnsupportedError

log = logging.getLogger("ebbtide.quant")

FP8_KERNELS = frozenset({"fp8_block_quant", "fp8_block_quant_list", "fp8_group_quant", "fp8_block_dequant",
                         "fp8_encode"})
PORTABLE_KERNELS = frozenset({"int4_quant", "int4_unpack", "copy_segments"})
VARIANTS = ("sm90", "portable")
CODES = {"sm90": 0, "portable": 1}  # quant/launchers.h Variant (kVariantSm90, kVariantPortable)
MIN_CAPABILITY = (8, 0)       # cvt.rn.bf16.f32, __reduce_max_sync
SM90_MIN_CAPABILITY = (8, 9)  # cvt.rn.satfinite.e4m3x2.f32, cvt.rn.f16x2.e4m3x2

KERNELS = settings.declare(
    "EBBTIDE_QUANT_KERNELS", settings.parse_choice("auto", "sm90", "portable"), "auto",
    "which variant of the quant kernels CUDA tensors run: auto (sm90 where the GPU has FP8 conversion instructions, "
    "portable elsewhere), sm90 (never falls back) or portable (everywhere)")

# CUDA runtime errors the image query can return, by what they mean here.
_NO_IMAGE = (98, 209)         # cudaErrorInvalidDeviceFunction, cudaErrorNoKernelImageForDevice
_OLD_DRIVER = 35              # cudaErrorInsufficientDriver
_PTX_TOO_NEW = (222, 218)     # cudaErrorUnsupportedPtxVersion, cudaErrorInvalidPtx


@dataclasses.dataclass(frozen=True)
class Image:
    """What one GPU loads of one variant: ``cuda_error`` 0 and the code's versions, or the query's CUDA error."""

    cuda_error: int
    error_name: str = ""
    binary: int = 0  # architecture of the code that runs (90: sm_90)
    ptx: int = 0     # the PTX it came from, when the driver compiled it

    @property
    def loadable(self) -> bool:
        return self.cuda_error == 0

    def describe(self) -> str:
        if not self.loadable:
            return f"none ({self.error_name or 'CUDA error'} {self.cuda_error})"
        if self.ptx and self.ptx < self.binary:
            return f"sm_{self.binary}, compiled by the driver from compute_{self.ptx} PTX"
        return f"sm_{self.binary}"


@dataclasses.dataclass(frozen=True)
class Device:
    """The facts the choice depends on, for one GPU and this build."""

    index: int
    name: str
    capability: tuple[int, int]
    images: dict            # variant -> Image, for the variants this build has
    runtime_version: int    # the CUDA runtime the kernels were built with (13000: 13.0)
    driver_version: int     # the CUDA version the driver supports
    archs: tuple = ()       # the build's CUDA architectures

    @property
    def what(self) -> str:
        return f"GPU {self.index}, {self.name}, compute capability {self.capability[0]}.{self.capability[1]}"


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}" if v else "none"


def _require(kernel: str, dev: Device, variant: str) -> None:
    """Raise UnsupportedError unless ``dev`` loads ``variant``'s code."""
    archs = ";".join(dev.archs) or "none"
    img = dev.images.get(variant)
    if img is None:
        raise UnsupportedError(
            f"{kernel}: this build has no {variant} kernels (its CUDA architectures: {archs}; the {variant} "
            f"kernels are built for architectures 89 and later): rebuild with the default EBBTIDE_CUDA_ARCHS, or "
            f"unset EBBTIDE_QUANT_KERNELS")
    if img.loadable:
        return
    major, minor = dev.capability
    if img.cuda_error == _OLD_DRIVER and not dev.driver_version:
        raise UnsupportedError(f"{kernel}: the CUDA runtime of the quant kernels found no NVIDIA driver "
                               f"(libcuda.so.1) for {dev.what}")
    if img.cuda_error == _OLD_DRIVER:
        raise UnsupportedError(
            f"{kernel}: the quant kernels were built with CUDA {_cuda_version(dev.runtime_version)}, which needs a "
            f"newer NVIDIA driver than this one (it supports CUDA {_cuda_version(dev.driver_version)}): update the "
            f"driver, or rebuild ebbtide with an nvcc of CUDA {_cuda_version(dev.driver_version).split('.')[0]}.x")
    if img.cuda_error in _PTX_TOO_NEW:
        raise UnsupportedError(
            f"{kernel}: {dev.what} has no compiled code in this build and the driver (CUDA "
            f"{_cuda_version(dev.driver_version)}) cannot compile its PTX (from CUDA "
            f"{_cuda_version(dev.runtime_version)}): update the driver, or rebuild with EBBTIDE_CUDA_ARCHS including "
            f"{major}{minor}-real")
    if img.cuda_error in _NO_IMAGE:
        raise UnsupportedError(
            f"{kernel}: this build has no {variant} kernel code that {dev.what} can run (built for {archs}): "
            f"rebuild with EBBTIDE_CUDA_ARCHS including {major}{minor}-real, or with the default list (sm_80, sm_86, "
            f"sm_89, sm_90 and PTX for newer GPUs)")
    raise UnsupportedError(f"{kernel}: the {variant} kernels cannot be loaded on {dev.what}: "
                           f"{img.error_name or 'CUDA error'} ({img.cuda_error})")


def choose(kernel: str, dev: Device, mode: str) -> str:
    """The variant ``kernel`` runs on ``dev`` under ``mode`` (the setting: "auto", "sm90", "portable"), or
    UnsupportedError."""
    if kernel not in FP8_KERNELS and kernel not in PORTABLE_KERNELS:
        raise ValueError(f"unknown quant kernel {kernel!r}")
    if mode not in ("auto", "sm90", "portable"):
        raise ValueError(f"unknown EBBTIDE_QUANT_KERNELS value {mode!r}")
    if dev.capability < MIN_CAPABILITY:
        raise UnsupportedError(
            f"{kernel}: {dev.what} is not supported: ebbtide's quant kernels need compute capability 8.0 or newer "
            f"(A100, A10, L4, H100 and later GPUs); quantize on the CPU instead (CPU tensors run the reference, "
            f"with the same bits)")
    if kernel in FP8_KERNELS and mode == "sm90":
        if dev.capability < SM90_MIN_CAPABILITY:
            raise UnsupportedError(
                f"{kernel}: EBBTIDE_QUANT_KERNELS=sm90 asks for the sm90 kernels, which need the FP8 conversion "
                f"instructions of compute capability 8.9 or newer; {dev.what} runs the portable kernels (the same "
                f"bits): unset EBBTIDE_QUANT_KERNELS or set it to auto")
        _require(kernel, dev, "sm90")
        return "sm90"
    if kernel in FP8_KERNELS and mode == "auto" and sm90_loadable(dev):
        return "sm90"
    _require(kernel, dev, "portable")
    return "portable"


def sm90_loadable(dev: Device) -> bool:
    img = dev.images.get("sm90")
    return dev.capability >= SM90_MIN_CAPABILITY and img is not None and img.loadable


# ---- the process's devices and setting -------------------------------------------------------------------------
_forced: str | None = None  # set only by forced(): the benchmark's side-by-side rows


@contextlib.contextmanager
def forced(variant: str):
    """Run every quant kernel in ``variant`` inside the block, as ``EBBTIDE_QUANT_KERNELS=<variant>`` would (the
    benchmark measures both variants in one process). Not thread-safe; the user's switch is the setting."""
    global _forced
    if variant not in ("auto", *VARIANTS):
        raise ValueError(f"unknown quant kernel variant {variant!r}")
    before, _forced = _forced, variant
    try:
        yield
    finally:
        _forced = before


def setting() -> str:
    """The variant setting in force: forced() inside its block, else EBBTIDE_QUANT_KERNELS (SettingError if it
    does not parse)."""
    return _forced or settings.get(KERNELS)


@functools.lru_cache(maxsize=None)
def native():
    """ebbtide._C.quant, or UnsupportedError where the build has no CUDA kernels."""
    C = _native.load()
    if not C.build_info()["cuda"]:
        raise UnsupportedError("ebbtide was built without CUDA (no nvcc at build time): the quant kernels are "
                               "unavailable; rebuild with nvcc, or pass CPU tensors to use the reference")
    return C.quant


@functools.lru_cache(maxsize=None)
def _device_facts(index: int) -> Device:
    """The facts of GPU ``index`` (read once: the build's images of each variant as the runtime resolves them)."""
    import torch  # noqa: PLC0415

    Q = native()
    images = {}
    runtime = driver = 0
    with torch.cuda.device(index):
        for name in Q.VARIANTS:
            r = Q.kernel_image(variant=CODES[name])
            images[name] = Image(r["cuda_error"], r["error_name"], r["binary_version"], r["ptx_version"])
            runtime, driver = r["runtime_version"], r["driver_version"]
    cap = torch.cuda.get_device_capability(index)
    return Device(index=index, name=torch.cuda.get_device_name(index), capability=(int(cap[0]), int(cap[1])),
                  images=images, runtime_version=runtime, driver_version=driver,
                  archs=tuple(_native.load().build_info()["cuda_archs"]))


_warned: set = set()  # GPUs already told that they fall back to the portable FP8 kernels


def select(kernel: str, dev) -> int:
    """The variant code (quant/launchers.h Variant) ``kernel`` runs for a tensor on torch device ``dev``."""
    index = dev.index
    if index is None:  # "cuda": the current device, as torch reads it
        import torch  # noqa: PLC0415

        index = torch.cuda.current_device()
    d = _device_facts(index)
    s = setting()
    v = choose(kernel, d, s)
    if v == "portable" and s == "auto" and kernel in FP8_KERNELS and d.capability >= SM90_MIN_CAPABILITY \
            and d.index not in _warned:
        _warned.add(d.index)
        sm90 = d.images.get("sm90")
        log.warning("%s could run the sm90 FP8 kernels, but this build has none it can load (%s): it runs the "
                    "portable ones (the same bits, slower); rebuild with the default EBBTIDE_CUDA_ARCHS to get them",
                    d.what, sm90.describe() if sm90 else "not built")
    return CODES[v]


def kernels(device=None) -> dict:
    """Which variant of the quant kernels a GPU runs under the setting in force, and what it loads of each variant
    of this build. ``device``: a torch device, "cuda:N", an index, or None for the current GPU. Returns
    ``{"gpu", "setting", "fp8", "int4", "images"}``: "fp8" / "int4" are "sm90" or "portable" (or "unsupported: "
    and the reason), "images" maps each built variant to the code the GPU loads ("sm_90", or the PTX the driver
    compiled). UnsupportedError without a CUDA build or without a GPU."""
    import torch  # noqa: PLC0415

    native()
    if not torch.cuda.is_available():
        raise UnsupportedError("no CUDA GPU is visible to torch: the quant kernels run on CUDA tensors (CPU tensors "
                               "run the reference, with the same bits)")
    if device is None:
        index = torch.cuda.current_device()
    elif isinstance(device, int):
        index = device
    else:
        dev = torch.device(device)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
    d = _device_facts(index)
    out = {"gpu": d.what, "setting": setting(), "images": {v: img.describe() for v, img in d.images.items()}}
    for group, kernel in (("fp8", "fp8_block_quant"), ("int4", "int4_quant")):
        try:
            out[group] = choose(kernel, d, out["setting"])
        except UnsupportedError as e:
            out[group] = f"unsupported: {e}"
    return out
