"""ebbtide.quant — FP8 block/group and INT4 QAT kernels under one pinned numerics contract.

CPU tensors run the reference (``ebbtide.quant.reference``, the oracle); CUDA tensors run the native kernels, which
match it bit for bit: the sm90 variant where the GPU has FP8 conversion instructions (compute capability 8.9+), the
portable variant elsewhere (8.0+); ``kernels()`` says which, ``EBBTIDE_QUANT_KERNELS`` chooses. See api.py for the
policies and docs/quant.md for the contract.
"""
from __future__ import annotations

from . import layout, reference
from .api import (Fp8Bucket, fp8_block_dequant, fp8_block_quant, fp8_block_quant_into, fp8_block_quant_list,
                  fp8_group_quant, int4_fake_quant, int4_pack, int4_unpack)
from .layout import Fp8BucketLayout
from .prepared import Fp8BucketQuant, SegmentCopy
from ._dispatch import kernels
from .export import (DEFAULT_IGNORE, check_int4_config, export_fp8, export_int4, fp8_quantization_config,
                     int4_quantization_config)
from .. import settings as _settings

_settings.check_component("quant")  # EBBTIDE_QUANT_KERNELS fails at import

__all__ = [
    "reference", "layout", "Fp8Bucket", "Fp8BucketLayout", "Fp8BucketQuant", "SegmentCopy", "fp8_block_quant",
    "fp8_block_quant_list",
    "fp8_block_quant_into", "fp8_group_quant", "fp8_block_dequant",
    "int4_fake_quant", "int4_pack", "int4_unpack", "export_fp8", "export_int4", "check_int4_config",
    "fp8_quantization_config", "int4_quantization_config", "DEFAULT_IGNORE", "kernels",
]
