"""Rendering benchmark rows: a text table, and a PNG chart (matplotlib, optional)."""
from __future__ import annotations

from .registry import Row


def fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def _ratio(v: float | None, suffix: str) -> str:
    return "-" if v is None else f"{v:.2f}{suffix}"


OVER_MARK = "!"  # beside an "of limit" past 100%, with the reason under the table (and on the chart)


def over_limit(r: Row) -> bool:
    f = r.of_limit()
    return f is not None and f > 1.0


def over_limit_reason(r: Row) -> str:
    """Why a row's figure passes its limit: the suite's reason, or what it can only mean."""
    if r.over_limit_why:
        return r.over_limit_why
    if not r.higher_is_better:
        return ("better than the bound measured in this run: the bound counts work this path does not do, or the "
                "bound is a sample of a busy machine")
    return ("past the limit measured in this run: the limit is the best of a few passes of a probe on a shared "
            "machine (a figure within a few % of it is at the limit, within noise); more than that, the row counts "
            "bytes its kernel does not move")


def _of_limit_text(r: Row) -> str:
    f = r.of_limit()
    if f is None:
        return "-"
    return f"{f * 100:.0f}%" + (f" {OVER_MARK}" if f > 1.0 else "")


def _missing(r: Row) -> bool:
    return r.anchor is None and r.anchor_note.startswith("not installed")


def missing_anchors(rows: list[Row]) -> dict[str, str]:
    """{anchor: how to install it} for every anchor some row could not measure because it is not installed: said
    once under the table, not in each row."""
    out: dict[str, str] = {}
    for r in rows:
        if _missing(r):
            out.setdefault(r.anchor_name or r.suite, r.anchor_note)
    return out


def table(rows: list[Row]) -> str:
    """The rows as a text table, then one line per anchor that is not installed and one per row past its limit."""
    head = ["suite", "benchmark", "unit", "ebbtide", "anchor", "vs anchor", "limit", "of limit"]
    body = []
    for r in rows:
        if r.anchor is not None:
            anchor = f"{fmt(r.anchor)} ({r.anchor_name})" if r.anchor_name else fmt(r.anchor)
        elif _missing(r):
            anchor = f"- ({r.anchor_name} not installed)" if r.anchor_name else "- (not installed)"
        else:
            anchor = r.anchor_note or "-"
        body.append([r.suite, r.name, r.unit, fmt(r.ours), anchor, _ratio(r.vs_anchor(), "x"), fmt(r.limit),
                     _of_limit_text(r)])
    if not body:
        return "(no benchmark rows)"
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = [line(head), line(["-" * w for w in widths]), *map(line, body)]
    for name, note in missing_anchors(rows).items():
        out.append(f"anchor {name}: {note}")
    for r in rows:
        if over_limit(r):
            out.append(f"{OVER_MARK} {r.suite}: {r.name}: {r.of_limit() * 100:.0f}% of {r.limit_name or 'its limit'}"
                       f": {over_limit_reason(r)}")
    return "\n".join(out)


PLOT_SUFFIXES = (".png",)


def plot_unavailable(path: str | None = None) -> str:
    """Why a chart cannot be drawn here, or at ``path`` ("" if it can): matplotlib missing, or a file name that is
    not a PNG (the chart is a PNG; another suffix would fail after the whole run)."""
    if path is not None and not path.lower().endswith(PLOT_SUFFIXES):
        return "the chart is a PNG: name a file ending in .png"
    try:
        import matplotlib  # noqa: F401,PLC0415
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    return ""


def machine_text(env: dict) -> str:
    """One line naming what the numbers were measured on (from runner.environment())."""
    cpu = env.get("cpu") or {}
    parts = [cpu.get("model") or "CPU", f"{cpu.get('affinity_threads', '?')} threads"]
    gpus = env.get("gpus") or []
    names = [g.get("name", "GPU") for g in gpus if isinstance(g, dict)]
    parts.append(f"{len(names)} x {names[0]}" if names else "no GPU")
    t = env.get("torch") or {}
    if t:
        parts.append(f"torch {t.get('version')}")
    return ", ".join(str(p) for p in parts)


def plot(rows: list[Row], path: str, *, env: dict | None = None, skipped: list | tuple = ()) -> None:
    """A chart readable alone: each row's fraction of its physical limit and its speed-up over its anchor, the
    value written on every bar (a bar past 100% hatched and marked), the anchor's name beside its ratio, the
    machine and date in the title, the anchors not installed and the skipped suites listed under the panels."""
    import textwrap  # noqa: PLC0415

    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    env = env or {}
    labels = [f"{r.suite}: {r.name}" for r in rows]
    of_limit = [(r.of_limit() or 0) * 100 for r in rows]
    vs_anchor = [r.vs_anchor() or 0 for r in rows]
    foot = [f"anchor {n}: {why}" for n, why in missing_anchors(rows).items()]
    foot += [f"{OVER_MARK} {r.suite}: {r.name}: {r.of_limit() * 100:.0f}% of its limit: {over_limit_reason(r)}"
             for r in rows if over_limit(r)]
    foot += [f"skipped {what}: {why}" for what, why in skipped]
    foot = [w for line in foot for w in textwrap.wrap(line, 190, subsequent_indent="    ")]
    h = max(3.0, 0.35 * len(rows) + 1.8 + 0.18 * len(foot))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(16, h), sharey=True)
    y = list(range(len(rows)))
    colors = ["#d8663b" if over_limit(r) else "#3b7dd8" for r in rows]
    bars = a1.barh(y, of_limit, color=colors)
    for bar, r in zip(bars, rows):
        if over_limit(r):
            bar.set_hatch("//")
    for yi, v, r in zip(y, of_limit, rows):
        a1.text(v + 1, yi, _of_limit_text(r) if r.of_limit() is not None else "no limit", va="center", fontsize=7)
    a1.axvline(100, color="k", lw=0.8)
    a1.set_xlim(0, max([110.0] + [v * 1.18 for v in of_limit]))
    a1.set_xlabel(f"% of the physical limit measured in the same run ({OVER_MARK} hatched: past it, see below)")
    a1.set_yticks(y, labels, fontsize=8)
    a1.invert_yaxis()
    a2.barh(y, vs_anchor, color="#2ca25f")
    for yi, v, r in zip(y, vs_anchor, rows):
        if r.vs_anchor() is not None:
            text = f"{v:.2f}x vs {r.anchor_name or 'anchor'}"
        else:
            text = f"{r.anchor_name} not installed" if _missing(r) else (r.anchor_note or "no anchor")
        a2.text(v + 0.02 * max(vs_anchor + [1.0]), yi, text, va="center", fontsize=7)
    a2.axvline(1, color="k", lw=0.8)
    a2.set_xlim(0, max(vs_anchor + [1.0]) * 1.9)
    a2.set_xlabel("speed-up over the anchor, measured in the same run (> 1: ebbtide is faster)")
    when = env.get("time", "")
    fig.suptitle(f"ebbtide bench {env.get('ebbtide', '')}, {when[:10]} {when[11:16]} UTC\n{machine_text(env)}",
                 fontsize=10)
    if foot:
        fig.text(0.01, 0.005, "\n".join(foot), fontsize=7, va="bottom", family="monospace")
    fig.tight_layout(rect=(0, min(0.6, (0.18 * len(foot) + 0.1) / h), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
