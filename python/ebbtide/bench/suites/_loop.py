"""The colocated loop as a suite runs it (the megatron and fsdp suites): its output folder under
``$EBBTIDE_TEST_ARTIFACTS`` (scripts/gpu-check packs that folder into its logs) or a fresh temporary one, its
progress through the suite's context."""
from __future__ import annotations

import os
import tempfile

from ... import settings

__all__ = ["run_colocated"]


def run_colocated(ctx, trainer: str, *, timeout_s: int, **overrides) -> tuple:
    """``run_loop(trainer=trainer)`` at the suite's size (``ctx.quick``); ``overrides``: other RunConfig fields.
    Returns (results, the output folder)."""
    from ...testing.spawn import TEST_ARTIFACTS  # noqa: PLC0415
    from ..colocate.launcher import run_loop  # noqa: PLC0415

    art = settings.get(TEST_ARTIFACTS)
    out = os.path.join(art, f"{trainer}-colocate") if art else tempfile.mkdtemp(prefix=f"ebbtide-{trainer}-colocate-")
    os.makedirs(out, exist_ok=True)
    ctx.progress(f"{trainer}: colocated loop, {'quick' if ctx.quick else 'default'} size (out: {out})")
    return run_loop(trainer=trainer, out=out, quick=ctx.quick, timeout_s=timeout_s, log=ctx.progress,
                    **overrides), out
