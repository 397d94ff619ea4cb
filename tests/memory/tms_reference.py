"""Where the real torch_memory_saver is, for the tests that compare against it (shared by CPU and GPU tests).

The wheel is found through EBBTIDE_TMS_WHEEL, else ``<repo>/.whl/torch_memory_saver-*.whl`` (carried to the GPU
machine). It is unpacked (a wheel is a zip) into a directory that goes on PYTHONPATH; nothing is installed.
"""
from __future__ import annotations

import glob
import os
import zipfile
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]


def wheel() -> Optional[str]:
    env = os.environ.get("EBBTIDE_TMS_WHEEL")
    if env:
        return env if os.path.exists(env) else None
    found = sorted(glob.glob(str(REPO / ".whl" / "torch_memory_saver-*.whl")))
    return found[-1] if found else None


def unpack(dest: Path) -> Optional[Path]:
    """Unpack the wheel into dest (once); returns the directory to put on PYTHONPATH, or None."""
    w = wheel()
    if w is None:
        return None
    marker = dest / ".unpacked"
    if not marker.exists():
        with zipfile.ZipFile(w) as z:
            z.extractall(dest)
        marker.write_text(w)
    return dest


def entrypoint_source() -> Optional[str]:
    w = wheel()
    if w is None:
        return None
    with zipfile.ZipFile(w) as z:
        return z.read("torch_memory_saver/entrypoint.py").decode()


def preload_library(root: Path, cuda_major: int) -> Path:
    """The real package's preload hook library for this CUDA major version."""
    found = sorted(root.glob(f"torch_memory_saver_hook_mode_preload_cu{cuda_major}.*.so"))
    if not found:
        found = sorted(root.glob("torch_memory_saver_hook_mode_preload.*.so"))
    if not found:
        raise FileNotFoundError(f"no preload library for CUDA {cuda_major} in {root}")
    return found[0]
