"""Figure plumbing shared by the pictures: layout in inches, row names, saving PNG or SVG.

Axes are placed at fixed inches rather than by a layout engine, so the width
of a box in points is known before drawing and labels go only where they fit.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipesched.errors import ConfigError
from pipesched.schedule import Timeline

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "BOTTOM",
    "DPI",
    "LEFT",
    "LEGEND",
    "RIGHT",
    "STYLE",
    "SUFFIXES",
    "TITLE",
    "WIDTH",
    "FigureLayout",
    "Row",
    "check_path",
    "matplotlib_module",
    "multi_stage",
    "rows_of",
    "save",
    "some",
    "style_rows",
]

SUFFIXES = (".png", ".svg")
WIDTH, LEFT, RIGHT, BOTTOM, TITLE, LEGEND = 10.0, 1.05, 1.4, 0.5, 0.62, 0.3
"""Figure width and margins, in inches."""
DPI = 110
STYLE = {
    "font.size": 8,
    "svg.fonttype": "none",
    "svg.hashsalt": "pipesched",
    "hatch.linewidth": 0.6,
}
"""matplotlib settings while drawing: SVG text stays text, SVG ids are reproducible."""


@dataclass(frozen=True)
class FigureLayout:
    """Axes placed in inches from the figure's top, so box sizes in points are known."""

    height: float

    def axes(self, figure: Figure, top: float, height: float, **kwargs: Any) -> Axes:
        """New axes ``height`` inches tall, ``top`` inches below the figure's top, full width."""
        rect = (
            LEFT / WIDTH,
            1 - (top + height) / self.height,
            (WIDTH - LEFT - RIGHT) / WIDTH,
            height / self.height,
        )
        return figure.add_axes(rect, **kwargs)

    def title(self, figure: Figure, lines: list[str]) -> None:
        """The title at the top left: the first line bold, the others below it."""
        for k, line in enumerate(lines):
            figure.text(
                LEFT / WIDTH,
                1 - (0.12 + 0.22 * k) / self.height,
                line,
                va="top",
                fontsize=10 if k == 0 else 8.5,
                weight="bold" if k == 0 else "normal",
            )

    def legend(self, figure: Figure, handles: list[Any], top: float) -> None:
        """One row of legend entries, ``top`` inches below the figure's top."""
        figure.legend(
            handles=handles,
            loc="upper left",
            bbox_to_anchor=(LEFT / WIDTH - 0.008, 1 - top / self.height),
            ncol=len(handles),
            frameon=False,
            fontsize=7.5,
            handlelength=1.3,
            handletextpad=0.4,
            columnspacing=1.1,
            borderaxespad=0,
            borderpad=0,
        )


@dataclass(frozen=True)
class Row:
    """One row of boxes: where it is, what it is called, and its idle share."""

    worker: int
    y: float
    name: str
    idle: float


def rows_of(
    timeline: Timeline, ys: dict[int, float], row_pt: float, plan: bool = False
) -> list[Row]:
    """The rows of ``timeline``'s workers at ``ys``, named; ``plan`` rows are named "plan"."""
    rows = []
    for w, y in ys.items():
        name = "plan" if plan else f"worker {w}"
        stages = ", ".join(str(s) for s, p in enumerate(timeline.placement) if p == w)
        if multi_stage(timeline) and not plan:
            name += f"\nstages {stages}" if row_pt >= 20 else f" ({stages})"
        rows.append(Row(w, y, name, timeline.idle[w] / (timeline.makespan or 1.0)))
    return rows


def some(values: Sequence[float]) -> str:
    """``values`` for a title: all of up to 16, else the first 8 and the last 4."""
    shown = [f"{x:g}" for x in values]
    return " ".join(shown if len(shown) <= 16 else [*shown[:8], "...", *shown[-4:]])


def style_rows(ax: Axes, rows: list[Row], row_pt: float, *, show_x: bool) -> None:
    """Row names at the left, idle shares at the right; every k-th worker's where rows are thin."""
    from matplotlib.transforms import blended_transform_factory

    size = min(7.5, 0.8 * row_pt)
    every = max(1, math.ceil(8 / row_pt))
    last = max((r.worker for r in rows), default=0)
    shown = [r for r in rows if r.worker % every == 0 or r.worker == last]
    ax.set_yticks([r.y for r in shown], [r.name for r in shown])
    ax.tick_params(axis="y", length=0, labelsize=size)
    ax.tick_params(axis="x", labelsize=7.5, labelbottom=show_x)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    right = blended_transform_factory(ax.transAxes, ax.transData)
    for r in shown:
        ax.text(
            1.008,
            r.y,
            f"idle {r.idle:.0%}",
            transform=right,
            va="center",
            fontsize=size,
            color="#555",
        )


def multi_stage(timeline: Timeline) -> bool:
    """Whether some worker runs several stages."""
    return timeline.num_stages > timeline.num_workers


def check_path(path: str | Path) -> Path:
    """``path`` as a Path, checked before anything is drawn.

    Raises:
        ConfigError: the suffix is not one of :data:`SUFFIXES`.
    """
    path = Path(path)
    if path.suffix.lower() not in SUFFIXES:
        raise ConfigError(
            f"path {str(path)!r} must end in {' or '.join(SUFFIXES)} (the picture's format); "
            f"e.g. {path.with_suffix('.png').name!r}"
        )
    return path


def matplotlib_module() -> Any:
    """matplotlib, imported now.

    Raises:
        ModuleNotFoundError: it is not installed; the message says how to install it.
    """
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "pipesched.viz draws with matplotlib, which is not installed; "
            "pip install 'pipesched[viz]' (or pip install matplotlib)",
            name="matplotlib",
        ) from None
    return matplotlib


def save(figure: Figure, path: Path) -> Path:
    """Writes ``figure``; a PNG is cut to 128 colours (flat boxes need no more), 1/3 the size."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)  # Agg renders off-screen; SVG switches canvas when saving
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".svg":
        figure.savefig(path, format="svg", metadata={"Date": None})
        return path
    from PIL import Image

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    with Image.open(buffer) as image:
        no_dither = getattr(Image, "Dither", Image).NONE
        palette = image.convert("RGB").quantize(128, method=0, dither=no_dither)  # median cut
        palette.save(path, format="PNG", optimize=True)
    return path
