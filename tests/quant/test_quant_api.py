"""The public ebbtide.quant API on CPU tensors: dispatch to the reference, result layouts, autograd, exporters,
and clear typed errors on bad input (which change nothing)."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import ebbtide
import ebbtide.quant as Q
from ebbtide.errors import InvalidArgumentError
from quant_oracle import heavy_tailed


def test_block_quant_cpu_is_the_reference():
    w = heavy_tailed((200, 300), seed=1)
    for scale in ("fp32", "ue8m0", "ue8m0_packed"):
        q, s = Q.fp8_block_quant(w, scale=scale)
        qr, sr = Q.reference.fp8_block_quant(w, scale=scale)
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)


def test_block_quant_accepts_any_row_stride():
    big = heavy_tailed((130, 520), seed=2)
    view = big[:, 7:307]  # row stride 520, unaligned start
    q, s = Q.fp8_block_quant(view)
    q2, s2 = Q.fp8_block_quant(view.contiguous())
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)


def test_list_quant_equals_per_tensor_and_shares_one_bucket():
    ts = [heavy_tailed(shape, seed=i) for i, shape in enumerate([(128, 128), (1, 7), (300, 129), (64, 1000)])]
    b = Q.fp8_block_quant_list(ts)
    assert len(b) == 4
    for t, (q, s) in zip(ts, b):
        qr, sr = Q.fp8_block_quant(t)
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)
        assert q.untyped_storage().data_ptr() == b.q_buffer.untyped_storage().data_ptr()
        assert (q.data_ptr() - b.q_buffer.data_ptr()) % 16 == 0


def test_group_quant_flattens_leading_dims():
    x = heavy_tailed((2, 5, 384), seed=3)
    q, s = Q.fp8_group_quant(x, scale_layout="mn_major")
    q2, s2 = Q.reference.fp8_group_quant(x.reshape(10, 384), scale_layout="mn_major")
    assert q.shape == x.shape and torch.equal(q.reshape(10, 384).view(torch.uint8), q2.view(torch.uint8))
    assert torch.equal(s, s2) and s.stride() == (1, 12)


def test_dequant_roundtrip_error_bound():
    w = heavy_tailed((256, 256), seed=4, spread=(-2, 2))
    q, s = Q.fp8_block_quant(w)
    d = Q.fp8_block_dequant(q, s).float()
    x = w.float()
    normal = x.abs() >= s.repeat_interleave(128, 0).repeat_interleave(128, 1) * 2.0 ** -6  # e4m3 normal range
    rel = ((d - x).abs() / x.abs())[normal].max().item()
    assert normal.float().mean() > 0.9
    assert rel <= 2.0 ** -4 + 2.0 ** -8  # bound: e4m3 half-ulp (2^-4) plus the bf16 output rounding (2^-8)


def test_dequant_into_out_is_the_same_bits_and_refuses_a_wrong_out():
    w = heavy_tailed((130, 260), seed=6)
    q, s = Q.fp8_block_quant(w)
    out = torch.full((130, 260), 3.0, dtype=torch.bfloat16)
    assert Q.fp8_block_dequant(q, s, out=out) is out
    assert torch.equal(out.view(torch.int16), Q.fp8_block_dequant(q, s).view(torch.int16))
    for bad in (torch.zeros(130, 260), torch.zeros(130, 259, dtype=torch.bfloat16), "x"):
        keep = out.clone()
        with pytest.raises(InvalidArgumentError, match="out must be bfloat16"):
            Q.fp8_block_dequant(q, s, out=bad)
        assert torch.equal(out, keep)


def test_int4_fake_quant_autograd_straight_through():
    w = heavy_tailed((64, 256), seed=5).requires_grad_()
    y = Q.int4_fake_quant(w, group=64)
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.equal(w.grad, g)  # identity STE
    w2 = w.detach().clone().requires_grad_()
    y2 = Q.int4_fake_quant(w2, group=64, divisor=7.5, clip_ste=True)
    y2.backward(g)
    assert torch.equal(y2.view(torch.int16), Q.int4_fake_quant(w.detach(), group=64, divisor=7.5).view(torch.int16))
    assert (w2.grad == g).float().mean() > 0.9  # the clipped STE only zeroes the clamped elements


def test_int4_contract_through_public_api():
    w = heavy_tailed((96, 512), seed=6, spread=(-30, 20))
    for group in (32, 64, 128):
        for divisor in (7, 7.5):
            fq = Q.int4_fake_quant(w, group=group, divisor=divisor)
            packed = Q.int4_pack(w, group=group, divisor=divisor)
            assert packed["weight_packed"].dtype == torch.int32 and packed["weight_packed"].shape == (96, 64)
            assert packed["weight_scale"].dtype == torch.bfloat16 and packed["weight_scale"].shape == (96, 512 // group)
            assert packed["weight_shape"].tolist() == [96, 512]
            served, q = Q.int4_unpack(packed, return_q=True)
            assert torch.equal(fq.view(torch.int16), served.view(torch.int16))
            assert int(q.min()) >= (-7 if divisor == 7 else -8) and int(q.max()) <= 7


def test_exporters_and_configs():
    sd = {
        "model.embed_tokens.weight": heavy_tailed((32, 256), seed=7),
        "model.layers.0.self_attn.q_proj.weight": heavy_tailed((256, 256), seed=8),
        "model.layers.0.mlp.down_proj.weight": heavy_tailed((256, 384), seed=9),
        "model.layers.0.input_layernorm.weight": torch.ones(256, dtype=torch.bfloat16),
        "model.layers.0.self_attn.q_proj.bias": torch.zeros(256, dtype=torch.bfloat16),
    }
    out, cfg = Q.export_fp8(sd)
    assert cfg["quant_method"] == "fp8" and cfg["weight_block_size"] == [128, 128]
    assert "model.embed_tokens" in cfg["modules_to_not_convert"]
    q, s = Q.fp8_block_quant(sd["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(out["model.layers.0.mlp.down_proj.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(out["model.layers.0.mlp.down_proj.weight_scale_inv"], s)
    assert out["model.embed_tokens.weight"] is sd["model.embed_tokens.weight"]
    out4, cfg4 = Q.export_int4(sd, group=32)
    w = sd["model.layers.0.self_attn.q_proj.weight"]
    served = Q.int4_unpack(out4["model.layers.0.self_attn.q_proj.weight_packed"],
                           out4["model.layers.0.self_attn.q_proj.weight_scale"],
                           out4["model.layers.0.self_attn.q_proj.weight_shape"])
    assert torch.equal(served.view(torch.int16), Q.int4_fake_quant(w, group=32).view(torch.int16))
    assert "model.layers.0.self_attn.q_proj.weight" not in out4
    Q.check_int4_config({"quantization_config": cfg4}, group=32)
    with pytest.raises(InvalidArgumentError, match="group_size=32"):
        Q.check_int4_config(cfg4, group=128)
    cfg4["config_groups"]["group_0"]["weights"]["symmetric"] = False
    with pytest.raises(InvalidArgumentError, match="symmetric"):
        Q.check_int4_config(cfg4, group=32)


@pytest.mark.parametrize("call,match", [
    (lambda: Q.fp8_block_quant(torch.zeros(4, 4)), "bfloat16"),
    (lambda: Q.fp8_block_quant(torch.zeros(4, dtype=torch.bfloat16)), "dimensions"),
    (lambda: Q.fp8_block_quant(torch.zeros(4, 4, dtype=torch.bfloat16), block=64), "block"),
    (lambda: Q.fp8_block_quant(torch.zeros(4, 4, dtype=torch.bfloat16), scale="e8m0"), "scale"),
    (lambda: Q.fp8_block_quant(torch.zeros(4, 4, dtype=torch.bfloat16), eps=0.0), "eps"),
    (lambda: Q.fp8_block_quant(torch.zeros(4, 4, dtype=torch.bfloat16), eps=float("nan")), "eps"),
    (lambda: Q.fp8_group_quant(torch.zeros(4, 128, dtype=torch.bfloat16), eps=1e-40), "eps"),
    (lambda: Q.fp8_block_quant([[1.0]]), "torch.Tensor"),
    (lambda: Q.fp8_group_quant(torch.zeros(4, 200, dtype=torch.bfloat16)), "multiple of the group"),
    (lambda: Q.fp8_group_quant(torch.zeros(4, 256, dtype=torch.bfloat16), scale="ue8m0_packed"), "mn_major"),
    (lambda: Q.fp8_group_quant(torch.zeros(4, 256, dtype=torch.bfloat16), scale_layout="col"), "scale_layout"),
    (lambda: Q.fp8_block_quant_list([]), "at least one"),
    (lambda: Q.fp8_block_quant_list([torch.zeros(4, 4, dtype=torch.bfloat16)], scale="ue8m0_packed"), "scale"),
    (lambda: Q.fp8_block_dequant(torch.zeros(4, 4), torch.ones(1, 1)), "float8"),
    (lambda: Q.fp8_block_dequant(torch.zeros(4, 4).to(torch.float8_e4m3fn), torch.ones(2, 1)), "shape"),
    (lambda: Q.int4_fake_quant(torch.zeros(4, 100, dtype=torch.bfloat16), group=32), "multiple of the group"),
    (lambda: Q.int4_fake_quant(torch.zeros(4, 128, dtype=torch.bfloat16), group=16), "group"),
    (lambda: Q.int4_pack(torch.zeros(4, 128, dtype=torch.bfloat16), divisor=8), "divisor"),
    (lambda: Q.int4_unpack(torch.zeros(4, 16, dtype=torch.int32), torch.zeros(4, 1, dtype=torch.bfloat16), [4, 64]),
     "weight_packed has shape"),
    (lambda: Q.check_int4_config({"quant_method": "fp8"}, group=128), "pack-quantized"),
    # sizes are ints: a float of the right value is refused, not crashed on inside the reference
    (lambda: Q.fp8_block_quant(torch.zeros(4, 4, dtype=torch.bfloat16), block=128.0), r"block .*128\.0 \(float\)"),
    (lambda: Q.fp8_group_quant(torch.zeros(4, 128, dtype=torch.bfloat16), group=128.0), "group"),
    (lambda: Q.int4_fake_quant(torch.zeros(4, 128, dtype=torch.bfloat16), group=64.0), "group"),
    (lambda: Q.export_int4({"a.weight": torch.zeros(4, 128, dtype=torch.bfloat16)}, group=128.0), "group"),
    (lambda: Q.fp8_block_dequant(torch.zeros(4, 4).to(torch.float8_e4m3fn), torch.ones(1, 1), block=128.0), "block"),
    (lambda: Q.fp8_block_quant(torch.zeros(4, 4, dtype=torch.bfloat16), eps=True), "eps"),
    (lambda: Q.fp8_group_quant(torch.zeros(4, 0, dtype=torch.bfloat16)), "positive multiple"),
    (lambda: Q.fp8_block_quant_list(None), "list"),
    (lambda: Q.int4_unpack({}), "lacks weight_packed"),
    (lambda: Q.int4_unpack({"weight_packed": torch.zeros(2, 2, dtype=torch.int32)}), "lacks weight_scale"),
    (lambda: Q.int4_unpack(torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.bfloat16), [2, 32, 1]),
     "weight_shape"),
    (lambda: Q.int4_unpack(torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.bfloat16), "ab"),
     "weight_shape"),
    (lambda: Q.int4_unpack(torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.bfloat16), None),
     "weight_shape"),
    (lambda: Q.int4_unpack(torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.bfloat16), [2.5, 32]),
     "weight_shape"),
    (lambda: Q.int4_unpack(torch.zeros(0, 4, dtype=torch.int32), torch.zeros(0, 1, dtype=torch.bfloat16), [0, 0]),
     "positive multiple of 8"),
    (lambda: Q.export_fp8([1, 2]), "state_dict must be a mapping"),
    (lambda: Q.check_int4_config("x", 128), "config must be a mapping"),
    (lambda: Q.check_int4_config({"quant_method": "compressed-tensors", "format": "pack-quantized",
                                  "config_groups": {"g": None}}, 128), "config_groups"),
    (lambda: Q.int4_quantization_config(group=12.5), "group"),
    (lambda: Q.fp8_quantization_config(scale="bogus"), "scale"),
    (lambda: Q.int4_fake_quant(torch.zeros(4, 128, dtype=torch.bfloat16), clip_ste="no"), "clip_ste"),
    (lambda: Q.fp8_group_quant(torch.zeros(128, dtype=torch.bfloat16)), "2 to 8 dimensions"),
])
def test_bad_input_raises_typed_value_error(call, match):
    with pytest.raises(InvalidArgumentError, match=match) as ei:
        call()
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, ebbtide.EbbtideError)


def test_bad_input_changes_nothing():
    w = heavy_tailed((4, 200), seed=1)
    before = w.clone()
    with pytest.raises(InvalidArgumentError):
        Q.int4_fake_quant(w, group=128)
    assert torch.equal(w.view(torch.int16), before.view(torch.int16))


def test_cuda_sources_were_compiled_when_nvcc_is_present(native):
    """CI has nvcc: the extension must then contain the kernels (the quant component and cuda=True)."""
    C = native
    info = C.build_info()
    assert "quant" in info["components"].split(",")
    assert hasattr(C, "quant") and C.quant.WITH_CUDA == info["cuda"]
    if shutil.which("nvcc") or shutil.which("/usr/local/cuda/bin/nvcc"):
        assert info["cuda"] is True, "nvcc is on this machine but the CUDA kernels were not compiled"
        assert any(a.startswith("90") for a in info["cuda_archs"])
        if not os.environ.get("EBBTIDE_CUDA_ARCHS") and not os.environ.get("CMAKE_ARGS"):
            # the default build is the fat binary of cmake/EbbtideCudaArchs.cmake, with both kernel variants
            text = (Path(__file__).resolve().parents[2] / "cmake" / "EbbtideCudaArchs.cmake").read_text()
            default = re.search(r'set\(EBBTIDE_DEFAULT_CUDA_ARCHS "([^"]+)"\)', text).group(1).split(";")
            assert info["cuda_archs"] == default
            assert C.quant.VARIANTS == ["sm90", "portable"]


def test_native_launchers_validate_before_launching(native):
    """Argument checks run natively, before any CUDA call — so they work (and raise typed errors) with no GPU — in
    every variant this build has; an unknown variant is refused by name."""
    C = native
    if not C.quant.WITH_CUDA:
        with pytest.raises(ebbtide.UnsupportedError):
            C.quant.int4_unpack(0, 0, 0, 0, 32, 0, 0, 0)
        assert C.quant.VARIANTS == []
        return
    assert C.quant.VARIANTS[-1] == "portable"
    for name in C.quant.VARIANTS:
        v = {"sm90": C.quant.VARIANT_SM90, "portable": C.quant.VARIANT_PORTABLE}[name]
        with pytest.raises(InvalidArgumentError, match="multiple of the group"):
            C.quant.fp8_group_quant(src=16, rows=4, cols=100, ld=100, group=128, q=16, scale=16, scale_mode=0,
                                    scale_layout=0, eps=1e-10, variant=v, stream=0)
        with pytest.raises(InvalidArgumentError, match="eps"):
            C.quant.fp8_block_quant(src=16, experts=1, rows=4, cols=4, ld=4, expert_stride=0, q=16, scale=16,
                                    scale_mode=0, eps=0.0, variant=v, stream=0)
        table = np.zeros((1, 8), dtype=np.int64)
        table[0] = [16, 16, 16, 4, 4, 4, 5, 0]  # wrong tile prefix
        with pytest.raises(InvalidArgumentError, match="prefix"):
            C.quant.fp8_block_quant_list(host_entries=table.ctypes.data, device_entries=16, count=1, eps=1e-4,
                                         variant=v, stream=0)
        with pytest.raises(InvalidArgumentError, match="aligned"):
            C.quant.f32_fp8_encode(src=4, n=4, dst=16, variant=v, stream=0)
    with pytest.raises(InvalidArgumentError, match="divisor"):
        C.quant.int4_quant(src=16, rows=4, cols=128, ld=128, group=128, divisor_x2=16, eps=1e-5, fake_quant=16,
                           packed=0, scale=0, stream=0)
    with pytest.raises(InvalidArgumentError, match="unknown kernel variant 7"):
        C.quant.fp8_block_dequant(q=16, scale=16, experts=1, rows=4, cols=4, out=16, variant=7, stream=0)
    if "sm90" not in C.quant.VARIANTS:
        with pytest.raises(ebbtide.UnsupportedError, match="no sm90 kernels"):
            C.quant.fp8_block_dequant(q=16, scale=16, experts=1, rows=4, cols=4, out=16,
                                      variant=C.quant.VARIANT_SM90, stream=0)


def test_reference_bad_arguments_are_typed_errors():
    from ebbtide import InvalidArgumentError
    from ebbtide.quant import reference as ref
    w = torch.zeros(128, 128, dtype=torch.bfloat16)
    with pytest.raises(InvalidArgumentError, match="scale must be"):
        ref.fp8_block_quant(w, 128, "fp16")
    with pytest.raises(InvalidArgumentError, match="group must be"):
        ref.int4_fake_quant(w, group=48)
