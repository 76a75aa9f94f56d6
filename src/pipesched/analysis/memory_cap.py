"""A memory limit for synthesis and bounds: what each worker may hold, what a micro-batch takes.

Either in micro-batches of a worker's whole share (``memory_limit=p`` is 1F1B's
peak), or in bytes with ``stage_memory`` per stage: a language model's head holds
its logits, many times a block's activations, so one slot per micro-batch would
waste the budget or overrun it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pipesched.errors import ConfigError, ConfigTypeError

__all__ = ["QUANTUM", "MemoryCap", "memory_cap", "memory_slots"]

QUANTUM = 1000
"""With ``stage_memory`` not all whole numbers, the synthesizer counts in units of the largest
stage's size / QUANTUM (whole numbers, as bytes are, it counts as they are)."""


@dataclass(frozen=True)
class MemoryCap:
    """Per worker, the most it may hold; per stage, what one micro-batch holds (one unit).

    Args:
        capacity: per worker.
        sizes: per stage.
        in_bytes: whether the units are the user's (``stage_memory`` given)
            rather than slots of ``1 / stages_per_worker`` share.
        num_microbatches: micro-batches per step (a limit above them all
            does not bind).
    """

    capacity: tuple[float, ...]
    sizes: tuple[float, ...]
    in_bytes: bool
    num_microbatches: int

    def slots(self) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """Integer (capacity per worker, size per stage) for the synthesizer, rounded safely.

        Whole-number sizes are kept; others are counted in units of the
        largest / :data:`QUANTUM`.
        Sizes round up and capacities down, so an order within the integer
        cap is within the real one. Without bytes the values are integers
        already and sizes are None (1 each).

        Raises:
            ConfigError: a worker's limit is within that rounding of one
                micro-batch of its share (the message gives the least that
                works).
        """
        if not self.in_bytes:
            return tuple(int(c) for c in self.capacity), None
        largest = max(self.sizes)
        if largest <= 0:  # nothing held anywhere: no cap
            return tuple(0 for _ in self.capacity), tuple(0 for _ in self.sizes)
        exact = all(float(s).is_integer() for s in self.sizes)  # bytes: counted as they are
        unit = 1.0 if exact else largest / QUANTUM
        sizes = tuple(math.ceil(s / unit) for s in self.sizes)
        p = len(self.capacity)
        capacity = []
        for w, limit in enumerate(self.capacity):
            mine = [w] if len(sizes) == p else [w, 2 * p - 1 - w]
            share = sum(sizes[s] for s in mine)
            if limit >= self.num_microbatches * sum(self.sizes[s] for s in mine):
                capacity.append(self.num_microbatches * share)  # never binds: hold them all
                continue
            capacity.append(math.floor(limit / unit))
            if capacity[-1] < share:
                raise ConfigError(
                    f"memory_limit={self.capacity[w]!r} for worker {w} is within rounding "
                    f"of one micro-batch of its stages; the synthesizer needs "
                    f"{share * unit:.6g} (it counts in units of the largest stage_memory / "
                    f"{QUANTUM}); raise the limit that much"
                )
        return tuple(capacity), sizes


def memory_cap(
    memory_limit: float | Sequence[float] | None,
    stage_memory: Sequence[float] | None,
    placement: tuple[int, ...],
    m: int,
) -> MemoryCap | None:
    """Resolves ``memory_limit`` (and ``stage_memory``) for this placement; None: no limit.

    Raises:
        ConfigTypeError: a limit or size that is not a number.
        ConfigError: a wrong count, a negative or NaN value, or a worker's
            limit below one micro-batch of its whole share (the least any
            order can hold: each stage holds its micro-batch from F to W,
            and on a V the turn holds both of a worker's stages).
    """
    p, n = max(placement) + 1, len(placement)
    v = n // p
    if stage_memory is not None:
        stage_memory = _numbers("stage_memory", stage_memory, n, "one per stage")
        if any(x < 0 or math.isinf(x) for x in stage_memory):
            raise ConfigError(f"stage_memory must be finite and >= 0, got {list(stage_memory)}")
    if memory_limit is None:
        return None
    if isinstance(memory_limit, Sequence) and not isinstance(memory_limit, str):
        limits = _numbers("memory_limit", memory_limit, p, "one per worker")
    else:
        limits = _numbers("memory_limit", [memory_limit], 1, "a number")
        limits = limits * p
    if stage_memory is None:
        return MemoryCap(tuple(float(memory_slots(x, v, m)) for x in limits), (1.0,) * n, False, m)
    for w, limit in enumerate(limits):
        least = sum(stage_memory[s] for s in range(n) if placement[s] == w)
        if not limit >= least:
            raise ConfigError(
                f"memory_limit={limit!r} for worker {w} is below the minimum feasible, "
                f"{least!r} (one micro-batch of each of its stages, stage_memory): each stage "
                "holds a micro-batch from its F to its W, and on a V the turn holds both of "
                "a worker's stages; raise the limit or give None"
            )
    return MemoryCap(tuple(limits), tuple(stage_memory), True, m)


def _numbers(name: str, values: Sequence[object], count: int, what: str) -> list[float]:
    """``values`` as floats, checked for type, NaN and count."""
    if len(values) != count:
        raise ConfigError(f"{name} has {len(values)} entries; give {what} ({count})")
    out = []
    for x in values:
        if isinstance(x, bool) or not isinstance(x, int | float):
            raise ConfigTypeError(
                f"{name} must be a number or a list of numbers (or None), got {x!r}"
            )
        if math.isnan(x):
            raise ConfigError(f"{name} is NaN (or holds one); give numbers >= 0, or None")
        out.append(x)
    return out


def memory_slots(memory_limit: object, stages_per_worker: int, m: int) -> int:
    """A limit in micro-batches of a whole share as stage-micro-batch slots; below 1 refused.

    Example:
        >>> memory_slots(4, 2, 8), memory_slots(None, 1, 8), memory_slots(1.5, 2, 8)
        (8, 8, 3)
    """
    if memory_limit is None:
        return stages_per_worker * m
    if isinstance(memory_limit, bool) or not isinstance(memory_limit, int | float):
        raise ConfigTypeError(
            f"memory_limit must be a number of micro-batches or None, got {memory_limit!r}"
        )
    if math.isnan(memory_limit):
        raise ConfigError("memory_limit is NaN; give a number of micro-batches >= 1, or None")
    if math.isinf(memory_limit):
        return stages_per_worker * m
    if memory_limit < 1:
        raise ConfigError(
            f"memory_limit={memory_limit!r} is below the minimum feasible, 1 micro-batch per "
            "worker: each stage holds a micro-batch from its F to its W, and on a V the "
            "turn holds both of a worker's stages; use memory_limit >= 1 or None"
        )
    return min(stages_per_worker * m, int(memory_limit * stages_per_worker + 1e-9))
