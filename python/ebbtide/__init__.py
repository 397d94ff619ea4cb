"""ebbtide: GPU memory and communication runtime for colocated RL post-training."""
from __future__ import annotations

__version__ = "0.1.0"

from .errors import *  # noqa: F401,F403  (typed exceptions are part of the top-level API)
from .errors import __all__ as _errors_all

__all__ = ["__version__", *_errors_all]
