"""Gantt pictures of a schedule or a timeline, planned or measured, as PNG or SVG.

Why not torch's visualizer: it draws every action with unit width, hiding the costs
that make the bubbles; here a box is as wide as its action took. matplotlib is
imported only inside these functions, on a figure of its own (no pyplot).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipesched.errors import ConfigError, ConfigTypeError
from pipesched.schedule import Costs, Schedule, Timeline
from pipesched.schedule.breakdown import PARTS
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
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["gantt"]

_END = "#B22222"


def gantt(
    timeline_or_schedule: Timeline | Schedule,
    path: str | Path,
    *,
    costs: Costs | None = None,
    overlay: Timeline | None = None,
    title: str | None = None,
    unit: str | None = None,
    activations: bool = True,
) -> Path:
    """Draws a timeline (or a schedule, simulated) as a Gantt chart; PNG or SVG by suffix.

    One row per worker; each action is a box as wide as its duration,
    coloured by kind (F, B, W; a worker's later stages darker), with its
    micro-batch number inside where it fits (``stage:micro-batch`` when a
    worker runs several stages). A prediction (:meth:`pipesched.Pipeline.predict`)
    has its step time and its bubble split by cause under the title. Idle
    time is hatched grey and each row's idle share is written at its right.
    The title gives makespan and bubble. A second panel shows each stage's
    held activations over time.

    Args:
        timeline_or_schedule: a Timeline (``pipe.last_timeline``,
            ``schedule.simulate(costs)``, ``Timeline.load(path)``) or a
            Schedule, simulated with ``costs``.
        path: the picture to write, ``.png`` or ``.svg``; missing folders are made.
        costs: durations for simulating a Schedule (unit costs when None);
            only with a Schedule.
        overlay: a second timeline drawn lighter under each worker's row,
            typically the plan ``schedule.simulate(measured.measured_costs())``
            under the measured run, so the gap between them shows. Must have the
            same number of workers.
        title: the first title line; when None the schedule's name (or
            "measured run vs plan" with an overlay) and the pipeline's shape.
        unit: ``"s"`` (times are seconds; drawn in ms) or ``"units"``; None
            guesses seconds when the times are not simple fractions, as
            measured ones never are.
        activations: draw the held-activations panel.

    Returns:
        ``path``.

    Raises:
        ConfigError: an argument does not fit (suffix, costs with a Timeline,
            overlay with other workers, unknown unit).
        ScheduleError: the schedule cannot run.
        ModuleNotFoundError: matplotlib is not installed.

    Example:
        >>> import tempfile, pathlib
        >>> from pipesched.schedule import get_schedule
        >>> out = pathlib.Path(tempfile.mkdtemp()) / "1f1b.png"
        >>> gantt(get_schedule("1f1b", 4, 8), out, costs=Costs(1, 2, 0)).stat().st_size > 0
        True
    """
    path = check_path(path)
    name = None
    if isinstance(timeline_or_schedule, Schedule):
        name = timeline_or_schedule.name
        timeline = timeline_or_schedule.simulate(costs)
    elif isinstance(timeline_or_schedule, Timeline):
        if costs is not None:
            raise ConfigError(
                "costs= only applies when a Schedule is drawn; a Timeline already has its "
                "times. Pass the schedule instead, or leave costs out"
            )
        timeline = timeline_or_schedule
    else:
        raise ConfigTypeError(
            f"timeline_or_schedule must be a Timeline or a Schedule, got "
            f"{type(timeline_or_schedule).__name__}"
        )
    if overlay is not None and not isinstance(overlay, Timeline):
        raise ConfigTypeError(
            f"overlay must be a Timeline, got {type(overlay).__name__}; simulate the plan "
            "first: pipe.schedule_for(m).simulate(measured.measured_costs())"
        )
    if overlay is not None and overlay.num_workers != timeline.num_workers:
        raise ConfigError(
            f"overlay has {overlay.num_workers} workers but the timeline has "
            f"{timeline.num_workers}; overlay the plan of the same pipeline"
        )
    u = time_unit([timeline], unit)
    if title is None:
        title = "measured run vs plan" if overlay is not None else (name or "timeline")
        title += f": {_shape(timeline)}"
    with matplotlib_module().rc_context(STYLE):
        figure = _gantt_figure(timeline, overlay, title, u, activations)
        return save(figure, path)


def _gantt_figure(
    timeline: Timeline, overlay: Timeline | None, title: str, u: TimeUnit, activations: bool
) -> Figure:
    """The figure :func:`gantt` saves: title, legend, the rows of boxes, held activations."""
    from matplotlib.figure import Figure

    workers, multi = timeline.num_workers, multi_stage(timeline)
    band = min(0.36, max(0.13, 8 / workers)) * (1.72 if overlay is not None else 1)
    gantt_height, act_height, gap = workers * band, 1.2, 0.48
    height = TITLE + LEGEND + gantt_height + BOTTOM + (gap + act_height if activations else 0)
    layout, figure = FigureLayout(height), Figure(figsize=(WIDTH, height), dpi=DPI)
    both = [timeline] if overlay is None else [timeline, overlay]
    span = max(t.makespan for t in both) or 1.0
    points_per_unit = (WIDTH - LEFT - RIGHT) * 72 / (span * 1.005)
    bar = 0.38 if overlay is not None else 0.76
    labels = _draw.choose_labels(both, points_per_unit, bar * band * 72, multi=multi)

    ax = layout.axes(figure, TITLE + LEGEND, gantt_height)
    ax.set_xlim(0, span * 1.005 * u.scale)
    ax.set_ylim(workers - 0.5, -0.5)
    offset = 0.23 if overlay is not None else 0.0
    rows = {w: w - offset for w in range(workers)}
    _draw.draw_boxes(ax, timeline, rows, bar, u, labels, points_per_unit)
    row_pt = band * 72 / (2 if overlay is not None else 1)
    named = rows_of(timeline, rows, row_pt)
    lines = [f"makespan {u.format(timeline.makespan)}, bubble {timeline.bubble_fraction:.1%}"]
    if overlay is not None:
        plan_rows = {w: w + offset for w in range(workers)}
        _draw.draw_boxes(ax, overlay, plan_rows, bar, u, labels, points_per_unit, faded=True)
        named += rows_of(overlay, plan_rows, row_pt, plan=True)
        for t, style in ((timeline, "-"), (overlay, (0, (2, 2)))):
            ax.axvline(t.makespan * u.scale, color=_END, lw=0.9, ls=style, zorder=4)
        lines = [
            f"measured: {lines[0]}   |   plan (lighter rows): makespan "
            f"{u.format(overlay.makespan)}, bubble {overlay.bubble_fraction:.1%}"
        ]
    elif timeline.breakdown is not None:  # a prediction: its step time and bubble by cause
        b = timeline.breakdown
        parts = ", ".join(f"{name} {u.format(getattr(b, name))}" for name in PARTS)
        lines[0] = (
            f"predicted step {u.format(timeline.step_time)}, bubble "
            f"{timeline.bubble_fraction:.1%} of worker-time: {parts}"
        )
    else:
        lines[0] += f", peak activations per stage [{some(timeline.peak_activations)}]"
    style_rows(ax, named, row_pt, show_x=True)
    layout.title(figure, [title, lines[0]])
    kinds = {e.action.kind for t in both for e in t.events}
    handles = _draw.kind_handles(kinds, multi=multi, labels=labels)
    if overlay is not None:
        from matplotlib.lines import Line2D

        handles += [
            Line2D([], [], color=_END, lw=0.9, label="measured end"),
            Line2D([], [], color=_END, lw=0.9, ls=(0, (2, 2)), label="plan end"),
        ]
    layout.legend(figure, handles, TITLE)
    if activations:
        ax.set_xlabel(u.label, fontsize=7.5, labelpad=1)
        ax2 = layout.axes(figure, TITLE + LEGEND + gantt_height + gap, act_height, sharex=ax)
        handles = []
        if overlay is not None:
            _draw.draw_activations(ax2, overlay, u, dashed=True)
        handles += _draw.draw_activations(ax2, timeline, u)
        if overlay is not None:
            from matplotlib.lines import Line2D

            handles.append(Line2D([], [], color="#555555", lw=1, ls=(0, (3, 2)), label="plan"))
        _style_activations(ax2, handles, max(max(t.peak_activations, default=0) for t in both))
        ax2.set_xlabel(u.label)
    else:
        ax.set_xlabel(u.label)
    return figure


def _style_activations(ax: Axes, handles: list[Any], peak: int) -> None:
    """Integer y ticks up to ``peak``, a light grid, the stages' legend at the right."""
    from matplotlib.ticker import MaxNLocator

    ax.set_ylim(0, peak + 0.6)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=5))
    ax.set_ylabel("held activations\n(micro-batches)", fontsize=7.5)
    ax.tick_params(labelsize=7.5)
    ax.grid(color="#E6E6E6", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.005, 1.04),
        frameon=False,
        fontsize=7,
        handlelength=1.6,
        borderaxespad=0,
    )


def _shape(timeline: Timeline) -> str:
    """``"4 stages on 4 workers, 8 micro-batches"``."""
    m = 1 + max((e.action.microbatch for e in timeline.events), default=-1)
    return f"{timeline.num_stages} stages on {timeline.num_workers} workers, {m} micro-batches"
