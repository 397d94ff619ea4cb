"""Checkpoint exporters: HF FP8 block (`quant_method: fp8`) and compressed-tensors INT4 `pack-quantized`, with the
`quantization_config` entries engines read. The exporters call the same kernels as the training-side paths
(fp8_block_quant_list / the INT4 kernel behind int4_fake_quant), so an exported checkpoint is bit-identical to
what the trainer's QAT forward used.

Which tensors are quantized: 2-D bf16 tensors whose name ends in ".weight" and matches none of the `ignore`
substrings (defaults: embeddings, lm_head, norms, routers/gates); everything else passes through unchanged.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from ..errors import InvalidArgumentError
from . import _checks
from .api import _check_fixed, _int4_quant, _check_int4, fp8_block_quant_list

__all__ = ["DEFAULT_IGNORE", "export_fp8", "export_int4", "check_int4_config", "fp8_quantization_config",
           "int4_quantization_config"]

DEFAULT_IGNORE = ("embed", "lm_head", "norm", "mlp.gate.", "router")


def _targets(state_dict: Mapping[str, torch.Tensor], ignore: Iterable[str]) -> tuple[list[str], list[str]]:
    _checks.mapping(state_dict, "state_dict")
    if isinstance(ignore, (str, bytes)) or not hasattr(ignore, "__iter__"):
        raise InvalidArgumentError(f"ignore must be a list of name substrings, got {_checks.shown(ignore)}")
    ignore = tuple(ignore)
    if not all(isinstance(s, str) for s in ignore):
        raise InvalidArgumentError(f"ignore must hold strings, got {_checks.shown(ignore)}")
    quant, skipped = [], []
    for name, t in state_dict.items():
        if not name.endswith(".weight") or not isinstance(t, torch.Tensor):
            continue
        if t.dim() == 2 and t.dtype == torch.bfloat16 and not any(s in name for s in ignore):
            quant.append(name)
        else:
            skipped.append(name[: -len(".weight")])
    return quant, skipped


def fp8_quantization_config(scale: str = "fp32", ignore: Iterable[str] = ()) -> dict:
    _check_fixed(scale, "scale", ("fp32", "ue8m0"))
    cfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    if scale == "ue8m0":
        cfg["scale_fmt"] = "ue8m0"
    if ignore:
        cfg["modules_to_not_convert"] = sorted(ignore)
    return cfg


def export_fp8(state_dict: Mapping[str, torch.Tensor], *, scale: str = "fp32", eps: float = 1e-4,
               ignore: Iterable[str] = DEFAULT_IGNORE) -> tuple[dict, dict]:
    """Returns (tensors, quantization_config): each quantized `<m>.weight` becomes `<m>.weight` (float8_e4m3fn)
    plus `<m>.weight_scale_inv` (float32 [ceil(N/128), ceil(K/128)], the dequant multiplier). All weights of one
    device are quantized in one kernel launch into one bucket (the returned tensors are views into it)."""
    _check_fixed(scale, "scale", ("fp32", "ue8m0"))
    names, skipped = _targets(state_dict, ignore)
    out = {k: v for k, v in state_dict.items() if k not in set(names)}
    by_device: dict[torch.device, list[str]] = {}
    for n in names:
        by_device.setdefault(state_dict[n].device, []).append(n)
    for group in by_device.values():
        bucket = fp8_block_quant_list([state_dict[n] for n in group], scale=scale, eps=eps)
        for n, (q, s) in zip(group, bucket):
            out[n] = q
            out[n[: -len("weight")] + "weight_scale_inv"] = s
    return out, fp8_quantization_config(scale, skipped)


def int4_quantization_config(group: int = 128, ignore: Iterable[str] = ()) -> dict:
    _checks.int_choice(group, "group", (32, 64, 128))
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                            "group_size": group, "dynamic": False, "actorder": None, "observer": "minmax"},
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": sorted(ignore),
    }


def export_int4(state_dict: Mapping[str, torch.Tensor], *, group: int = 128, divisor: float = 7,
                eps: float = 1e-5, ignore: Iterable[str] = DEFAULT_IGNORE) -> tuple[dict, dict]:
    """Returns (tensors, quantization_config): each quantized `<m>.weight` becomes `<m>.weight_packed` (int32
    [N, K/8]), `<m>.weight_scale` (bf16 [N, K/group]) and `<m>.weight_shape` (int32 [2]). The packing runs the
    INT4 kernel int4_fake_quant runs, so the served weights equal the QAT forward bit for bit."""
    _checks.int_choice(group, "group", (32, 64, 128))
    _check_fixed(divisor, "divisor", (7, 7.5))
    names, skipped = _targets(state_dict, ignore)
    out = {k: v for k, v in state_dict.items() if k not in set(names)}
    for n in names:
        w = state_dict[n]
        eps_ = _check_int4(w, group, divisor, eps)
        _, packed, s = _int4_quant(w, group, divisor, eps_, fake_quant=False, pack=True)
        m = n[: -len("weight")]
        out[m + "weight_packed"] = packed
        out[m + "weight_scale"] = s
        out[m + "weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int32)
    return out, int4_quantization_config(group, skipped)


def check_int4_config(config: Mapping, group: int, divisor: float = 7) -> None:
    """At load time: raise InvalidArgumentError unless the checkpoint's INT4 scheme is the one the trainer's
    fake-quant uses (4-bit symmetric int, group strategy, the same group size). `divisor` (7: q in [-7, 7];
    7.5: q in [-8, 7]) is a trainer convention compressed-tensors does not record; it is validated here and must
    be the one the checkpoint was exported with."""
    _check_fixed(divisor, "divisor", (7, 7.5))
    _checks.int_choice(group, "group", (32, 64, 128))
    qc = _checks.mapping(_checks.mapping(config, "config").get("quantization_config", config), "quantization_config")
    if qc.get("quant_method") != "compressed-tensors" or qc.get("format") != "pack-quantized":
        raise InvalidArgumentError(f"not a compressed-tensors pack-quantized config: {qc.get('quant_method')!r} / "
                                   f"{qc.get('format')!r}")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, Mapping):
        raise InvalidArgumentError(f"config_groups must be a mapping, got {_checks.shown(groups)}")
    if not groups:
        raise InvalidArgumentError("compressed-tensors config has no config_groups")
    for gname, g in groups.items():
        w = _checks.mapping(g, f"config_groups[{gname!r}]").get("weights") or {}
        _checks.mapping(w, f"config_groups[{gname!r}]['weights']")
        want = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group}
        bad = {k: (w.get(k), v) for k, v in want.items() if w.get(k) != v}
        if bad:
            raise InvalidArgumentError(f"checkpoint {gname} disagrees with the trainer's INT4 fake-quant: "
                                       + ", ".join(f"{k}={got!r} (trainer {v!r})" for k, (got, v) in bad.items()))
