"""Drop-in surfaces of other projects' APIs, backed by ebbtide.

``ebbtide.compat.torch_memory_saver`` is the ``torch_memory_saver`` API (SGLang, slime). Switch an engine by
changing one import::

    from ebbtide.compat.torch_memory_saver import torch_memory_saver   # was: from torch_memory_saver import ...

or, without touching its code, by putting our module first on ``sys.path`` under that name::

    PYTHONPATH="$(python -m ebbtide.compat --shim-path):$PYTHONPATH" python -m sglang.launch_server ...

(``shim_path()`` returns the directory; it holds a package named ``torch_memory_saver`` that re-exports ours).
"""
from __future__ import annotations

import os

__all__ = ["shim_path"]


def shim_path() -> str:
    """Directory to put first on sys.path / PYTHONPATH so ``import torch_memory_saver`` loads ebbtide's."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_tms_shim")
