"""Timelines on matplotlib axes: a box per action, idle shading, labels, held activations.

Everything here takes axes made by :mod:`pipesched.viz.gantt` and draws in
data coordinates where x is time in the picture's unit, so a box's width is
its action's duration.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipesched.schedule import Event, Timeline

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from pipesched.viz._units import TimeUnit

__all__ = [
    "KIND_COLOURS",
    "Labels",
    "choose_labels",
    "draw_activations",
    "draw_boxes",
    "kind_handles",
    "stage_colour",
]

KIND_COLOURS = {
    "F": ("#9DC3E6", "#4A89C8"),
    "B": ("#A9D18E", "#5E9E3A"),
    "W": ("#FFD966", "#D9A300"),
}
"""Per kind: (a worker's first stage, its later stages)."""
IDLE = "#E4E4E4"
IDLE_HATCH = "#C8C8C8"
EDGE = "#3A3A3A"
TEXT = "#161616"
FADED_TEXT = "#4A4A4A"
_STAGE_PALETTE = (
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e",
    "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22",
)  # fmt: skip
_EM = {":": 0.34, " ": 0.32}  # DejaVu Sans widths in em; digits are 0.64


@dataclass(frozen=True)
class Labels:
    """How boxes are labelled: ``"stage:mb"``, ``"mb"`` or ``"none"``, at ``size`` points."""

    mode: str
    size: float

    def text(self, e: Event) -> str:
        """The label of event ``e``."""
        a = e.action
        return f"{a.stage}:{a.microbatch}" if self.mode == "stage:mb" else str(a.microbatch)


def _width_pt(text: str, size: float) -> float:
    return sum(_EM.get(c, 0.64) for c in text) * size


def choose_labels(
    timelines: list[Timeline], points_per_unit: float, bar_pt: float, *, multi: bool
) -> Labels:
    """The largest labels that fit in nearly every box (90%); boxes too small get none.

    With several stages per worker the stage comes first (``"7:3"``) where it
    fits, else only the micro-batch (the box's shade then tells the stage).

    Args:
        timelines: what is drawn, in the picture's time unit times ``points_per_unit``.
        points_per_unit: box width in points per unit of the timelines' own time.
        bar_pt: box height in points.
        multi: whether a worker runs several stages.
    """
    events = [e for t in timelines for e in t.events if e.duration > 0]
    for mode in ("stage:mb", "mb") if multi else ("mb",):
        for size in (7.5, 6.5, 5.5):
            labels = Labels(mode, size)
            if size > bar_pt * 0.8:
                continue
            fits = sum(
                _width_pt(labels.text(e), size) + 2 <= e.duration * points_per_unit for e in events
            )
            if events and fits >= 0.9 * len(events):
                return labels
    small = Labels("mb", 5.5)
    fits = sum(_width_pt(small.text(e), 5.5) + 2 <= e.duration * points_per_unit for e in events)
    return small if bar_pt * 0.8 >= 5.5 and fits >= 0.3 * len(events) else Labels("none", 5.5)


def stage_colour(stage: int, num_stages: int) -> Any:
    """The colour of ``stage``'s line: distinct up to 10 stages, then dark to light."""
    if num_stages <= len(_STAGE_PALETTE):
        return _STAGE_PALETTE[stage]
    from matplotlib import colormaps

    return colormaps["viridis"](0.9 * stage / (num_stages - 1))


def _fade(colour: str, amount: float = 0.55) -> str:
    """``colour`` mixed with white; ``amount`` of white."""
    rgb = [int(colour[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * amount):02X}" for c in rgb)


def draw_boxes(
    ax: Axes,
    timeline: Timeline,
    rows: dict[int, float],
    height: float,
    unit: TimeUnit,
    labels: Labels,
    points_per_unit: float,
    *,
    faded: bool = False,
) -> None:
    """Draws each worker's actions as boxes on its row, over a shaded idle band.

    Args:
        ax: the Gantt axes (y grows downwards).
        timeline: what to draw; its first action starts at x = 0.
        rows: worker -> the y of its row's centre.
        height: box height in y units.
        unit: the picture's time unit.
        labels: from :func:`choose_labels`.
        points_per_unit: box width in points per unit of the timeline's time.
        faded: draw lighter (a plan under a measured run).
    """
    from matplotlib.patches import Rectangle

    origin, scale = timeline.start, unit.scale
    rank = {
        s: sum(p == w for p in timeline.placement[:s]) for s, w in enumerate(timeline.placement)
    }
    for w, y in rows.items():
        top = y - height / 2
        ax.add_patch(
            Rectangle(
                (0, top),
                timeline.makespan * scale,
                height,
                facecolor=_fade(IDLE, 0.4) if faded else IDLE,
                edgecolor=IDLE_HATCH,
                hatch="////",
                linewidth=0,
                zorder=1,
            )
        )
        # Outlines only on boxes wide enough to show them; on thinner ones they would merge.
        groups: dict[tuple[str, bool], list[tuple[float, float]]] = defaultdict(list)
        for e in timeline.worker_events(w):
            shade = KIND_COLOURS[e.action.kind][min(rank[e.action.stage], 1)]
            outlined = e.duration * points_per_unit >= 3
            groups[shade, outlined].append(((e.start - origin) * scale, e.duration * scale))
        for (shade, outlined), spans in groups.items():
            ax.broken_barh(
                spans,
                (top, height),
                facecolors=_fade(shade) if faded else shade,
                edgecolors=_fade(EDGE) if faded else EDGE,
                linewidth=0.5 if outlined else 0.0,
                zorder=2,
            )
        if labels.mode == "none":
            continue
        for e in timeline.worker_events(w):
            text = labels.text(e)
            if _width_pt(text, labels.size) + 2 > e.duration * points_per_unit:
                continue
            ax.text(
                (e.start - origin + e.duration / 2) * scale,
                y,
                text,
                ha="center",
                va="center_baseline",
                fontsize=labels.size,
                color=FADED_TEXT if faded else TEXT,
                zorder=3,
                clip_on=True,
            )


def draw_activations(
    ax: Axes, timeline: Timeline, unit: TimeUnit, *, dashed: bool = False
) -> list[Any]:
    """Draws each stage's held micro-batches over time as a step line.

    Returns:
        The lines to name in a legend: every stage's up to 10 stages, else five
        of them spread from first to last.
    """
    lines = []
    origin, scale = timeline.start, unit.scale
    n = timeline.num_stages
    named = (
        set(range(n)) if n <= len(_STAGE_PALETTE) else {round(k * (n - 1) / 4) for k in range(5)}
    )
    for stage, points in enumerate(timeline.activations_over_time):
        if not points:
            continue
        xs = [0.0] + [(t - origin) * scale for t, _ in points]
        ys = [0] + [n for _, n in points]
        (line,) = ax.step(
            xs,
            ys,
            where="post",
            color=stage_colour(stage, n),
            linewidth=1.0 if dashed else 1.4,
            linestyle=(0, (3, 2)) if dashed else "-",
            alpha=0.8 if dashed else 1.0,
            label=f"stage {stage} (peak {timeline.peak_activations[stage]})",
        )
        if stage in named:
            lines.append(line)
    return lines


def kind_handles(kinds: set[str], *, multi: bool, labels: Labels) -> list[Any]:
    """Legend entries: F, B, W (those present), idle, and how boxes are labelled."""
    from matplotlib.patches import Patch

    split = "W" in kinds
    names = {
        "F": "F forward",
        "B": "B input gradient" if split else "B backward",
        "W": "W weight gradient",
    }
    handles: list[Any] = [
        Patch(facecolor=KIND_COLOURS[k][0], edgecolor=EDGE, linewidth=0.5, label=names[k])
        for k in "FBW"
        if k in kinds
    ]
    handles.append(
        Patch(facecolor=IDLE, edgecolor=IDLE_HATCH, hatch="////", linewidth=0, label="idle")
    )
    if multi:
        handles.append(
            Patch(
                facecolor=KIND_COLOURS["F"][1],
                edgecolor=EDGE,
                linewidth=0.5,
                label="darker: the worker's later stage",
            )
        )
    if labels.mode != "none":
        text = "stage:micro-batch" if labels.mode == "stage:mb" else "micro-batch"
        handles.append(Patch(facecolor="none", edgecolor="none", label=f"in boxes: {text}"))
    return handles
