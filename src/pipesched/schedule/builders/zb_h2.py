"""ZB-H2: zero bubble with relaxed memory, up to ``2p - 1`` micro-batches in flight per stage."""

from __future__ import annotations

from pipesched.schedule.action import BACKWARD, FORWARD, WEIGHT, Action
from pipesched.schedule.builders.argument_checks import check_count, check_schedule_size
from pipesched.schedule.schedule import Schedule

__all__ = ["zb_h2"]


def zb_h2(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H2 (Qi et al., 2024, "Zero Bubble Pipeline Parallelism", section 3).

    One stage per worker. ZB-H1 keeps 1F1B's memory; ZB-H2 lets each stage
    hold up to ``2p - 1`` micro-batches (forwards run, Ws not yet run), so
    the warm-up runs more forwards, the gap before the first B is filled, and
    the Ws pile up and run at the tail while the last backwards travel up
    the pipeline.

    The order is what a list scheduler gives at unit costs, tick by tick:
    each stage runs, of the passes whose input has arrived, its next B first
    (it unblocks the stage above), else its next F while fewer than ``2p - 1``
    micro-batches are in flight, else its oldest pending W. With
    ``F = B = W`` each stage then works without a gap from its first action
    to its last: its only idle time is the ramp, ``s`` forwards at the start
    and ``p - 1 - s`` at the end, so the makespan is ``3m + p - 1`` and the
    bubble ``(p-1)/(3m+p-1)`` for ``m >= p``. The paper counts the bubble
    with the optimizer step post-validated, i.e. within each stage's span
    from its first to its last action, and that is 0 here (ZB-H1 idles as
    long at equal costs, but inside its span; with B longer than F, ZB-H2
    is also faster). The price: every stage peaks at ``min(2p - 1, m)``
    micro-batches, against ZB-H1's ``p``.

    Example (p=2, m=3; worker rows):
        >>> print(zb_h2(2, 3).to_csv(), end="")
        0F0,0F1,0F2,0B0,0W0,0B1,0W1,0B2,0W2
        1F0,1B0,1F1,1B1,1F2,1B2,1W0,1W1,1W2
    """
    p = check_count("num_stages", num_stages)
    m = check_count("num_microbatches", num_microbatches)
    check_schedule_size("zb-h2", p, m, 3)
    rows = _list_schedule(p, m, limit=2 * p - 1)
    return Schedule(tuple(map(tuple, rows)), tuple(range(p)), m, "zb-h2")


def _list_schedule(p: int, m: int, *, limit: int) -> list[list[Action]]:
    """Each stage's order when every pass takes one tick: B, else F (under ``limit``), else W."""
    finished: dict[tuple[int, str, int], int] = {}  # action -> the tick it ends
    ran = [{FORWARD: 0, BACKWARD: 0, WEIGHT: 0} for _ in range(p)]
    rows: list[list[Action]] = [[] for _ in range(p)]
    never = 3 * m + 2 * p  # later than any tick: the pass has not run

    def ready(s: int, kind: str, i: int, tick: int) -> bool:
        if kind == FORWARD:
            need = (s - 1, FORWARD, i) if s else None
            if ran[s][FORWARD] - ran[s][WEIGHT] >= limit:
                return False
        elif kind == BACKWARD:
            need = (s + 1, BACKWARD, i) if s < p - 1 else (s, FORWARD, i)
        else:
            need = (s, BACKWARD, i)
        return need is None or finished.get(need, never) <= tick

    tick = 0
    while any(count[WEIGHT] < m for count in ran):
        for s in range(p):  # a pass that ends at this tick is seen from the next one
            for kind in (BACKWARD, FORWARD, WEIGHT):
                i = ran[s][kind]
                if i < m and ready(s, kind, i, tick):
                    rows[s].append(Action(s, kind, i))
                    finished[s, kind, i] = tick + 1
                    ran[s][kind] += 1
                    break
        tick += 1
    return rows
