"""1F1B (PipeDream-flush): a warm-up of forwards, then one forward per backward."""

from __future__ import annotations

from pipesched.schedule.action import BACKWARD, FORWARD, WEIGHT, Action
from pipesched.schedule.builders.argument_checks import check_count, check_schedule_size
from pipesched.schedule.schedule import Schedule

__all__ = ["one_f_one_b", "one_f_one_b_row"]


def one_f_one_b_row(
    stage: int, num_stages: int, num_microbatches: int, *, weight_delay: int | None = None
) -> list[Action]:
    """One stage's 1F1B order; with ``weight_delay``, backward split into B then W.

    Stage ``s`` warms up with ``min(p-1-s, m)`` forwards, then alternates one
    forward with one backward, then drains the remaining backwards. With
    ``weight_delay = d``, the W of the k-th backward runs right after the
    (k+d)-th B, and the last ``d`` Ws after the final B: delayed Ws fill the
    time a stage would otherwise wait for a gradient.
    """
    s, p, m = stage, num_stages, num_microbatches
    warmup = min(p - 1 - s, m)
    row = [Action(s, FORWARD, i) for i in range(warmup)]
    weights_done = 0

    def backward(k: int) -> None:
        nonlocal weights_done
        row.append(Action(s, BACKWARD, k))
        if weight_delay is not None and k >= weight_delay:
            row.append(Action(s, WEIGHT, weights_done))
            weights_done += 1

    for k in range(m - warmup):
        row.append(Action(s, FORWARD, warmup + k))
        backward(k)
    for k in range(m - warmup, m):
        backward(k)
    if weight_delay is not None:
        row += [Action(s, WEIGHT, i) for i in range(weights_done, m)]
    return row


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush, Narayanan et al., 2021).

    One stage per worker. Same bubble as GPipe, ``(p-1)/(m+p-1)``, but stage
    ``s`` holds at most ``min(p-s, m)`` micro-batches' activations instead of
    ``m``. With ``m < p`` the warm-up shortens and the schedule still runs.

    Example (p=2, m=3; worker rows):
        >>> print(one_f_one_b(2, 3).to_csv(), end="")
        0F0,0F1,0B0,0F2,0B1,0B2
        1F0,1B0,1F1,1B1,1F2,1B2
    """
    p = check_count("num_stages", num_stages)
    m = check_count("num_microbatches", num_microbatches)
    check_schedule_size("1f1b", p, m, 2)
    rows = tuple(tuple(one_f_one_b_row(s, p, m)) for s in range(p))
    return Schedule(rows, tuple(range(p)), m, "1f1b")
