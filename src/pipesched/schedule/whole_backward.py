"""Where a split schedule's B and W can run as one whole backward, with nothing else changed.

Most W of a zero-bubble schedule run right after their own B; there the split
buys nothing and costs what splitting costs (docs/guide.md, "Split backward").
A pair qualifies when, on its worker, W(s,i) is the action right after B(s,i);
B(s,i)'s gradient goes to no other worker (s is the first stage, or stage s-1
runs on the same worker, so B(s-1,i) could not start before W(s,i) ends); and no
other W of stage s is pending, so ``.grad`` sums in the split's order. Every
transfer then leaves when it would have: only the step's time changes.
"""

from __future__ import annotations

from pipesched.schedule.action import BACKWARD, WEIGHT
from pipesched.schedule.schedule import Schedule

__all__ = ["whole_backwards"]


def whole_backwards(schedule: Schedule) -> frozenset[tuple[int, int]]:
    """The ``(stage, microbatch)`` pairs whose B and W may run as one whole backward.

    Empty for a schedule that does not split backward.

    Example:
        >>> s = Schedule.from_lists([["0F0", "1F0", "1B0", "1W0", "0B0", "0W0"]])
        >>> sorted(whole_backwards(s.validate()))  # stage 1's gradient stays on worker 0
        [(0, 0), (1, 0)]
    """
    if not schedule.split_backward:
        return frozenset()
    placement = schedule.placement
    whole: set[tuple[int, int]] = set()
    for worker, row in enumerate(schedule.actions):
        pending: dict[int, int] = {}  # per stage: its B run so far without their W
        for k, (s, kind, i) in enumerate(row):
            if kind == WEIGHT:
                pending[s] = pending.get(s, 0) - 1
                continue
            if kind != BACKWARD:
                continue
            after = row[k + 1] if k + 1 < len(row) else None
            if (
                after is not None
                and (after.stage, after.kind, after.microbatch) == (s, WEIGHT, i)
                and (s == 0 or placement[s - 1] == worker)
                and not pending.get(s, 0)
            ):
                whole.add((s, i))
            pending[s] = pending.get(s, 0) + 1
    return frozenset(whole)
