"""The exact synthesis model for OR-Tools CP-SAT (the optional ``solver`` extra).

Actions are intervals; a worker's do not overlap, each starts after its data
predecessor plus the send latency, and a stage's hold of a micro-batch (start of
F to end of W) takes slots of its worker's memory. Durations are scaled to
integers by :data:`SCALE`; the returned order is replayed with the exact costs.
Why CP-SAT, not an ILP: no-overlap and cumulative constraints are native to it.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Any

from pipesched.analysis.heuristic import Player, Problem, Rows
from pipesched.errors import MissingDependencyError

__all__ = ["SCALE", "ExactResult", "available", "solve"]

SCALE = 1000
"""Durations are multiplied by this and rounded to integers for the solver."""


@dataclass(frozen=True)
class ExactResult:
    """The solver's order, whether it proved it optimal, and its (scaled) objective bound."""

    rows: Rows
    optimal: bool
    makespan: float
    bound: float


def available() -> bool:
    """Whether OR-Tools is installed (``pip install pipesched[solver]``)."""
    return importlib.util.find_spec("ortools") is not None


def solve(
    problem: Problem, *, time_limit: float = 10.0, hint: Rows | None = None, workers: int = 2
) -> ExactResult | None:
    """Solves ``problem`` with CP-SAT; None when it finds no schedule within ``time_limit``.

    Args:
        problem: sizes, placement, durations and memory slots.
        time_limit: seconds CP-SAT may search.
        hint: an order to start from (e.g. the heuristic's), as a solution hint.
        workers: CP-SAT search threads.

    Raises:
        MissingDependencyError: OR-Tools is not installed (an ImportError).
    """
    try:
        from ortools.sat.python import cp_model
    except ImportError as error:
        raise MissingDependencyError(
            "the exact schedule synthesizer needs OR-Tools: pip install 'pipesched[solver]' "
            f"(or ortools), or use solver='heuristic' ({error})"
        ) from error

    model = cp_model.CpModel()
    m, placement = problem.num_microbatches, problem.placement
    n, p = len(placement), problem.num_workers
    dur_f, pred, worker = problem.tables()
    dur = [round(d * SCALE) for d in dur_f]
    send = round(problem.costs.send * SCALE)
    horizon = _horizon(dur, send, n, m)
    scaled = Player(problem)  # plays the hint with the solver's integer durations
    scaled.dur, scaled.send = [float(d) for d in dur], float(send)
    played = scaled.play(hint) if hint is not None else None
    if played is not None:  # nothing slower than the hint is wanted
        horizon = min(horizon, math.ceil(played[0]))
    start = [model.new_int_var(0, horizon, f"s{a}") for a in range(len(dur))]
    end = [model.new_int_var(0, horizon, f"e{a}") for a in range(len(dur))]
    per_worker: list[list[Any]] = [[] for _ in range(p)]
    for a in range(len(dur)):
        per_worker[worker[a]].append(model.new_interval_var(start[a], dur[a], end[a], f"i{a}"))
        if pred[a] >= 0:
            model.add(start[a] >= end[pred[a]] + (send if worker[pred[a]] != worker[a] else 0))
    holds: list[list[Any]] = [[] for _ in range(p)]
    demands: list[list[int]] = [[] for _ in range(p)]
    holds_size: list[list[Any]] = [[] for _ in range(n)]
    for s in range(n):
        for i in range(m):
            f, w = problem.number(s, 0, i), problem.number(s, 2, i)
            size = model.new_int_var(0, horizon, f"h{s}_{i}")
            holds_size[s].append(size)
            holds[placement[s]].append(model.new_interval_var(start[f], size, end[w], f"h{s}_{i}"))
            demands[placement[s]].append(problem.size(s))
    makespan = model.new_int_var(0, horizon, "makespan")
    for w in range(p):
        model.add_no_overlap(per_worker[w])
        if problem.limited(w):
            model.add_cumulative(holds[w], demands[w], problem.capacity(w))
    for i in range(m - 1):
        model.add(start[problem.number(0, 0, i)] <= start[problem.number(0, 0, i + 1)])
    model.add_max_equality(makespan, end)
    model.minimize(makespan)
    if played is not None:  # the whole solution, so that CP-SAT starts from a complete one
        for a, t in enumerate(played[1]):
            model.add_hint(start[a], round(t))
            model.add_hint(end[a], round(t) + dur[a])
        for s in range(n):
            for i in range(m):
                f, w = problem.number(s, 0, i), problem.number(s, 2, i)
                model.add_hint(holds_size[s][i], round(played[1][w]) + dur[w] - round(played[1][f]))
        model.add_hint(makespan, round(played[0]))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_search_workers = workers
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    rows = [
        sorted(range_of(problem, w), key=lambda a: (solver.value(start[a]), a)) for w in range(p)
    ]
    return ExactResult(
        rows,
        status == cp_model.OPTIMAL,
        solver.objective_value / SCALE,
        solver.best_objective_bound / SCALE,
    )


def range_of(problem: Problem, worker: int) -> list[int]:
    """The action numbers of ``worker``."""
    m = problem.num_microbatches
    return [
        problem.number(s, k, i)
        for s, w in enumerate(problem.placement)
        if w == worker
        for k in range(3)
        for i in range(m)
    ]


def _horizon(dur: list[int], send: int, n: int, m: int) -> int:
    """A time every schedule can finish by: everything in series, with every send."""
    return sum(dur) + send * 2 * n * m + 1
