"""What the Megatron loop's trainer writes into its phase records beside the timings: a background release's
report, the memory an offload left in torch's default pool. Each is outside the timed phases and never raises
into the step (a failure to read it is recorded instead)."""
from __future__ import annotations

__all__ = ["note_release", "note_residual", "RESIDUAL_NOTE_BYTES"]

# the offload's residual (torch-reserved bytes outside the tags) above which its blocks are recorded
RESIDUAL_NOTE_BYTES = 64 << 20


def note_release(info: dict, fut) -> None:
    """A finished background release's report into ``info``. A failure is only recorded here: it raises at the next
    release_groups() on every rank, not on this rank alone (its peers would wait in their next collective)."""
    if fut is None or not fut.done():
        return
    err = fut.exception()
    if err is not None:
        info["release_failed"] = f"{type(err).__name__}: {err}"
        return
    bg = fut.result()
    slow = sorted(bg.groups, key=lambda g: -g.seconds)[:3]
    info.update(release_report=bg.summary(), release_background_s=bg.seconds,
                release_slowest={g.name: round(g.seconds, 4) for g in slow})


def note_residual(info: dict, state) -> None:
    """After an offload whose record ``info`` has ``residual_reserved`` above ``RESIDUAL_NOTE_BYTES``: the largest
    live blocks of torch's default pool and the largest segments they keep (``state``: the
    ``ebbtide.integrations.megatron.TrainingState`` that offloaded; with the allocating frames where memory history
    is recorded: the loop's ``memory_history`` option)."""
    if info.get("residual_reserved", 0) <= RESIDUAL_NOTE_BYTES:
        return
    try:
        info["residual_blocks"] = state.residual_blocks(top=6)
        info["residual_segments"] = state.residual_segments(top=4)
    except Exception as e:  # noqa: BLE001
        info["residual_blocks_error"] = f"{type(e).__name__}: {e}"
