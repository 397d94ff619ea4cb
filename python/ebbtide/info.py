"""`python -m ebbtide info`: what was built and what this machine offers, truthfully (no GPU is a fact, not an
error). A setting that does not parse is reported, with what it accepts, beside everything else that could be
found out (``settings_problems``); it does not stop the report."""
from __future__ import annotations

import os
import platform
import re
import sys

from . import __version__
from .errors import SettingError

_SET_HERE = re.compile(r"^(?:EBBTIDE|TMS)_[A-Z0-9_]+$")


def _or_setting_error(fn, fallback):
    """fn(), or (fallback, the SettingError's message) when a setting it reads does not parse."""
    try:
        return fn(), ""
    except SettingError as e:
        return fallback, str(e)


def collect() -> dict:
    from . import _native, _nvml  # noqa: PLC0415

    C = _native.load()
    info: dict = {"ebbtide": __version__, "python": sys.version.split()[0], "platform": platform.platform()}
    info["build"] = C.build_info()
    try:
        info["runtime_library"] = _native.runtime_library_path()
    except FileNotFoundError as e:
        info["runtime_library"] = f"missing ({e})"
    feats = C.cpu_features()
    isa, isa_error = _or_setting_error(C.cpu_isa, "unknown")
    reason, _ = _or_setting_error(C.cpu_isa_reason, "not chosen: EBBTIDE_CPU_ISA does not parse (BAD SETTING below)")
    info["cpu"] = {
        "isa": isa,
        "isa_reason": reason,
        "features": [k for k, v in feats.items() if v],
        "affinity_threads": C.cpu_affinity_count(),
        "model": _cpu_model(),
    }
    status, reason = C.driver_status()
    if status == 0:
        info["driver"] = {"found": True, "path": C.driver_path(), "version": C.driver_version(),
                          "devices": C.device_count()}
    else:
        info["driver"] = {"found": False, "reason": reason}
    gpus, why = _nvml.gpus()
    info["gpus"] = gpus
    if why:
        info["gpus_note"] = why
    try:
        import torch  # noqa: PLC0415

        info["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda,
                         "cuda_available": bool(torch.cuda.is_available())}
    except ImportError:
        info["torch"] = None
    from . import settings  # noqa: PLC0415

    info["settings_set"] = {k: v for k, v in sorted(os.environ.items()) if _SET_HERE.match(k)}
    info["settings_problems"] = [{"name": e.name, "value": e.value, "message": str(e)} for e in settings.problems()]
    return info


def _cpu_model() -> str:
    return _cpuinfo_field("model name") or platform.processor() or "unknown"


def _cpuinfo_field(key: str) -> str | None:
    """The first ``key : value`` of /proc/cpuinfo (e.g. "model name", "vendor_id"), or None where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _driver_version_text(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def render(info: dict) -> str:
    b = info["build"]
    lines = [f"ebbtide {info['ebbtide']}  (python {info['python']}, {info['platform']})"]
    if b["cuda"]:
        lines.append(f"  CUDA kernels     : yes (nvcc {b['nvcc_version']}, archs {', '.join(b['cuda_archs'])})")
    else:
        lines.append("  CUDA kernels     : no (built without nvcc: CPU parts only)")
    lines.append(f"  components       : {b['components'] or '(none with native code)'}")
    lines.append(f"  compiler         : {b['cxx_compiler']} ({b['build_type']})")
    lines.append(f"  shim / runtime   : {info['runtime_library']}")
    cpu = info["cpu"]
    lines.append(f"  CPU              : {cpu['model']}, {cpu['affinity_threads']} threads available")
    lines.append(f"  CPU ISA          : {cpu['isa']}  [{' '.join(cpu['features']) or 'baseline'}]")
    lines.append(f"  CPU ISA because  : {cpu['isa_reason']}")
    d = info["driver"]
    if d["found"]:
        lines.append(f"  CUDA driver      : {d['path']} (CUDA {_driver_version_text(d['version'])}), "
                     f"{d['devices']} device(s)")
    else:
        lines.append(f"  CUDA driver      : not found ({d['reason']})")
    if info["gpus"]:
        for g in info["gpus"]:
            lines.append(f"  GPU {g['index']}            : {g['name']}, {g['memory_total'] / 2**30:.1f} GiB, "
                         f"driver {g['driver']}")
    else:
        lines.append(f"  GPUs             : none ({info.get('gpus_note', 'none found')})")
    t = info["torch"]
    if t is None:
        lines.append("  torch            : not installed")
    else:
        lines.append(f"  torch            : {t['version']} (CUDA {t['cuda']}, available: {t['cuda_available']})")
    set_here = info.get("settings_set") or {}
    lines.append(f"  settings set     : {', '.join(f'{k}={v!r}' for k, v in set_here.items()) or 'none (defaults)'}")
    for p in info.get("settings_problems") or []:
        lines.append(f"  BAD SETTING      : {p['message']}")
    return "\n".join(lines)
