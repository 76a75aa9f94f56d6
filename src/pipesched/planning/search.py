"""The planner's search: every schedule x checkpoint modes, each with its best cut, predicted.

Pure Python over per-layer :class:`~pipesched.planning.candidate.LayerCost`. For each
built-in schedule and checkpoint mode the cuts are searched by simulation within the
memory budget, and a schedule is synthesized for each placement's best cut. Every
candidate is scored alike: its step by :func:`~pipesched.analysis.prediction.predict`,
its memory swept over that timeline (parameters, gradients, held activations, and
what waits from each B for its W).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from pipesched.analysis import synthesize
from pipesched.analysis.prediction import StepModel, predict
from pipesched.errors import ConfigError, PartitionError, PipeschedError
from pipesched.partition.balance import min_max_counts, search_schedule
from pipesched.partition.cuts import prefix_sums
from pipesched.planning.candidate import Candidate, LayerCost, Planning
from pipesched.planning.stage_table import (
    MIXED_STAGES,
    Modes,
    StageTable,
    modes_to_compare,
    undominated,
)
from pipesched.runtime.stage.recompute import CHECKPOINT_MODES
from pipesched.schedule import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Costs,
    Schedule,
    Timeline,
    get_schedule,
    stages_per_worker,
)
from pipesched.schedule.builders import SCHEDULES

__all__ = ["MARGIN", "MIXED_STAGES", "peak_bytes", "plan_layers"]

MARGIN = 0.01
"""A synthesized schedule is picked only when predicted this much faster than every built-in
that fits: a built-in's order is known (drawn in the docs) and its memory closed-form."""


def plan_layers(
    layers: Sequence[LayerCost],
    num_workers: int,
    chunks: int,
    *,
    memory_budget: float | None = None,
    schedules: Sequence[str] | None = None,
    checkpoints: Sequence[str] = CHECKPOINT_MODES,
    counts: Sequence[int] | None = None,
    mixed: bool = True,
    synthesized: bool = True,
    overhead: float = 0.0,
    source: str = "profiled layer costs",
) -> Planning:
    """Compares schedule x checkpoint mode x cut for ``layers`` and picks the fastest that fits.

    Args:
        layers: the model's cut units in order, with their costs.
        num_workers: workers (devices or pipeline ranks).
        chunks: micro-batches per step.
        memory_budget: bytes per worker; None: no limit.
        schedules: built-in schedules to compare (default: all of them).
        checkpoints: checkpoint modes to compare.
        mixed: also compare a mode per stage ("never" or "always", both in
            ``checkpoints``) for schedules of up to :data:`MIXED_STAGES` stages,
            under a budget (without one, recomputing only adds time).
        counts: layers per stage, fixed (only schedules of that many stages
            are compared); None: searched for each schedule.
        synthesized: also compare schedules synthesized for the costs.
        overhead: seconds the runtime spends before each action.
        source: what the costs come from (shown by ``print``).

    Raises:
        ConfigError: no candidate fits the budget (the message gives the
            smallest peak seen and the fixes), or an argument is out of range.
    """
    if num_workers < 1 or chunks < 1 or not layers:
        raise ConfigError(
            f"planning needs at least 1 worker, 1 micro-batch and 1 layer, got "
            f"num_workers={num_workers}, chunks={chunks} and {len(layers)} layers"
        )
    names = list(SCHEDULES) if schedules is None else list(schedules)
    found: list[Candidate] = []
    skipped: list[tuple[str, str]] = []
    for name in names:
        stages = num_workers * stages_per_worker(name)
        why = _unfit(name, stages, len(layers), counts)
        if why is None:
            try:
                get_schedule(name, stages, chunks)
            except PipeschedError as error:
                why = str(error)
        if why is not None:
            skipped.append((name, why))
            continue
        for modes in modes_to_compare(checkpoints, stages, mixed and memory_budget is not None):
            plan = get_schedule(name, stages, chunks)
            found.append(_best_cut(plan, layers, modes, memory_budget, counts, overhead))
    found = undominated(found)
    if synthesized:
        found += _synthesized(found, layers, num_workers, chunks, memory_budget, overhead)
    fitting = sorted(  # at a tie, one mode for every stage: the simpler to run and read
        (c for c in found if c.fits),
        key=lambda c: (c.step, c.peak_bytes, not isinstance(c.checkpoint, str)),
    )
    if not fitting:
        if not found:
            raise ConfigError(
                f"no schedule can cut {len(layers)} layers for {num_workers} workers: "
                + "; ".join(f"{n}: {w}" for n, w in skipped)
            )
        least = min(found, key=lambda c: c.peak_bytes)
        raise ConfigError(
            f"no plan fits memory_budget={memory_budget:.4g} bytes per worker; the least "
            f"memory any needs is {least.peak_bytes:.4g} bytes ({least.schedule}, "
            f"checkpoint={least.checkpoint!r}, balance {list(least.counts)}): raise the "
            "budget, use more workers, or smaller micro-batches (more chunks)"
        )
    pick = fitting[0]
    if pick.table is not None:  # a synthesized table must beat the built-ins by a margin
        near = [c for c in fitting if c.table is None and c.step <= pick.step * (1 + MARGIN)]
        pick = near[0] if near else pick
    others = sorted((c for c in found if not c.fits), key=lambda c: c.step)
    baseline = _baseline(layers, num_workers, chunks, checkpoints, memory_budget, counts, overhead)
    return Planning(
        tuple(fitting + others),
        pick,
        num_workers,
        memory_budget,
        tuple(skipped),
        baseline,
        source,
    )


def peak_bytes(
    timeline: Timeline,
    stop: int | Sequence[int],
    held: Sequence[tuple[float, float]],
    fixed: Sequence[float],
    between: Sequence[float] | None = None,
) -> float:
    """The fullest worker's memory over ``timeline`` (see the module docstring).

    Args:
        timeline: a step, planned or predicted.
        stop: micro-batches ``i < stop`` are checkpointed (per stage: a sequence).
        held: per stage, (bytes of a checkpointed micro-batch before its
            backward, bytes of a whole one).
        fixed: per worker, bytes held all step.
        between: per stage, bytes of a micro-batch whose B has run and whose W
            has not (what W needs); None: a whole one's.
    """
    split = {(s, i) for (s, kind, i), _, _, _ in timeline.events if kind == WEIGHT}
    stops = [stop] * timeline.num_stages if isinstance(stop, int) else list(stop)
    changes: list[list[tuple[float, int, float]]] = [[] for _ in fixed]
    for e in timeline.events:
        s, kind, i = e.action
        light, whole = held[s]
        waiting = whole if between is None else between[s]
        delta = changes[e.worker]
        if kind == FORWARD:
            delta.append((e.start, 1, light if i < stops[s] else whole))
        if kind == BACKWARD and i < stops[s]:
            delta.append((e.start, 1, whole - light))
        if kind == BACKWARD and (s, i) in split:  # what W needs stays; the rest is freed
            delta.append((e.end, 1 if waiting > whole else 0, waiting - whole))
        elif kind == BACKWARD:
            delta.append((e.end, 0, -whole))
        if kind == WEIGHT:
            delta.append((e.end, 0, -waiting))
    peak = 0.0
    for w, delta in enumerate(changes):
        level = top = fixed[w]
        for _, _, change in sorted(delta):  # at one instant, frees (0) before takes (1)
            level += change
            top = max(top, level)
        peak = max(peak, top)
    return peak


def _unfit(name: str, stages: int, num_layers: int, counts: Sequence[int] | None) -> str | None:
    if counts is not None and len(counts) != stages:
        return f"it runs {stages} stages, the balance given has {len(counts)}"
    if stages > num_layers:
        return f"it needs {stages} stages, the model has {num_layers} layers"
    return None


def _best_cut(
    schedule: Schedule,
    layers: Sequence[LayerCost],
    mode: Modes,
    budget: float | None,
    counts: Sequence[int] | None,
    overhead: float,
) -> Candidate:
    """The schedule with the cut that simulates fastest within the budget (or the least memory)."""
    table = StageTable(layers, mode, schedule.num_microbatches)
    chosen = list(counts) if counts is not None else None
    if chosen is None:
        start = min_max_counts(
            len(layers), schedule.num_stages, lambda k, i, j: sum(table.search_passes(k, i, j)[:2])
        )
        try:
            chosen = list(
                search_schedule(
                    schedule,
                    len(layers),
                    table.search_passes,
                    table.fixed,
                    start=start,
                    memory_budget=budget,
                    overlap=table.counted_twice,
                ).counts
            )
        except PartitionError:  # nothing fits: score the fastest cut anyway, shown over budget
            chosen = list(
                search_schedule(
                    schedule,
                    len(layers),
                    table.search_passes,
                    table.fixed,
                    start=start,
                    overlap=table.counted_twice,
                ).counts
            )
    return _score(schedule, schedule.name, chosen, table, budget, overhead)


def _score(
    schedule: Schedule,
    name: str,
    counts: Sequence[int],
    table: StageTable,
    budget: float | None,
    overhead: float,
    note: str = "",
) -> Candidate:
    bounds = prefix_sums(counts)
    spans = list(itertools.pairwise(bounds))
    forward = tuple(table.times(i, j)[0] for i, j in spans)
    if schedule.split_backward:
        backward = tuple(table.split_times(i, j)[0] for i, j in spans)
        weight = tuple(table.split_times(i, j)[1] for i, j in spans)
    else:
        backward = tuple(table.times(i, j)[1] for i, j in spans)
        weight = (0.0,) * len(spans)
    # The pairs the runtime runs as one whole backward cost a whole backward, not B + W.
    whole = tuple(table.times(i, j)[1] for i, j in spans) if schedule.split_backward else ()
    model = StepModel(
        {FORWARD: forward, BACKWARD: backward, WEIGHT: weight},
        StepModel.recomputation(forward, split_backward=schedule.split_backward),
        (overhead,) * schedule.num_workers,
        source="planner",
        whole=whole,
    )
    stops = table.stops(schedule.num_stages)
    timeline = predict(schedule, model, stops)
    fixed = [0.0] * schedule.num_workers
    for k, (i, j) in enumerate(spans):
        fixed[schedule.placement[k]] += 2.0 * (table.params[j] - table.params[i])
    for w in range(schedule.num_workers):
        fixed[w] -= table.counted_twice([spans[k] for k in schedule.stages_of(w)])
    held = [table.held(i, j) for i, j in spans]
    peak = peak_bytes(timeline, stops, held, fixed, [table.between(i, j) for i, j in spans])
    return Candidate(
        name,
        table.mode,
        tuple(counts),
        schedule.num_microbatches,
        timeline.makespan,
        peak,
        budget is None or peak <= budget,
        schedule if name == "synthesized" else None,
        note,
    )


def _synthesized(
    found: Sequence[Candidate],
    layers: Sequence[LayerCost],
    num_workers: int,
    chunks: int,
    budget: float | None,
    overhead: float,
) -> list[Candidate]:
    """A schedule synthesized for the best cut of each placement and checkpoint mode.

    Of the modes per stage, only the fastest fitting mix of each placement:
    one synthesis per mix would multiply the solve time (and the table) by up to 15.
    """
    result = []
    for v in (1, 2):
        placed = [c for c in found if stages_per_worker(c.schedule) == v]
        mixes = [c for c in placed if not isinstance(c.checkpoint, str)]
        best_mix = min(mixes, key=lambda c: (not c.fits, c.step)).checkpoint if mixes else None
        modes = [c.checkpoint for c in placed if isinstance(c.checkpoint, str)] + [best_mix]
        for mode in dict.fromkeys(m for m in modes if m is not None):
            same = [
                c
                for c in found
                if c.checkpoint == mode
                and stages_per_worker(c.schedule) == v
                and c.schedule != "interleaved-1f1b"  # not a V: its cut does not transfer
            ]
            if not same:
                continue
            base = min(same, key=lambda c: (not c.fits, c.step))
            table = StageTable(layers, mode, chunks)
            bounds = prefix_sums(base.counts)
            spans = list(itertools.pairwise(bounds))
            costs = []
            for k, (i, j) in enumerate(spans):
                forward = table.times(i, j)[0]
                b, w = table.split_times(i, j)
                again = forward if table.stop(k) else 0.0
                costs.append(Costs(forward, b + again, w + (again if k else 0.0)))
            limit = _held_limit(table, spans, num_workers, v, budget)
            try:
                made = synthesize(
                    num_workers,
                    chunks,
                    costs,
                    stages_per_worker=v,
                    memory_limit=limit,
                    stage_memory=[table.held(i, j)[1] for i, j in spans],
                )
            except PipeschedError:  # the budget is below one micro-batch of a worker's share
                continue
            result.append(
                _score(
                    made,
                    "synthesized",
                    base.counts,
                    table,
                    budget,
                    overhead,
                    note=f"(for {base.schedule}'s cut)",
                )
            )
    return result


def _held_limit(
    table: StageTable, spans: Sequence[tuple[int, int]], workers: int, v: int, budget: float | None
) -> list[float] | None:
    """Per worker, the bytes of activations it may hold: the budget less its fixed bytes.

    Each stage's micro-batch is counted whole from its F to its W (an order
    may hold a recomputed one from B to W), as ``stage_memory``.
    """
    if budget is None:
        return None
    limits = []
    for w in range(workers):
        ks = [w] if v == 1 else [w, 2 * workers - 1 - w]
        fixed = sum(table.fixed(k, *spans[k]) for k in ks) - table.counted_twice(
            [spans[k] for k in ks]
        )
        limits.append(budget - fixed)
    return limits


def _baseline(
    layers: Sequence[LayerCost],
    num_workers: int,
    chunks: int,
    checkpoints: Sequence[str],
    budget: float | None,
    counts: Sequence[int] | None,
    overhead: float,
) -> Candidate | None:
    """1F1B with time-balanced stages (what ``balance="time"`` gives), for comparison."""
    if num_workers > len(layers) or (counts is not None and len(counts) != num_workers):
        return None
    mode = "never" if "never" in checkpoints else checkpoints[0]
    table = StageTable(layers, mode, chunks)
    chosen = counts or min_max_counts(
        len(layers), num_workers, lambda k, i, j: sum(table.times(i, j))
    )
    return _score(
        get_schedule("1f1b", num_workers, chunks), "1f1b", list(chosen), table, budget, overhead
    )
