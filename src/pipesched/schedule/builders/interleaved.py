"""Interleaved 1F1B: several non-adjacent stages per worker, depth-first."""

from __future__ import annotations

from pipesched.errors import ConfigError
from pipesched.schedule.action import BACKWARD, FORWARD, Action
from pipesched.schedule.builders._args import check_count, check_virtual_stages
from pipesched.schedule.schedule import Schedule

__all__ = ["interleaved_1f1b", "microbatches_per_round"]


def microbatches_per_round(num_workers: int, num_microbatches: int) -> int:
    """Micro-batches a worker runs on one of its stages before moving to the next stage.

    Megatron-LM uses rounds of ``p`` micro-batches and so needs ``m % p == 0``.
    Like torch.distributed.pipelining we relax this to ``max(1, m // p)`` rounds
    of equal size, which needs only that the rounds divide ``m`` (any ``m <= p``,
    any multiple of ``p``, and e.g. ``m = 10`` for ``p = 4``).

    Raises:
        ConfigError: ``m`` cannot be cut into ``max(1, m // p)`` equal rounds.
    """
    p, m = num_workers, num_microbatches
    if not _runs(p, m):
        below = next(n for n in range(m - 1, 0, -1) if _runs(p, n))
        above = next(n for n in range(m + 1, m + 2 * p) if _runs(p, n))
        raise ConfigError(
            f"interleaved-1f1b with {p} workers cannot run num_microbatches={m}: it cuts the "
            f"micro-batches into max(1, m // {p}) = {m // p} equal rounds, and {m // p} does not "
            f"divide {m}; use num_microbatches={below} or {above} (any m <= {p} or multiple of "
            f"{p} works)"
        )
    return m // max(1, m // p)


def _runs(p: int, m: int) -> bool:
    return m % max(1, m // p) == 0


def interleaved_1f1b(num_stages: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., 2021): ``v`` stages per worker, round-robin.

    ``num_stages = p * v``; stage ``s`` runs on worker ``s mod p``. Each worker
    cycles through its stages in rounds of micro-batches (see
    :func:`microbatches_per_round`), forward from its first stage, backward
    from its last. Worker ``w`` warms up with ``(v-1)*r + 2*(p-1-w)``
    forwards. The bubble shrinks to ``(p-1)/(v*m+p-1)`` at the price of ``v``
    times more sends.

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
    r = microbatches_per_round(p, m)
    rows = tuple(_worker_row(w, p, v, m, r) for w in range(p))
    return Schedule(rows, tuple(s % p for s in range(num_stages)), m, "interleaved-1f1b")


def _worker_row(w: int, p: int, v: int, m: int, r: int) -> tuple[Action, ...]:
    """Worker ``w``'s order: warm-up forwards, one forward per backward, drain."""
    total = v * m
    warmup = min((v - 1) * r + 2 * (p - 1 - w), total)
    next_mb = {FORWARD: [0] * v, BACKWARD: [0] * v}
    row: list[Action] = []

    def emit(kind: str, chunk: int) -> None:
        row.append(Action(chunk * p + w, kind, next_mb[kind][chunk]))
        next_mb[kind][chunk] += 1

    for k in range(warmup):
        emit(FORWARD, (k // r) % v)
    for k in range(total - warmup):
        emit(FORWARD, ((warmup + k) // r) % v)
        emit(BACKWARD, v - 1 - (k // r) % v)
    for k in range(total - warmup, total):
        emit(BACKWARD, v - 1 - (k // r) % v)
    return tuple(row)
