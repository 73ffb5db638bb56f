"""Line plots of benchmark result rows, written as PNG on matplotlib's Agg canvas (no display, no pyplot state).
matplotlib is the optional `plot` extra, imported only when a plot is asked for, so tandem runs without it.

    lines = lines_by(rows, x="prompt_len", y="wall_s", label=lambda r: f"PCP={r['pcp_size']}")
    plot_lines("ttft.png", [Panel("TTFT s", lines)], title="...", x_label="prompt tokens", log2_x=True)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MISSING_MATPLOTLIB = "--plot needs matplotlib: pip install 'tandem[plot]'"
MAX_TICKED_XS = 12  # up to this many distinct x values, each gets its own labelled tick

Points = list[tuple[float, float]]
Row = Mapping[str, Any]


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


@dataclass(frozen=True)
class Panel:
    """One set of axes: a y label, its lines (label -> (x, y) points) and dashed horizontal references."""

    y_label: str
    lines: Mapping[str, Points]
    references: Mapping[str, float] = field(default_factory=dict)  # label -> y, e.g. {"ideal (P=2)": 2.0}
    log_y: bool = False
    y_min: float | None = None  # e.g. 0 for rates, so small differences are not blown up


def require_matplotlib() -> None:
    """Call before a long benchmark starts, so a missing matplotlib fails it at once rather than at the end."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise PlotUnavailable(MISSING_MATPLOTLIB) from e


def lines_by(rows: Iterable[Row], x: str, y: str | Callable[[Row], float | None],
             label: Callable[[Row], str]) -> dict[str, Points]:
    """Groups rows into lines, one per `label(row)` in first-seen order, of (row[x], y) points sorted by x.
    `y` is a field name or a function of the row; rows whose y is None are left out."""
    value = (lambda r: r[y]) if isinstance(y, str) else y
    lines: dict[str, Points] = {}
    for row in rows:
        v = value(row)
        if v is not None:
            lines.setdefault(label(row), []).append((float(row[x]), float(v)))
    return {name: sorted(points) for name, points in lines.items()}


def machine_caption(info: Mapping[str, Any], model: str) -> str:
    """The subtitle every benchmark plot carries: what ran, on what, when."""
    return (f"{model} | {info.get('cpu', 'unknown CPU')}, {info.get('num_cores')} cores, torch {info.get('torch')}"
            f" | {info.get('date', '')}")


def _minor_log_label(value: float, _pos: int) -> str:
    """Labels the 2, 3 and 5 between decades, leaving the others blank so they do not crowd."""
    mantissa = value / 10 ** math.floor(math.log10(value)) if value > 0 else 0
    return f"{value:g}" if round(mantissa) in (2, 3, 5) else ""


def plot_lines(path: str | Path, panels: Sequence[Panel], *, title: str, x_label: str, subtitle: str = "",
               log2_x: bool = False, share_y: bool = False) -> Path:
    """Writes the panels side by side, sharing `x_label` (and the y range with `share_y`, for panels of one
    quantity), as one PNG at `path`; returns the path."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not panels:
        raise ValueError("plot_lines needs at least one panel")
    # one colour per line label in every panel (matplotlib's default cycle, C0..C9, by first appearance)
    colours: dict[str, str] = {}
    for panel in panels:
        for name in panel.lines:
            colours.setdefault(name, f"C{len(colours) % 10}")
    fig = Figure(figsize=(5.2 * len(panels), 4.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False, sharey=share_y)[0]
    for ax, panel in zip(axes, panels, strict=True):
        _draw_panel(ax, panel, colours, x_label, log2_x)
    for ax, panel in zip(axes, panels, strict=True):  # once all data is drawn, so a shared y range covers it all
        if panel.y_min is not None:
            ax.set_ylim(bottom=panel.y_min)
        if panel.references:  # keep a reference line off the frame's top edge
            ax.set_ylim(top=max(ax.get_ylim()[1], 1.08 * max(panel.references.values())))
    fig.suptitle(f"{title}\n{subtitle}" if subtitle else title, fontsize="medium")
    out = Path(path)
    fig.savefig(out, dpi=110)
    return out


def _draw_panel(ax: Any, panel: Panel, colours: Mapping[str, str], x_label: str, log2_x: bool) -> None:
    from matplotlib.ticker import FuncFormatter, NullLocator

    xs: set[float] = set()
    for name, points in panel.lines.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name, color=colours[name])
        xs.update(p[0] for p in points)
    for name, value in panel.references.items():
        ax.axhline(value, linestyle="--", color="grey", linewidth=1, label=name)
    if log2_x:
        ax.set_xscale("log", base=2)
    if panel.log_y:  # plain numbers (60, not 6 x 10^1) on the major and minor ticks
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(_minor_log_label))
    if 0 < len(xs) <= MAX_TICKED_XS:  # ticks at the measured x values, written as plain numbers
        ax.set_xticks(sorted(xs), labels=[f"{v:g}" for v in sorted(xs)])
        ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(x_label)
    ax.set_ylabel(panel.y_label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
