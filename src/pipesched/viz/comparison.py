"""Several schedules' timelines stacked on one time axis, as in the zero-bubble paper's figures."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pipesched.analysis.compare import Comparison
from pipesched.errors import ConfigError
from pipesched.viz import _draw
from pipesched.viz._figure import (
    BOTTOM,
    DPI,
    LEFT,
    LEGEND,
    RIGHT,
    STYLE,
    TITLE,
    WIDTH,
    FigureLayout,
    check_path,
    matplotlib_module,
    multi_stage,
    rows_of,
    save,
    some,
    style_rows,
)
from pipesched.viz._units import TimeUnit, time_unit

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["gantt_comparison"]


def gantt_comparison(
    rows: Sequence[Comparison],
    path: str | Path,
    *,
    title: str | None = None,
    unit: str | None = None,
) -> Path:
    """Draws several schedules' timelines stacked on one time axis, like the zero-bubble figures.

    Args:
        rows: from :func:`pipesched.analysis.compare` (schedules that cannot run
            the configuration are listed with the reason).
        path: ``.png`` or ``.svg``.
        title: the title line; the workers and micro-batches when None.
        unit: as for :func:`pipesched.viz.gantt`.

    Returns:
        ``path``.

    Raises:
        ConfigError: ``rows`` is empty or has no timeline, or the suffix is not .png/.svg.

    Example:
        >>> import tempfile, pathlib
        >>> from pipesched.analysis import compare
        >>> out = pathlib.Path(tempfile.mkdtemp()) / "all.svg"
        >>> gantt_comparison(compare(2, 4), out).read_text().startswith("<?xml")
        True
    """
    path = check_path(path)
    schedules = [r.schedule for r in rows if r.schedule is not None and r.timeline is not None]
    timelines = [r.timeline for r in rows if r.schedule is not None and r.timeline is not None]
    if not schedules:
        raise ConfigError(
            "rows has no schedule to draw (every row failed or it is empty); pass "
            "pipesched.analysis.compare(num_workers, num_microbatches)"
        )
    if title is None:
        title = f"{schedules[0].num_workers} workers, {schedules[0].num_microbatches} micro-batches"
    u = time_unit(timelines, unit)
    with matplotlib_module().rc_context(STYLE):
        return save(_comparison_figure(list(rows), title, u), path)


def _comparison_figure(rows: list[Comparison], title: str, u: TimeUnit) -> Figure:
    from matplotlib.figure import Figure

    timelines = [r.timeline for r in rows if r.timeline is not None]
    workers = max(t.num_workers for t in timelines)
    band, gap, failed_height = min(0.3, max(0.07, 6 / workers)), 0.36, 0.22
    heights = [
        r.timeline.num_workers * band if r.timeline is not None else failed_height for r in rows
    ]
    height = TITLE - 0.2 + LEGEND + sum(heights) + gap * len(rows) + BOTTOM
    layout, figure = FigureLayout(height), Figure(figsize=(WIDTH, height), dpi=DPI)
    span = max(t.makespan for t in timelines) or 1.0
    points_per_unit = (WIDTH - LEFT - RIGHT) * 72 / (span * 1.005)
    multi = any(multi_stage(t) for t in timelines)
    top, first_ax, last_ax, kinds = TITLE - 0.2 + LEGEND + gap, None, None, set()
    modes = set()
    for r, h in zip(rows, heights, strict=True):
        ax = layout.axes(figure, top, h, **({"sharex": first_ax} if first_ax else {}))
        first_ax = first_ax or ax
        top += h + gap
        if r.timeline is None or r.schedule is None:
            ax.set_axis_off()
            ax.text(0, 0.5, f"{r.name}: cannot run: {r.reason.split(';')[0]}", va="center")
            continue
        t, s = r.timeline, r.schedule
        kinds |= {e.action.kind for e in t.events}
        labels = _draw.choose_labels([t], points_per_unit, 0.76 * band * 72, multi=multi_stage(t))
        modes.add(labels.mode)
        last_ax = ax
        ax.set_xlim(0, span * 1.005 * u.scale)
        ax.set_ylim(t.num_workers - 0.5, -0.5)
        rows_y = {w: float(w) for w in range(t.num_workers)}
        _draw.draw_boxes(ax, t, rows_y, 0.76, u, labels, points_per_unit)
        style_rows(ax, rows_of(t, rows_y, band * 72), band * 72, show_x=False)
        memory = some(r.peak_memory)
        ax.set_title(
            f"{r.name}  ({s.num_stages} stages):  makespan {u.format(t.makespan)},  "
            f"bubble {t.bubble_fraction:.1%},  peak activations per worker [{memory}]",
            loc="left",
            fontsize=8.5,
            pad=3,
        )
    if last_ax is not None:
        last_ax.tick_params(axis="x", labelbottom=True)
        last_ax.set_xlabel(u.label)
    layout.title(figure, [title])
    mode = next((m for m in ("mb", "stage:mb") if m in modes), "none")
    handles = _draw.kind_handles(kinds, multi=multi, labels=_draw.Labels(mode, 0))
    layout.legend(figure, handles, TITLE - 0.2)
    return figure
