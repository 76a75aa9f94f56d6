"""DualPipeV: DeepSeek's DualPipe folded onto a V, as torch.distributed.pipelining orders it.

Why it departs from the original: our runtimes run one action at a time per worker,
so an overlapped chunk becomes its forward then its backward, in torch's order; a
full backward is our ``B`` followed at once by its ``W``.
"""

from __future__ import annotations

from collections import deque

from pipesched.schedule.action import BACKWARD, FORWARD, WEIGHT, Action
from pipesched.schedule.builders.argument_checks import (
    check_count,
    check_padded_work,
    check_schedule_size,
    check_v_stages,
)
from pipesched.schedule.schedule import Schedule

__all__ = ["dualpipe_v"]


def dualpipe_v(num_stages: int, num_microbatches: int) -> Schedule:
    """DualPipeV (DeepSeek-V3 report, 2024; torch's ScheduleDualPipeV): a V with F&B overlap.

    With ``p = num_stages / 2`` workers, worker ``w`` runs stages ``w`` and
    ``2p-1-w`` (the V of ZB-V). Worker ``w``'s order, as torch builds it
    (``down``/``up``: its stage on the way down and up the V; "F&B" an
    overlapped chunk, run as F then B then W):

    1. ``2(p-1-w)`` forwards of ``down``;
    2. ``w+1`` pairs: forward ``down``, forward ``up``;
    3. ``p-1-w`` times: B and W of ``up``, forward ``up``;
    4. ``m-2p+w+1`` times: F ``down`` & B ``up``, then F ``up`` & B ``down``;
    5. ``p-1-w`` times: B ``up``, then F ``up`` & B ``down``;
    6. ``w+1`` pairs: B ``up``, B ``down`` (the second half with W deferred);
    7. ``p-1-w`` times: a deferred W, B ``down``;
    8. the deferred Ws.

    Each worker holds up to ``2p + 1`` stage micro-batches (``p + 1/2`` whole
    shares), half a share more than ZB-V. With equal costs and ``m >= 2p``
    each worker idles ``p - 1`` stage passes, as in ZB-V, so the makespan is
    ZB-V's (though worker ``w`` waits ``p-1-w`` of them between its first and
    last action, where ZB-V waits at the end). torch needs ``m >= 2p``; here any ``m`` runs
    (the order for ``2p`` micro-batches with the absent ones removed).

    Example (4 stages on 2 workers, m=4; worker rows):
        >>> s = dualpipe_v(4, 4)
        >>> s.placement
        (0, 1, 1, 0)
        >>> print(s.to_csv(), end="")
        0F0,0F1,0F2,3F0,3B0,3W0,3F1,0F3,3B1,3W1,3F2,0B0,0W0,3B2,3W2,3F3,0B1,0W1,3B3,3W3,0B2,0W2,0B3,0W3
        1F0,2F0,1F1,2F1,1F2,2B0,2W0,2F2,1B0,1W0,1F3,2B1,2W1,2F3,1B1,1W1,2B2,2W2,1B2,1W2,2B3,1B3,2W3,1W3
    """
    n = check_count("num_stages", num_stages)
    m = check_count("num_microbatches", num_microbatches)
    p = check_v_stages("dualpipev", n)
    check_schedule_size("dualpipev", n, m, 3)
    check_padded_work("dualpipev", n, m, 2 * p)
    rows = tuple(
        tuple(a for a in _dualpipe_v_row(w, p, max(m, 2 * p)) if a.microbatch < m) for w in range(p)
    )
    placement = tuple(s if s < p else n - 1 - s for s in range(n))
    return Schedule(rows, placement, m, "dualpipev")


def _dualpipe_v_row(w: int, p: int, m: int) -> list[Action]:
    """Worker ``w``'s order for ``m >= 2p`` micro-batches: torch's eight steps."""
    down, up = w, 2 * p - 1 - w
    row: list[Action] = []
    count = {(s, k): 0 for s in (down, up) for k in (FORWARD, BACKWARD)}
    deferred: deque[Action] = deque()  # Ws of backwards run as input-gradient only

    def forward(stage: int) -> None:
        row.append(Action(stage, FORWARD, count[stage, FORWARD]))
        count[stage, FORWARD] += 1

    def backward(stage: int, *, defer_weight: bool = False) -> None:
        i = count[stage, BACKWARD]
        count[stage, BACKWARD] += 1
        row.append(Action(stage, BACKWARD, i))
        if defer_weight:
            deferred.append(Action(stage, WEIGHT, i))
        else:
            row.append(Action(stage, WEIGHT, i))

    def overlapped(forward_stage: int, backward_stage: int) -> None:
        forward(forward_stage)
        backward(backward_stage)

    def pending_weight() -> None:
        if deferred:
            row.append(deferred.popleft())

    for _ in range(2 * (p - 1 - w)):  # 1: F down
        forward(down)
    for _ in range(w + 1):  # 2: F down, F up
        forward(down)
        forward(up)
    for _ in range(p - 1 - w):  # 3: B up with its W at once, F up
        backward(up, defer_weight=True)
        pending_weight()
        forward(up)
    for _ in range(m - 2 * p + w + 1):  # 4: F down & B up, F up & B down
        # torch runs the first F down, B up of the last worker unfused: the same actions here.
        overlapped(down, up)
        overlapped(up, down)
    for _ in range(p - 1 - w):  # 5: B up, F up & B down
        backward(up)
        overlapped(up, down)
    split = False  # 6: B up, B down; the second half defers its Ws
    for i in range(w + 1):
        if i == (w + 1) // 2 and w % 2 == 1:
            split = True
        backward(up, defer_weight=split)
        if i == (w + 1) // 2 and w % 2 == 0:
            split = True
        backward(down, defer_weight=split)
    for _ in range(p - 1 - w):  # 7: a deferred W, B down
        pending_weight()
        backward(down, defer_weight=split)
    for _ in range(w + 1):  # 8: the deferred Ws
        pending_weight()
    row.extend(deferred)  # none are left when m >= 2p; kept so that no W can be lost
    return row
