"""How a bad value reads in an error message (one rule for every component's input checks)."""
from __future__ import annotations

import sys


def shown(value, *, bare_numbers: bool = False) -> str:
    """The value as the user passed it, with its type where the repr alone could mislead ('0.1' vs 0.1, 128.0 vs
    128, True vs 1): always, or (``bare_numbers``) for everything but plain ints and floats. A tensor is named by
    dtype and shape, never printed; a long repr is cut at 60 characters."""
    torch = sys.modules.get("torch")  # only a process that has torch can hold a tensor
    if torch is not None and isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    if bare_numbers and isinstance(value, (int, float)) and not isinstance(value, bool):
        return text
    return f"{text} ({type(value).__name__})"
