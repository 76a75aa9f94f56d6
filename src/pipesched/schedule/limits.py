"""How large a schedule pipesched works with: one cap on actions, checked before any work.

A few characters of input (``--chunks 1000000``) can imply millions of actions, so
every entry point compares the actions it implies with :data:`MAX_ACTIONS` before it
allocates anything per stage or micro-batch.
"""

from __future__ import annotations

from typing import Final

from pipesched.errors import PipeschedError, ScheduleError

__all__ = ["MAX_ACTIONS", "check_size", "limit_text"]

MAX_ACTIONS: Final = 2_000_000
"""The most actions (F, B and W passes over all stages and micro-batches) in one schedule.

Measured on a 2-core machine: build + validate + simulate cost about 5 us
and 0.5 KB per action (0.9 s and 120 MB for zb-v at 64 workers x 512
micro-batches, 196,608 actions), so a schedule at the cap takes 15-25 s and
under 1 GB; its networkx graph (:meth:`Schedule.graph`, also built to report
a deadlock) adds about 1.1 KB and 15 us per action, 3 GB at the cap. That is
ten times the benchmark size: 1000 stages x 1000 micro-batches of 1F1B, or
256 stages x 2604 micro-batches of a zero-bubble schedule.
"""


def limit_text() -> str:
    """The limit, as the error messages state it."""
    return f"pipesched's limit of {MAX_ACTIONS} actions (pipesched.schedule.MAX_ACTIONS)"


def check_size(
    num_stages: int,
    num_microbatches: int,
    kinds: int,
    *,
    error: type[PipeschedError] = ScheduleError,
    prefix: str = "",
) -> int:
    """Checks ``num_microbatches x num_stages x kinds`` actions fit the cap; returns that count.

    Args:
        num_stages: model stages.
        num_microbatches: micro-batches per step.
        kinds: passes per stage and micro-batch: 2 (F, B) or 3 (F, B, W).
        error: raised when the count is over the cap (ConfigError for
            arguments, ScheduleError for schedules).
        prefix: leads the message, e.g. the schedule's name.

    Raises:
        PipeschedError: ``error``, stating the count and the limit.

    Example:
        >>> check_size(4, 8, 2)
        64
    """
    total = num_stages * num_microbatches * kinds
    if total > MAX_ACTIONS:
        raise error(
            f"{prefix}a schedule of {num_microbatches} micro-batches x {num_stages} stages x "
            f"{kinds} kinds = {total} actions exceeds {limit_text()}; use fewer micro-batches "
            "per step (accumulate gradients over several steps instead) or fewer stages"
        )
    return total
