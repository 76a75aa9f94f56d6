"""Schedules and timelines as text grids a person can read in a terminal."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipesched.schedule.schedule import Schedule
    from pipesched.schedule.timeline import Event, Timeline

__all__ = ["render_schedule", "render_timeline"]


def render_schedule(schedule: Schedule, *, max_columns: int = 48) -> str:
    """Each worker's actions in order, one row per worker; long rows are cut.

    Example:
        >>> from pipesched.schedule import get_schedule
        >>> print(render_schedule(get_schedule("1f1b", 2, 2)))
        1f1b: 2 stages on 2 workers, 2 micro-batches
        worker 0: 0F0 0F1 0B0 0B1
        worker 1: 1F0 1B0 1F1 1B1
    """
    s = schedule
    head = (
        f"{s.name}: {s.num_stages} stages on {s.num_workers} workers, "
        f"{s.num_microbatches} micro-batches"
    )
    width = max((len(str(a)) for row in s.actions for a in row), default=0)
    lines = [head]
    for w, row in enumerate(s.actions):
        cells = " ".join(str(a).rjust(width) for a in row[:max_columns])
        more = f" ... ({len(row) - max_columns} more)" if len(row) > max_columns else ""
        lines.append(f"worker {w}: {cells}{more}")
    return "\n".join(lines)


def render_timeline(
    timeline: Timeline, *, resolution: float | None = None, max_columns: int = 160
) -> str:
    """A time grid: a row per worker, a column per ``resolution`` time units.

    An action is labelled where it starts (``F3``: forward of micro-batch 3;
    with several stages per worker the stage leads, ``2F3``); ``--`` continues
    it, ``.`` is idle. A footer gives makespan, bubble and peak activations.

    Args:
        timeline: simulated or measured.
        resolution: time per column. When None: the largest step all start
            and end times are multiples of, so the grid is exact, unless that
            is under half the shortest action (send latencies, measured
            times); then the shortest action's duration, and an action starts
            at the first free column at or after its time.
        max_columns: columns shown before the grid is cut.

    Example:
        >>> from pipesched.schedule import get_schedule
        >>> print(render_timeline(get_schedule("gpipe", 2, 2).simulate()))
        worker 0: F0 F1  .  .  . B0 -- B1 --
        worker 1:  . F0 F1 B0 -- B1 --  .  .
        makespan 9, bubble 33.3%, peak activations per stage [2 2]
    """
    t = timeline
    events = [e for e in t.events if e.duration > 0]
    if resolution is None:
        shortest = min((e.duration for e in events), default=1.0)
        resolution = _common_step([x - t.start for e in events for x in (e.start, e.end)])
        if resolution is None or resolution < shortest / 2:
            resolution = shortest
    with_stage = max(t.placement.count(w) for w in range(t.num_workers)) > 1

    def label(e: Event) -> str:
        a = e.action
        return f"{a.stage if with_stage else ''}{a.kind}{a.microbatch}"

    width = max((len(label(e)) for e in events), default=2)
    columns = max(1, round(t.makespan / resolution))
    shown = min(columns, max_columns)
    lines = []
    for w in range(t.num_workers):
        cells = [".".rjust(width)] * shown
        free = 0  # the first column not yet drawn on
        for e in t.worker_events(w):
            first = max(free, math.floor((e.start - t.start) / resolution + 1e-9))
            free = max(first + 1, round((e.end - t.start) / resolution))
            for c in range(first, min(free, shown)):
                cells[c] = label(e).rjust(width) if c == first else "-" * width
        cut = f" ... ({columns - shown} more)" if columns > shown else ""
        lines.append(f"worker {w}: {' '.join(cells)}{cut}")
    lines.append(t.summary())
    return "\n".join(lines)


def _common_step(times: list[float]) -> float | None:
    """The largest step all ``times`` are whole multiples of, if they are simple fractions."""
    step = Fraction(0)
    for x in times:
        f = Fraction(x).limit_denominator(1000)
        if abs(float(f) - x) > 1e-9 * max(1.0, abs(x)):
            return None
        step = Fraction(
            math.gcd(step.numerator * f.denominator, f.numerator * step.denominator),
            step.denominator * f.denominator,
        )
    return float(step) if step > 0 else None
