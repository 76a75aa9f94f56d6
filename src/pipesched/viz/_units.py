"""Which unit a timeline's times are in, and how to show them."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

from pipesched.errors import ConfigError

if TYPE_CHECKING:
    from pipesched.schedule import Timeline

__all__ = ["UNITS", "TimeUnit", "time_unit"]

UNITS = ("s", "units")
"""``"s"``: times are seconds (measured runs, or plans from measured costs); ``"units"``: any."""


@dataclass(frozen=True)
class TimeUnit:
    """How times are drawn: multiplied by ``scale``, named ``label``, ``micros`` us each."""

    name: str
    scale: float
    label: str
    micros: float

    def format(self, value: float) -> str:
        """``value`` (in the timeline's own unit) as a short number with its unit."""
        shown = value * self.scale
        return f"{shown:.4g} ms" if self.name == "s" else f"{shown:.4g}"


def time_unit(timelines: list[Timeline], unit: str | None) -> TimeUnit:
    """The unit to draw ``timelines`` in.

    Args:
        timelines: the timelines of one picture; the first decides a guess.
        unit: ``"s"``, ``"units"``, or None to guess: seconds when some time
            is not a multiple of a simple fraction (as measured times never
            are), else time units.

    Raises:
        ConfigError: ``unit`` is not one of :data:`UNITS`.
    """
    if unit is None:
        unit = "s" if timelines and not _simple(timelines[0]) else "units"
    if unit == "s":
        return TimeUnit("s", 1e3, "time (ms)", 1e6)
    if unit == "units":
        # A time unit is shown as 1 ms in trace viewers, which need a real unit.
        return TimeUnit("units", 1.0, "time (time units)", 1e3)
    raise ConfigError(f"unit must be one of {list(UNITS)} or None (guess), got {unit!r}")


def _simple(timeline: Timeline) -> bool:
    """Whether every time is a fraction with a denominator up to 1000 (simulated plans' are)."""
    for e in timeline.events:
        for x in (e.start, e.end):
            f = Fraction(x).limit_denominator(1000)
            if abs(float(f) - x) > 1e-9 * max(1.0, abs(x)):
                return False
    return True
