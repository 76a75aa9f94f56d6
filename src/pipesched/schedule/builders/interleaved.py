"""Interleaved 1F1B: several non-adjacent stages per worker, depth-first."""

from __future__ import annotations

from itertools import pairwise

from pipesched.schedule.action import BACKWARD, FORWARD, Action
from pipesched.schedule.builders.argument_checks import (
    check_count,
    check_schedule_size,
    check_virtual_stages,
)
from pipesched.schedule.schedule import Schedule

__all__ = ["interleaved_1f1b", "rounds"]


def rounds(num_workers: int, num_microbatches: int) -> list[range]:
    """The micro-batches a worker runs on one stage before moving on to its next stage.

    Megatron-LM runs rounds of ``p`` micro-batches and so needs ``m % p == 0``;
    torch.distributed.pipelining relaxes this to ``max(1, m // p)`` equal
    rounds, which still rejects e.g. ``m = 9`` on 4 workers. We cut ``m`` into
    ``max(1, m // p)`` rounds whose sizes differ by at most one, larger
    first: every round has at least ``p`` micro-batches when ``m >= p``, so
    the pipeline stays full, and any ``m >= 1`` runs. Where ``m`` divides
    evenly the rounds, and so the schedule, are Megatron's and torch's.

    Example:
        >>> rounds(4, 9)
        [range(0, 5), range(5, 9)]
        >>> rounds(4, 3)
        [range(0, 3)]
    """
    n = max(1, num_microbatches // num_workers)
    size, extra = divmod(num_microbatches, n)
    bounds = [0]
    for g in range(n):
        bounds.append(bounds[-1] + size + (g < extra))
    return [range(a, b) for a, b in pairwise(bounds)]


def interleaved_1f1b(num_stages: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., 2021): ``v`` stages per worker, round-robin.

    ``num_stages = p * v``; stage ``s`` runs on worker ``s mod p``. Each worker
    cycles through its stages round by round (see :func:`rounds`), forward
    from its first stage to its last, backward from its last to its first.
    Worker ``w`` warms up with ``(v-1)*r + 2*(p-1-w)`` forwards (``r``: the
    first round's size), then alternates one forward with one backward. For
    ``m >= p`` the bubble shrinks to ``(p-1)/(v*m+p-1)``, at the price of
    ``v`` times more sends and more held activations than 1F1B.

    Example (4 stages on 2 workers, m=2):
        >>> s = interleaved_1f1b(4, 2)
        >>> s.placement
        (0, 1, 0, 1)
        >>> print(s.to_csv(), end="")
        0F0,0F1,2F0,2F1,2B0,2B1,0B0,0B1
        1F0,1F1,3F0,3B0,3F1,3B1,1B0,1B1
    """
    num_stages = check_count("num_stages", num_stages)
    m = check_count("num_microbatches", num_microbatches)
    v = check_count("virtual_stages", virtual_stages)
    p = check_virtual_stages("interleaved-1f1b", num_stages, v)
    check_schedule_size("interleaved-1f1b", num_stages, m, 2)
    cut = rounds(p, m)
    forward = [(c, i) for rnd in cut for c in range(v) for i in rnd]
    backward = [(v - 1 - c, i) for rnd in cut for c in range(v) for i in rnd]
    rows = []
    for w in range(p):
        warmup = min((v - 1) * len(cut[0]) + 2 * (p - 1 - w), v * m)
        steps = [(FORWARD, forward[k]) for k in range(warmup)]
        for k in range(v * m - warmup):
            steps += [(FORWARD, forward[warmup + k]), (BACKWARD, backward[k])]
        steps += [(BACKWARD, backward[k]) for k in range(v * m - warmup, v * m)]
        rows.append(tuple(Action(c * p + w, kind, i) for kind, (c, i) in steps))
    return Schedule(tuple(rows), tuple(s % p for s in range(num_stages)), m, "interleaved-1f1b")
