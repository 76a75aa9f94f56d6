"""Zero-bubble schedules: backward split into B (input gradient) and W (weight gradient)."""

from __future__ import annotations

from pipesched.errors import ConfigError
from pipesched.schedule.action import BACKWARD, FORWARD, WEIGHT, Action
from pipesched.schedule.builders.argument_checks import (
    check_count,
    check_schedule_size,
    check_v_stages,
)
from pipesched.schedule.builders.one_f_one_b import one_f_one_b_row
from pipesched.schedule.limits import MAX_ACTIONS, limit_text
from pipesched.schedule.schedule import Schedule

__all__ = ["check_zb_v_work", "zb_h1", "zb_v"]


def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., 2024, "Zero Bubble Pipeline Parallelism").

    1F1B with backward split: nothing downstream waits for W, so stage ``s``
    delays its Ws by ``s`` backwards and runs them where 1F1B would wait. For
    ``m >= p`` and W no longer than F or B, the idle time per stage falls from
    1F1B's ``(p-1)(F+B+W)`` to ``(p-1)(F+B-W)``. The peak activation memory
    stays 1F1B's worst, ``p`` micro-batches, but on every stage (1F1B's stage
    ``s`` holds ``p-s``): the delayed Ws keep their inputs alive.

    Example (p=2, m=3; worker rows):
        >>> print(zb_h1(2, 3).to_csv(), end="")
        0F0,0F1,0B0,0W0,0F2,0B1,0W1,0B2,0W2
        1F0,1B0,1F1,1B1,1W0,1F2,1B2,1W1,1W2
    """
    p = check_count("num_stages", num_stages)
    m = check_count("num_microbatches", num_microbatches)
    check_schedule_size("zb-h1", p, m, 3)
    rows = tuple(tuple(one_f_one_b_row(s, p, m, weight_delay=s)) for s in range(p))
    return Schedule(rows, tuple(range(p)), m, "zb-h1")


def zb_v(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-V (Qi et al., 2024, section 6): two stages per worker, placed in a V.

    With ``p = num_stages / 2`` workers, worker ``w`` runs stages ``w`` and
    ``2p-1-w``, so the last stage sits on worker 0 next to the first and the
    loss needs no send. The order is the paper's (as in
    torch.distributed.pipelining's ScheduleZBVZeroBubble): warm-up forwards,
    a steady ``F B W`` on both stages, and Ws at the end. With equal costs
    and ``m >= 2p - 1`` the only idle time left is the unavoidable ramp (the
    first forward crossing the workers, the last backward coming back):
    ``(p-1)/(6m+p-1)``. Each worker holds at most ``p`` micro-batches of its
    whole share, 1F1B's peak. Any ``m`` runs (the order for ``2p - 1``
    micro-batches with the absent ones removed).

    Example (4 stages on 2 workers, m=1):
        >>> s = zb_v(4, 1)
        >>> s.placement
        (0, 1, 1, 0)
        >>> print(s.to_csv(), end="")
        0F0,3F0,3B0,3W0,0B0,0W0
        1F0,2F0,2B0,2W0,1B0,1W0
    """
    n = check_count("num_stages", num_stages)
    m = check_count("num_microbatches", num_microbatches)
    p = check_v_stages("zb-v", n)
    check_schedule_size("zb-v", n, m, 3)
    check_zb_v_work(n, m)
    rows = tuple(
        tuple(a for a in _zb_v_row(w, p, max(m, 2 * p - 1)) if a.microbatch < m) for w in range(p)
    )
    placement = tuple(s if s < p else n - 1 - s for s in range(n))
    return Schedule(rows, placement, m, "zb-v")


def check_zb_v_work(num_stages: int, num_microbatches: int) -> None:
    """A ConfigError when building zb-v's order would make more than MAX_ACTIONS actions.

    The order is built for ``max(m, 2p - 1)`` micro-batches and the absent
    ones removed, so with few micro-batches on many workers the work is
    ``3 x num_stages x (2p - 1)`` actions, more than the schedule keeps.
    """
    n, m = num_stages, num_microbatches
    p = n // 2
    work = 3 * n * (2 * p - 1)
    if m < 2 * p - 1 and work > MAX_ACTIONS:
        raise ConfigError(
            f"zb-v: the order for {p} workers is built for 2p - 1 = {2 * p - 1} micro-batches "
            f"(those past {m} are then removed): {2 * p - 1} micro-batches x {n} stages x 3 "
            f"kinds = {work} actions exceeds {limit_text()}; use fewer workers or another "
            "schedule"
        )


def _zb_v_row(w: int, p: int, m: int) -> list[Action]:
    """Worker ``w``'s ZB-V order for ``m >= 2p - 1`` micro-batches."""
    down, up = w, 2 * p - 1 - w  # the stage on the way down the V, and on the way up
    row: list[Action] = []
    count: dict[tuple[int, str], int] = {
        (s, k): 0 for s in (down, up) for k in (FORWARD, BACKWARD, WEIGHT)
    }

    def run(stage: int, kind: str) -> None:
        row.append(Action(stage, kind, count[stage, kind]))
        count[stage, kind] += 1

    for _ in range(2 * (p - w) - 1):
        run(down, FORWARD)
    for _ in range(w):
        run(up, FORWARD)
        run(down, FORWARD)
    for _ in range(p - w):
        run(up, FORWARD)
        run(up, BACKWARD)
        run(up, WEIGHT)
    while count[up, FORWARD] < count[down, FORWARD] or count[down, FORWARD] < m:
        if count[down, FORWARD] < m:
            run(down, FORWARD)
        run(down, BACKWARD)
        run(down, WEIGHT)
        run(up, FORWARD)
        run(up, BACKWARD)
        run(up, WEIGHT)
    for _ in range(w):
        run(down, BACKWARD)
        run(up, BACKWARD)
    for _ in range(p - w):
        run(down, BACKWARD)
        run(down, WEIGHT)
    while count[up, WEIGHT] < count[up, BACKWARD]:
        run(up, WEIGHT)
    while count[down, WEIGHT] < count[down, BACKWARD]:
        run(down, WEIGHT)
    return row
