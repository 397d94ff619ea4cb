"""CPU dispatch: the automatic level is the widest the CPU supports (csrc/cpu_features.cc, Note [Widest is
fastest]: no CPU is capped today); the reason is reported; EBBTIDE_CPU_ISA selects any supported level. The
expectation is derived here from /proc/cpuinfo, independently of the native code."""
from __future__ import annotations

import pytest

from ebbtide import _native
from ebbtide.testing import spawn

C = _native.load()

AVX2 = {"avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


def _cpuinfo() -> tuple[str, int, int, set[str]]:
    vendor, family, model, flags = "", -1, -1, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key == "cpu family" and family < 0:
                    family = int(value)
                elif key == "model" and model < 0:
                    model = int(value)
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return vendor, family, model, flags


def _supported(flags: set[str]) -> list[str]:
    levels = []
    if AVX512 | {"avx512_bf16"} <= flags:
        levels.append("avx512_bf16")
    if AVX512 <= flags:
        levels.append("avx512")
    if AVX2 <= flags:
        levels.append("avx2")
    return levels + ["scalar"]


def _expected() -> str:
    flags = _cpuinfo()[3]
    if not flags:
        pytest.skip("no x86 flags line in /proc/cpuinfo")
    return _supported(flags)[0]


def test_automatic_level_is_the_widest_and_says_why():
    vendor, family, model, _ = _cpuinfo()
    assert C.cpu_isa() == _expected()
    assert C.cpu_isa_reason() == (f"the widest level this CPU and OS support ({vendor} family {family:#x} "
                                  f"model {model:#x})")


def test_the_optimizer_kernel_follows_the_dispatch_level():
    torch = pytest.importorskip("torch")
    from ebbtide.optim import CPUAdam

    assert CPUAdam([torch.zeros(4)], threads=1).isa == _expected()


def test_override_selects_any_supported_level_and_is_reported():
    want = _expected()
    code = "import ebbtide._native as n; C = n.load(); print(C.cpu_isa()); print(C.cpu_isa_reason())"
    for level in _supported(_cpuinfo()[3]):
        p = spawn.python(code, extra_env={"EBBTIDE_CPU_ISA": level})
        isa, reason = p.stdout.strip().split("\n", 1)
        assert isa == level
        if level != want:
            assert reason.startswith(f"set by EBBTIDE_CPU_ISA (automatic choice: {want}"), reason


def test_ebbtide_info_shows_the_level_and_the_reason():
    p = spawn.python("import sys; from ebbtide import cli; sys.exit(cli.main(['info']))")
    assert f"CPU ISA          : {C.cpu_isa()}" in p.stdout
    assert f"CPU ISA because  : {C.cpu_isa_reason()}" in p.stdout
