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


def table(rows: list[Row]) -> str:
    head = ["suite", "benchmark", "unit", "ebbtide", "anchor", "vs anchor", "limit", "of limit"]
    body = []
    for r in rows:
        if r.anchor is not None:
            anchor = f"{fmt(r.anchor)} ({r.anchor_name})" if r.anchor_name else fmt(r.anchor)
        else:
            anchor = r.anchor_note or "-"
        body.append([r.suite, r.name, r.unit, fmt(r.ours), anchor, _ratio(r.vs_anchor(), "x"),
                     fmt(r.limit), _ratio(r.of_limit() and r.of_limit() * 100, "%").replace(".00%", "%")])
    if not body:
        return "(no benchmark rows)"
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


def plot_unavailable() -> str:
    """Why a chart cannot be drawn here ("" if it can)."""
    try:
        import matplotlib  # noqa: F401,PLC0415
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    return ""


def plot(rows: list[Row], path: str) -> None:
    """Two panels: each row's fraction of its physical limit, and its speed-up over the anchor."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    labels = [f"{r.suite}: {r.name}" for r in rows]
    of_limit = [(r.of_limit() or 0) * 100 for r in rows]
    vs_anchor = [r.vs_anchor() or 0 for r in rows]
    h = max(3.0, 0.35 * len(rows) + 1.5)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(14, h), sharey=True)
    y = range(len(rows))
    a1.barh(y, of_limit, color="#3b7dd8")
    a1.axvline(100, color="k", lw=0.8)
    a1.set_xlabel("% of the physical limit measured in the same run")
    a1.set_yticks(list(y), labels, fontsize=8)
    a1.invert_yaxis()
    a2.barh(y, vs_anchor, color="#2ca25f")
    a2.axvline(1, color="k", lw=0.8)
    a2.set_xlabel("speed-up over the anchor (same run; 0 = no anchor)")
    fig.suptitle("ebbtide bench")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
