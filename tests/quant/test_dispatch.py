"""The run-time choice of quant kernel variant (ebbtide.quant._dispatch): every rule of ``choose`` on described
GPUs (A100, A10, L20, H200, a Blackwell through PTX, a V100, builds without the sm90 variant or without code for the
GPU, old drivers), the setting's strict parsing, forced(), and that the codes match the native constants. No GPU
needed: the device facts are given, as the native image query would report them."""
from __future__ import annotations

import logging

import pytest

from ebbtide import settings
from ebbtide.errors import SettingError, UnsupportedError
from ebbtide.quant import _dispatch as D

DEFAULT_ARCHS = ("80-real", "86-real", "89-real", "90-real", "90-virtual")
OK = D.Image(0, "cudaSuccess", 90, 90)
NO_IMAGE = D.Image(209, "cudaErrorNoKernelImageForDevice")


def gpu(name="NVIDIA H200", cap=(9, 0), images=None, archs=DEFAULT_ARCHS, runtime=13000, driver=13000):
    if images is None:
        images = {"sm90": OK, "portable": OK}
    return D.Device(index=0, name=name, capability=cap, images=images, runtime_version=runtime,
                    driver_version=driver, archs=archs)


A100 = gpu("NVIDIA A100-SXM4-80GB", (8, 0), {"sm90": NO_IMAGE, "portable": D.Image(0, "", 80, 80)})
A10 = gpu("NVIDIA A10", (8, 6), {"sm90": NO_IMAGE, "portable": D.Image(0, "", 86, 86)})
L20 = gpu("NVIDIA L20", (8, 9), {"sm90": D.Image(0, "", 89, 89), "portable": D.Image(0, "", 89, 89)})
H200 = gpu()
B200 = gpu("NVIDIA B200", (10, 0), {"sm90": D.Image(0, "", 100, 90), "portable": D.Image(0, "", 100, 90)})
V100 = gpu("Tesla V100-SXM2-32GB", (7, 0), {"sm90": NO_IMAGE, "portable": NO_IMAGE})
FP8 = sorted(D.FP8_KERNELS)
OTHER = sorted(D.PORTABLE_KERNELS)


@pytest.mark.parametrize("dev,fp8", [(A100, "portable"), (A10, "portable"), (L20, "sm90"), (H200, "sm90"),
                                     (B200, "sm90")])
def test_auto_runs_sm90_where_the_gpu_has_fp8_instructions(dev, fp8):
    for k in FP8:
        assert D.choose(k, dev, "auto") == fp8
    for k in OTHER:
        assert D.choose(k, dev, "auto") == "portable"


@pytest.mark.parametrize("dev", [A100, A10, L20, H200, B200])
def test_portable_setting_runs_the_portable_kernels_everywhere(dev):
    for k in FP8 + OTHER:
        assert D.choose(k, dev, "portable") == "portable"


def test_sm90_setting_never_falls_back():
    assert D.choose("fp8_block_quant", H200, "sm90") == "sm90"
    assert D.choose("int4_quant", H200, "sm90") == "portable"  # one variant: the setting does not apply
    for dev in (A100, A10):
        with pytest.raises(UnsupportedError) as e:
            D.choose("fp8_group_quant", dev, "sm90")
        msg = str(e.value)
        assert "fp8_group_quant" in msg and dev.name in msg and f"{dev.capability[0]}.{dev.capability[1]}" in msg
        assert "8.9" in msg and "EBBTIDE_QUANT_KERNELS" in msg
    # an sm_89+ GPU with a build that lacks the variant
    no_sm90 = gpu(images={"portable": OK}, archs=("80-real",))
    with pytest.raises(UnsupportedError, match=r"no sm90 kernels \(its CUDA architectures: 80-real"):
        D.choose("fp8_block_quant", no_sm90, "sm90")


def test_gpus_older_than_sm80_are_refused_by_name():
    for k in FP8 + OTHER:
        for mode in ("auto", "portable", "sm90"):
            with pytest.raises(UnsupportedError) as e:
                D.choose(k, V100, mode)
            msg = str(e.value)
            assert k in msg and "Tesla V100-SXM2-32GB" in msg and "compute capability 7.0" in msg
            assert "8.0 or newer" in msg and "CPU" in msg


def test_auto_falls_back_to_portable_where_the_build_lacks_sm90_code():
    for images in ({"portable": OK}, {"sm90": NO_IMAGE, "portable": OK}):
        dev = gpu(images=images, archs=("80-real", "86-real"))
        assert D.choose("fp8_block_quant", dev, "auto") == "portable"


def test_a_gpu_the_build_has_no_code_for_is_told_what_to_rebuild_with():
    dev = gpu("NVIDIA A10", (8, 6), {"sm90": NO_IMAGE, "portable": NO_IMAGE}, archs=("90-real", "90-virtual"))
    with pytest.raises(UnsupportedError) as e:
        D.choose("int4_quant", dev, "auto")
    msg = str(e.value)
    assert "NVIDIA A10" in msg and "8.6" in msg and "90-real;90-virtual" in msg and "86-real" in msg


def test_an_old_driver_or_ptx_it_cannot_compile_is_named():
    old = gpu(images={"sm90": D.Image(35, "cudaErrorInsufficientDriver"),
                      "portable": D.Image(35, "cudaErrorInsufficientDriver")}, runtime=13000, driver=12080)
    with pytest.raises(UnsupportedError) as e:
        D.choose("fp8_block_quant", old, "auto")
    msg = str(e.value)
    assert "CUDA 13.0" in msg and "CUDA 12.8" in msg and "update the driver" in msg and "12.x" in msg
    none = gpu(images={"sm90": D.Image(35, "cudaErrorInsufficientDriver"),
                       "portable": D.Image(35, "cudaErrorInsufficientDriver")}, driver=0)
    with pytest.raises(UnsupportedError, match="found no NVIDIA driver"):
        D.choose("int4_quant", none, "auto")
    ptx = gpu("NVIDIA B200", (10, 0), {"sm90": D.Image(222, "cudaErrorUnsupportedPtxVersion"),
                                       "portable": D.Image(222, "cudaErrorUnsupportedPtxVersion")})
    with pytest.raises(UnsupportedError, match="cannot compile its PTX.*100-real"):
        D.choose("fp8_block_quant", ptx, "auto")
    odd = gpu(images={"sm90": OK, "portable": D.Image(999, "cudaErrorUnknown")})
    with pytest.raises(UnsupportedError, match="cudaErrorUnknown"):
        D.choose("int4_unpack", odd, "auto")


def test_unknown_kernel_or_mode_is_a_programming_error():
    with pytest.raises(ValueError, match="unknown quant kernel"):
        D.choose("fp8_nothing", H200, "auto")
    with pytest.raises(ValueError, match="EBBTIDE_QUANT_KERNELS"):
        D.choose("fp8_block_quant", H200, "Portable")


def test_image_description():
    assert OK.describe() == "sm_90"
    assert D.Image(0, "", 90, 80).describe() == "sm_90, compiled by the driver from compute_80 PTX"
    assert "cudaErrorNoKernelImageForDevice" in NO_IMAGE.describe()


@pytest.fixture
def env(monkeypatch):
    def set_(value):
        if value is None:
            monkeypatch.delenv(D.KERNELS.name, raising=False)
        else:
            monkeypatch.setenv(D.KERNELS.name, value)
        settings.reset(D.KERNELS.name)
    yield set_
    settings.reset(D.KERNELS.name)


@pytest.mark.parametrize("text,value", [(None, "auto"), ("", "auto"), ("  ", "auto"), ("auto", "auto"),
                                        ("portable", "portable"), (" sm90 ", "sm90")])
def test_setting_values(env, text, value):
    env(text)
    assert D.setting() == value


@pytest.mark.parametrize("text", ["Portable", "SM90", "hopper", "1", "sm80", "portable,sm90"])
def test_setting_is_parsed_strictly(env, text):
    env(text)
    with pytest.raises(SettingError) as e:
        D.setting()
    msg = str(e.value)
    assert "EBBTIDE_QUANT_KERNELS" in msg and repr(text) in msg and "auto, sm90, portable" in msg


def test_forced_overrides_the_setting_inside_its_block_only(env):
    env("sm90")
    with D.forced("portable"):
        assert D.setting() == "portable"
        with D.forced("auto"):
            assert D.setting() == "auto"
        assert D.setting() == "portable"
    assert D.setting() == "sm90"
    with pytest.raises(ValueError):
        with D.forced("sm80"):
            pass


def test_select_warns_once_when_an_sm89_gpu_falls_back(monkeypatch, env, caplog):
    env(None)
    dev = gpu("NVIDIA L20", (8, 9), {"portable": OK}, archs=("80-real",))
    monkeypatch.setattr(D, "_device_facts", lambda index: dev)
    monkeypatch.setattr(D, "_warned", set())

    class TorchDevice:
        index = 0

    with caplog.at_level(logging.WARNING, logger="ebbtide.quant"):
        assert D.select("fp8_block_quant", TorchDevice()) == D.CODES["portable"]
        assert D.select("fp8_group_quant", TorchDevice()) == D.CODES["portable"]
    warnings = [r for r in caplog.records if "falls back" in r.getMessage() or "portable ones" in r.getMessage()]
    assert len(warnings) == 1 and "NVIDIA L20" in warnings[0].getMessage()


def test_codes_and_variants_match_the_native_module(native):
    C = native
    assert D.CODES == {"sm90": C.quant.VARIANT_SM90, "portable": C.quant.VARIANT_PORTABLE}
    assert set(C.quant.VARIANTS) <= set(D.VARIANTS)
    if not C.quant.WITH_CUDA:
        with pytest.raises(UnsupportedError, match="built without CUDA"):
            D.native()
