"""Choosing contiguous cut points: min-max by dynamic programming, or by simulating the schedule.

Pure Python over per-layer numbers (no torch). Why two searches: where a stage's
cost does not depend on the others, dynamic programming finds the min-max cuts
exactly; but a step is not its largest stage (F and B weigh differently, memory
held depends on the schedule), so :func:`search_schedule` scores cuts by the
schedule's own simulator, exhaustively or by hill climbing.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipesched.errors import PartitionError
from pipesched.schedule import Costs, Schedule, Timeline

__all__ = [
    "EXHAUSTIVE_LIMIT",
    "StageCost",
    "bounds_of",
    "check_cuttable",
    "min_max_counts",
    "search_schedule",
    "simulate_counts",
]

EXHAUSTIVE_LIMIT = 3000
"""At most this many ways to cut: :func:`search_schedule` simulates every one."""

StageCost = Callable[[int, int, int], float]
"""``cost(k, i, j)``: the cost of stage ``k`` holding layers ``i`` to ``j - 1``."""

PassCosts = Callable[[int, int, int], tuple[float, float, float]]
"""``costs(k, i, j)``: (forward seconds, backward seconds, memory bytes per held
micro-batch) of stage ``k`` holding layers ``i`` to ``j - 1``."""

Overlap = Callable[[Sequence[tuple[int, int]]], float]
"""Bytes a worker's summed stage memory counts twice, from its stages' ``[i, j)`` layer ranges."""


@dataclass(frozen=True)
class Scored:
    """Cut points and what the simulator makes of them.

    Args:
        counts: layers per stage.
        timeline: the simulated step.
        peak_memory: per worker, the largest memory the estimate gives.
    """

    counts: tuple[int, ...]
    timeline: Timeline
    peak_memory: tuple[float, ...]


def check_cuttable(num_layers: int, num_stages: int, what: str = "layers") -> None:
    """Raises PartitionError unless ``num_layers`` can form ``num_stages`` non-empty stages."""
    if not 1 <= num_stages <= num_layers:
        raise PartitionError(
            f"cannot cut {num_layers} {what} into {num_stages} stages: {num_layers} {what} "
            f"have {num_layers - 1} cut points between them, and {num_stages} stages need "
            f"{num_stages - 1}; use between 1 and {num_layers} stages, or a model (or "
            "split_points=) with more layers"
        )


def bounds_of(counts: Sequence[int]) -> list[int]:
    """``[0, c0, c0 + c1, ..., n]``: where each stage starts, and the end.

    Example:
        >>> bounds_of([2, 3, 1])
        [0, 2, 5, 6]
    """
    return list(itertools.accumulate(counts, initial=0))


def min_max_counts(num_layers: int, num_stages: int, cost: StageCost) -> list[int]:
    """Contiguous layer counts minimizing the largest ``cost(k, i, j)``; exact.

    Dynamic programming over cut points, ``O(n^2 p)`` calls of ``cost``;
    ties go to the earliest cut. A cost of ``math.inf`` forbids a stage.

    Raises:
        PartitionError: more stages than layers, or every way to cut has an
            infinite cost.

    Example:
        >>> sizes = [5, 1, 1, 1, 5]
        >>> min_max_counts(5, 2, lambda k, i, j: sum(sizes[i:j]))
        [2, 3]
    """
    n, p = num_layers, num_stages
    check_cuttable(n, p)
    inf = math.inf
    # best[k][i]: the smallest possible largest stage when the first i layers form k stages.
    best = [[inf] * (n + 1) for _ in range(p + 1)]
    cut = [[0] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for k in range(1, p + 1):
        for i in range(k, n - (p - k) + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] == inf:
                    continue
                value = max(best[k - 1][j], cost(k - 1, j, i))
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    if best[p][n] == inf:
        raise PartitionError(
            f"no way to cut {n} layers into {p} stages keeps every stage within the limit; "
            "raise memory_budget or use more stages"
        )
    counts, i = [], n
    for k in range(p, 0, -1):
        counts.append(i - cut[k][i])
        i = cut[k][i]
    return counts[::-1]


def simulate_counts(
    schedule: Schedule,
    counts: Sequence[int],
    costs: PassCosts,
    fixed_memory: StageCost,
    overlap: Overlap | None = None,
) -> Scored:
    """Simulates ``schedule`` with the stages ``counts`` cut out.

    Backward is split evenly into B and W for schedules that split it. Memory
    per worker: the sum over its stages of ``fixed_memory(k, i, j)`` plus the
    bytes per micro-batch times the micro-batches the stage holds at its peak,
    less ``overlap`` of its stages' layer ranges (what the sum counts twice).
    """
    bounds = bounds_of(counts)
    passes = [costs(k, bounds[k], bounds[k + 1]) for k in range(len(counts))]
    timeline = schedule.simulate(
        Costs(
            forward=[f for f, _, _ in passes],
            backward=[b / 2 for _, b, _ in passes],
            weight=[b / 2 for _, b, _ in passes],
        )
    )
    memory = [0.0] * schedule.num_workers
    for k, (_, _, per_microbatch) in enumerate(passes):
        held = timeline.peak_activations[k] * per_microbatch
        memory[schedule.placement[k]] += fixed_memory(k, bounds[k], bounds[k + 1]) + held
    if overlap is not None:
        for w in range(schedule.num_workers):
            spans = [(bounds[k], bounds[k + 1]) for k in schedule.stages_of(w)]
            memory[w] -= overlap(spans)
    return Scored(tuple(counts), timeline, tuple(memory))


def search_schedule(
    schedule: Schedule,
    num_layers: int,
    costs: PassCosts,
    fixed_memory: StageCost,
    *,
    start: Sequence[int],
    memory_budget: float | None = None,
    overlap: Overlap | None = None,
) -> Scored:
    """The cut points with the smallest simulated makespan within the memory budget.

    Args:
        schedule: the schedule to simulate (its ``num_stages`` stages).
        num_layers: layers to cut.
        costs: per stage, (forward, backward, bytes per held micro-batch).
        fixed_memory: per stage, bytes held whatever the micro-batches
            (parameters and gradients).
        start: cut points to climb from when there are too many to try all.
        memory_budget: bytes per worker; None: no limit.
        overlap: bytes a worker's summed ``fixed_memory`` counts twice, from
            its stages' layer ranges (a parameter its layers share).

    Raises:
        PartitionError: no cut points fit the budget; the message gives the
            smallest peak memory seen.
    """
    p = schedule.num_stages
    check_cuttable(num_layers, p)
    budget = math.inf if memory_budget is None else memory_budget
    best: Scored | None = None
    lowest = math.inf

    def better(candidate: Scored) -> bool:
        nonlocal best, lowest
        lowest = min(lowest, max(candidate.peak_memory))
        if max(candidate.peak_memory) > budget:
            return False
        if best is None or candidate.timeline.makespan < best.timeline.makespan:
            best = candidate
            return True
        return False

    if math.comb(num_layers - 1, p - 1) <= EXHAUSTIVE_LIMIT:
        for cuts in itertools.combinations(range(1, num_layers), p - 1):
            counts = [b - a for a, b in itertools.pairwise([0, *cuts, num_layers])]
            better(simulate_counts(schedule, counts, costs, fixed_memory, overlap))
    else:
        current = list(start)
        better(simulate_counts(schedule, current, costs, fixed_memory, overlap))
        improved = True
        while improved:
            improved = False
            for neighbour in _neighbours(current):
                if better(simulate_counts(schedule, neighbour, costs, fixed_memory, overlap)):
                    current, improved = neighbour, True
                    break
    if best is None:
        raise PartitionError(
            f"no way to cut {num_layers} layers into {p} stages fits memory_budget="
            f"{memory_budget:.4g} bytes per worker (the smallest peak found is "
            f"{lowest:.4g} bytes); raise the budget, use more stages, or checkpoint"
        )
    return best


def _neighbours(counts: list[int]) -> list[list[int]]:
    """Cut points one layer away: one cut moved left or right, stages kept non-empty."""
    result = []
    for k in range(len(counts) - 1):
        for delta in (-1, 1):
            moved = list(counts)
            moved[k] += delta
            moved[k + 1] -= delta
            if moved[k] >= 1 and moved[k + 1] >= 1:
                result.append(moved)
    return result
