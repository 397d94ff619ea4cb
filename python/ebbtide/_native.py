"""Loading the native parts: the extension ``_C`` and the runtime library ``libebbtide.so`` beside it.

``load()`` imports ``_C`` once and checks that the extension, the runtime library it loaded and the Python
package are the same version (mixing builds is the classic source of silent ABI bugs).
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

from . import __version__
from .errors import VersionMismatchError

PACKAGE_DIR = Path(__file__).resolve().parent
RUNTIME_LIBRARY = "libebbtide.so"


def _code(version: str) -> int:
    major, minor, patch = (int(x) for x in version.split(".")[:3])
    return major * 10000 + minor * 100 + patch


@functools.lru_cache(maxsize=None)
def load():
    """The extension module, version-checked. Raises ImportError with a build hint if it is missing."""
    try:
        from . import _C  # noqa: PLC0415
    except ImportError as e:
        raise ImportError(
            f"ebbtide's native extension could not be loaded ({e}). {_where()} Build it with "
            "`pip install .` (or `pip install --no-build-isolation -e .` for development) from the source tree."
        ) from e
    expected = _code(__version__)
    if _C.EXTENSION_VERSION_CODE != expected or _C.runtime_version() != expected:
        raise VersionMismatchError(
            f"ebbtide {__version__} (code {expected}) found extension {_C.EXTENSION_VERSION_CODE} and runtime "
            f"library {_C.runtime_version()}: reinstall ebbtide so all three come from one build"
        )
    return _C


def _where() -> str:
    """Where the package was imported from and which native files sit there: what a failed import of ``_C`` needs
    to be diagnosed (another copy of the package earlier on sys.path, a build that did not finish)."""
    import sys  # noqa: PLC0415

    pkg = sys.modules.get(__package__)
    dirs = list(getattr(pkg, "__path__", []) or [])
    found = sorted(f.name for d in dirs for f in Path(d).glob("*.so")) if dirs else []
    return (f"The package {__package__!r} was imported from {dirs or '?'} (native files there: {found or 'none'}; "
            f"cwd {os.getcwd()}; sys.path {sys.path[:6]}).")


def runtime_library_path() -> str:
    """Absolute path of libebbtide.so: the LD_PRELOAD shim and the pluggable-allocator library."""
    path = PACKAGE_DIR / RUNTIME_LIBRARY
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: the native build did not complete")
    return os.fspath(path)
