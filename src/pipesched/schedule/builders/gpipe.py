"""GPipe (fill-drain): all forwards, then all backwards."""

from __future__ import annotations

from pipesched.schedule.action import BACKWARD, FORWARD, Action
from pipesched.schedule.builders.argument_checks import check_count, check_schedule_size
from pipesched.schedule.schedule import Schedule

__all__ = ["gpipe"]


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe (Huang et al., 2019): every stage runs F for all micro-batches, then B for all.

    One stage per worker. Every stage holds all ``m`` micro-batches'
    activations at the peak; the bubble is ``(p-1)/(m+p-1)``.

    Example (p=2, m=2; worker rows):
        >>> print(gpipe(2, 2).to_csv(), end="")
        0F0,0F1,0B0,0B1
        1F0,1F1,1B0,1B1
    """
    p = check_count("num_stages", num_stages)
    m = check_count("num_microbatches", num_microbatches)
    check_schedule_size("gpipe", p, m, 2)
    rows = [
        [Action(s, FORWARD, i) for i in range(m)] + [Action(s, BACKWARD, i) for i in range(m)]
        for s in range(p)
    ]
    return Schedule(tuple(map(tuple, rows)), tuple(range(p)), m, "gpipe")
