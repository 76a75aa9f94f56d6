"""Schedules made for given costs and a memory limit: list scheduling, local search, a solver.

:func:`synthesize` keeps the best of list scheduling under several priorities, every
built-in schedule of the placement that fits the limit, local search from the best
few and, with ``solver="exact"``, CP-SAT. The built-ins being candidates, the
result is never slower than any of them that fits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from pipesched.analysis.bound import stage_costs, synth_placement
from pipesched.analysis.heuristic import POLICIES, Player, Problem, Rows, improve, list_schedule
from pipesched.analysis.memory_cap import MemoryCap, memory_cap
from pipesched.errors import ConfigError, PipeschedError, ScheduleError
from pipesched.schedule.action import Action
from pipesched.schedule.builders import SCHEDULES
from pipesched.schedule.builders.argument_checks import check_count
from pipesched.schedule.costs import Costs
from pipesched.schedule.limits import check_size
from pipesched.schedule.schedule import Schedule

__all__ = ["peak_memory", "synthesize"]

Solver = Literal["auto", "heuristic", "exact"]
AUTO_EXACT_ACTIONS = 72
"""``solver="auto"`` tries the exact solver up to this many actions (3 x stages x m)."""


def synthesize(
    num_workers: int,
    num_microbatches: int,
    costs: Costs | Sequence[Costs],
    *,
    stages_per_worker: int = 1,
    memory_limit: float | Sequence[float] | None = None,
    stage_memory: Sequence[float] | None = None,
    solver: Solver = "heuristic",
    time_limit: float = 10.0,
    effort: int = 1500,
) -> Schedule:
    """A schedule for these costs that holds at most ``memory_limit`` micro-batches per worker.

    Args:
        num_workers: workers (devices).
        num_microbatches: micro-batches per step.
        costs: per-stage durations: one :class:`Costs` (numbers or per-stage
            lists) or a list of ``Costs``, one per stage
            (``num_workers x stages_per_worker`` stages).
        stages_per_worker: 1 (stage ``s`` on worker ``s``) or 2 (a V:
            worker ``w`` runs stages ``w`` and ``2p-1-w``, as zb-v).
        memory_limit: most activations a worker may hold at once, in
            micro-batches of its whole share: per worker, its stages'
            held micro-batches summed at each instant over
            ``stages_per_worker``, as :attr:`Comparison.peak_memory`
            measures a simulated Timeline (a stage holds a micro-batch from
            the start of its F to the end of its W). One number, or one per
            worker. None: no limit.
        stage_memory: what one micro-batch holds on each stage, from its F
            to its W (bytes, say); ``memory_limit`` is then in the same
            units. For stages that hold very different amounts (a language
            model's head holds its logits): an order can then keep many
            small micro-batches in flight and few large ones.
        solver: ``"heuristic"``; ``"exact"`` also runs CP-SAT for up to
            ``time_limit`` seconds (needs ``pip install pipesched[solver]``);
            ``"auto"`` does so when installed and the schedule has at most
            :data:`AUTO_EXACT_ACTIONS` actions.
        time_limit: seconds the exact solver may run.
        effort: local-search moves per candidate order.

    Returns:
        A valid Schedule named ``"synthesized"``.

    Raises:
        ConfigError: a count, the costs or the placement do not fit, or
            ``memory_limit`` is below the least any schedule can hold, one
            micro-batch of a worker's whole share (each micro-batch is
            held on a stage from its F to its W).
        ImportError: ``solver="exact"`` without OR-Tools installed.

    Example:
        >>> s = synthesize(2, 4, Costs(1, 1, 1), memory_limit=2)
        >>> s.validate().simulate(Costs(1, 1, 1)).makespan
        13.0
    """
    check_count("num_workers", num_workers)
    m = check_count("num_microbatches", num_microbatches)
    placement = synth_placement(num_workers, stages_per_worker)
    n = len(placement)
    check_size(n, m, 3, error=ConfigError, prefix="synthesize: ")
    resolved = stage_costs(costs, n)
    cap = memory_cap(memory_limit, stage_memory, placement, m)
    if solver not in ("auto", "heuristic", "exact"):
        raise ConfigError(f"solver must be 'auto', 'heuristic' or 'exact', got {solver!r}")
    if isinstance(effort, bool) or not isinstance(effort, int) or effort < 0:
        raise ConfigError(f"effort must be an integer >= 0 (local-search moves), got {effort!r}")
    if not isinstance(time_limit, int | float) or not 0 < time_limit < math.inf:
        raise ConfigError(f"time_limit must be a positive number of seconds, got {time_limit!r}")
    slots, sizes = (stages_per_worker * m, None) if cap is None else cap.slots()
    problem = Problem(placement, m, resolved, slots, sizes)
    player = Player(problem)
    found: list[tuple[float, Rows]] = []
    for rows in _candidates(problem):
        makespan = player.makespan(rows)
        if makespan < math.inf:
            found.append((makespan, rows))
    if not found:  # cannot happen: the reserving policies never deadlock within 1 share
        raise ScheduleError(f"synthesize found no order within {cap} per worker")
    found.sort(key=lambda c: c[0])
    best_makespan, best = found[0]
    for seed, (_, rows) in enumerate(found[:2]):
        improved, makespan = improve(player, rows, effort, seed)
        if makespan < best_makespan:
            best_makespan, best = makespan, improved
    if solver == "exact" or (solver == "auto" and 3 * n * m <= AUTO_EXACT_ACTIONS):
        from pipesched.analysis.exact import available, solve

        if solver == "exact" or available():
            exact = solve(problem, time_limit=time_limit, hint=best)
            if exact is not None and player.makespan(exact.rows) < best_makespan:
                best_makespan, best = player.makespan(exact.rows), exact.rows
    return _checked(_schedule(problem, best), resolved.as_costs(), best_makespan, cap)


def _checked(schedule: Schedule, costs: Costs, makespan: float, cap: MemoryCap | None) -> Schedule:
    """``schedule``, once the real simulator agrees with the fast model on time and memory."""
    timeline = schedule.simulate(costs)
    sizes = cap.sizes if cap is not None and cap.in_bytes else None
    peaks = peak_memory(schedule, costs, stage_memory=sizes)
    v = 1 if sizes is not None else schedule.virtual_stages
    over = cap is not None and any(
        peak * v > limit * (1 + 1e-9) for peak, limit in zip(peaks, cap.capacity, strict=True)
    )
    if timeline.makespan > makespan or over:
        raise ScheduleError(
            f"synthesize: the simulator gives makespan {timeline.makespan} and peaks {peaks} "
            f"for an order planned at {makespan} within {cap}; please report this"
        )
    return schedule


def peak_memory(
    schedule: Schedule, costs: Costs | None = None, *, stage_memory: Sequence[float] | None = None
) -> tuple[float, ...]:
    """Per worker, the most activations it holds at once, in micro-batches of its whole share.

    The measure ``memory_limit`` bounds: :attr:`Comparison.peak_memory` of
    the simulated timeline; with ``stage_memory`` (what one micro-batch
    holds on each stage), the most it holds in those units.

    Example:
        >>> from pipesched.schedule import get_schedule
        >>> peak_memory(get_schedule("zb-v", 4, 8))
        (2.0, 2.0)
        >>> peak_memory(get_schedule("zb-v", 4, 8), stage_memory=[1, 1, 1, 1])
        (4.0, 4.0)
        >>> peak_memory(get_schedule("zb-v", 4, 8), stage_memory=[1, 1, 1, 10])  # a heavy head
        (13.0, 4.0)
    """
    from pipesched.analysis.compare import Comparison

    timeline = schedule.simulate(costs)
    if stage_memory is None:
        return Comparison(schedule.name, schedule, timeline).peak_memory
    memory_cap(None, stage_memory, schedule.placement, schedule.num_microbatches)  # checked
    peaks = []
    for w in range(schedule.num_workers):
        changes = sorted(  # (time, change in what the worker holds); a release first
            (t, (level - before) * stage_memory[s])
            for s in schedule.stages_of(w)
            for (t, level), before in zip(
                timeline.activations_over_time[s],
                [0, *(lv for _, lv in timeline.activations_over_time[s])],
                strict=False,
            )
        )
        held, peak = 0.0, 0.0
        for _, change in changes:
            held += change
            peak = max(peak, held)
        peaks.append(peak)
    return tuple(peaks)


def _candidates(problem: Problem) -> list[Rows]:
    """Orders to start from: list scheduling under each policy, then the built-ins that fit."""
    n, m = len(problem.placement), problem.num_microbatches
    vee = n > problem.num_workers
    out = [
        rows
        for policy in POLICIES
        if (vee or policy.headroom is None) and (rows := list_schedule(problem, policy)) is not None
    ]
    for builder in SCHEDULES.values():
        try:
            built = builder(n, m)
        except (PipeschedError, TypeError):  # a builder that cannot run these counts
            continue
        if built.placement == problem.placement and built.split_backward:
            out.append(
                [[problem.number(s, "FBW".index(k), i) for s, k, i in row] for row in built.actions]
            )
    return out


def _schedule(problem: Problem, rows: Rows) -> Schedule:
    """The Schedule of integer-coded ``rows``."""
    kinds = "FBW"
    actions = tuple(
        tuple(Action(s, kinds[k], i) for s, k, i in map(problem.action, row)) for row in rows
    )
    return Schedule(actions, problem.placement, problem.num_microbatches, "synthesized")
