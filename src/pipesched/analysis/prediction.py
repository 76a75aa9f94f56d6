"""A step predicted from what a run really spends: passes, recomputation, transfers, overhead.

:class:`StepModel` measures from a :class:`Timeline` (or a profile) what a step
spends besides its passes, and :func:`predict` plays a schedule with all of it,
its :class:`~pipesched.schedule.breakdown.Breakdown` splitting idle time by cause.
Why a loop of its own and not :func:`simulate` with larger costs: a transfer's
latency overlaps the overhead before an action, which per-pass costs cannot say.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from pipesched.errors import ScheduleError
from pipesched.schedule.action import BACKWARD, FORWARD, WEIGHT, Action
from pipesched.schedule.breakdown import Breakdown
from pipesched.schedule.dataflow import data_predecessor
from pipesched.schedule.gc_pause import paused_gc
from pipesched.schedule.schedule import Schedule
from pipesched.schedule.timeline import Event, Timeline

__all__ = ["StepModel", "predict"]

_KINDS = (FORWARD, BACKWARD, WEIGHT)
Costs = Mapping[str, tuple[float, ...]]


@dataclass(frozen=True)
class StepModel:
    """What each part of a step costs, in seconds (or any unit).

    Args:
        passes: per kind ("F", "B", "W"), each stage's duration of one
            micro-batch's pass without recomputation (the last stage's F
            includes the loss). A schedule that does not split backward has
            its whole backward in B and W 0.
        recompute: per kind, what a checkpointed micro-batch adds to that
            pass on each stage (its forward, run again).
        overhead: per worker, the gap before each action whose input is there.
        latency: from a producer's end to its consumer's start on another worker.
        outside: step time before the first action and after the last.
        source: what the costs come from, in words.
        spread: per kind, each stage's measured durations divided by their
            mean (for its checkpointed or kept micro-batches): how like
            actions vary. Empty: they do not.
        whole: each stage's B where it runs the whole backward (the pairs of
            ``Schedule.whole_backwards``, whose W then costs nothing), without
            recomputation. Empty: B + W.
    """

    passes: Mapping[str, tuple[float, ...]]
    recompute: Mapping[str, tuple[float, ...]]
    overhead: tuple[float, ...]
    latency: float = 0.0
    outside: float = 0.0
    source: str = "measured step"
    spread: Mapping[str, tuple[tuple[float, ...], ...]] = field(default_factory=dict)
    whole: tuple[float, ...] = ()

    @classmethod
    def measure(
        cls,
        timeline: Timeline,
        checkpoint_stop: int | Sequence[int],
        *,
        outside: float = 0.0,
        source: str = "measured step",
        whole: frozenset[tuple[int, int]] = frozenset(),
    ) -> StepModel:
        """The costs of the measured step ``timeline``; ``whole``: the pairs it ran as one
        whole backward (their B measures :attr:`whole`, their W nothing).

        Passes: each stage's mean duration of each kind, apart for the
        micro-batches ``i < checkpoint_stop`` (checkpointed; per stage where a
        sequence) and the others;
        the difference is the recomputation. With only checkpointed
        micro-batches, B's recomputation is taken to be the stage's forward.
        Overhead: per worker, the median gap between an action and the one
        before it when its input was ready before that one ended. Latency:
        from a producer's end to its consumer's start on another worker, the
        one value with which the model's starts of all such consumers add up
        to the measured ones (see :func:`_gaps`).
        """
        n = timeline.num_stages
        stops = _stops(checkpoint_stop, n)
        samples: dict[tuple[str, int, bool], list[float]] = defaultdict(list)
        joined: dict[tuple[int, bool], list[float]] = defaultdict(list)  # whole backwards
        for e in timeline.events:
            s, kind, i = e.action
            if kind == FORWARD or (s, i) not in whole:
                samples[kind, s, i < stops[s]].append(e.duration)
            elif kind == BACKWARD:
                joined[s, i < stops[s]].append(e.duration)
        never_split = {s for s, _ in joined} - {s for (k, s, _) in samples if k == BACKWARD}
        for (s, recomputed), durations in joined.items():
            if s in never_split:  # its whole backwards are its B (both classes)
                samples[BACKWARD, s, recomputed] += durations

        def mean(kind: str, s: int, checkpointed: bool) -> float | None:
            got = samples.get((kind, s, checkpointed))
            return sum(got) / len(got) if got else None

        passes: dict[str, list[float]] = {k: [0.0] * n for k in _KINDS}
        recompute: dict[str, list[float]] = {k: [0.0] * n for k in _KINDS}
        for kind in _KINDS:
            for s in range(n):
                plain, checkpointed = mean(kind, s, False), mean(kind, s, True)
                if plain is not None:
                    passes[kind][s] = plain
                    if checkpointed is not None:
                        recompute[kind][s] = checkpointed - plain
                elif checkpointed is not None:
                    passes[kind][s] = checkpointed
        for s in range(n):  # one class of micro-batch only: B recomputes the forward
            forward = passes[FORWARD][s]
            if mean(BACKWARD, s, False) is None and mean(BACKWARD, s, True) is not None:
                recompute[BACKWARD][s] = min(forward, passes[BACKWARD][s])
                passes[BACKWARD][s] -= recompute[BACKWARD][s]
            elif mean(BACKWARD, s, True) is None and (
                not any(mean(k, s, True) is not None for k in _KINDS) or (s, True) in joined
            ):  # (or its checkpointed micro-batches all ran whole: none split to compare)
                recompute[BACKWARD][s] = forward
        split = {s for (kind, s, _) in samples if kind == WEIGHT}
        whole_costs = _whole_costs(joined, split, passes, recompute) if whole else ()
        overhead, latency = _gaps(timeline)
        ratios: dict[str, list[list[float]]] = {k: [[] for _ in range(n)] for k in _KINDS}
        for (kind, s, _), durations in samples.items():
            average = sum(durations) / len(durations)
            if average > 0:
                ratios[kind][s] += [d / average for d in durations]
        return cls(
            {k: tuple(v) for k, v in passes.items()},
            {k: tuple(v) for k, v in recompute.items()},
            overhead,
            latency,
            outside,
            source,
            {k: tuple(tuple(r) for r in v) for k, v in ratios.items()},
            whole_costs,
        )

    @classmethod
    def from_stage_times(
        cls,
        forward: Sequence[float],
        backward: Sequence[float],
        num_workers: int,
        *,
        split_backward: bool,
        source: str,
    ) -> StepModel:
        """Costs from a profile's per-stage forward and backward times: no overhead, no latency.

        A split backward is cut in equal halves (B and W), as the partition's
        own simulation does; checkpointed micro-batches recompute as
        :meth:`recomputation` says.
        """
        half = tuple(b / 2 for b in backward)
        passes: dict[str, tuple[float, ...]] = {
            FORWARD: tuple(forward),
            BACKWARD: half if split_backward else tuple(backward),
            WEIGHT: half if split_backward else (0.0,) * len(backward),
        }
        recompute = cls.recomputation(forward, split_backward=split_backward)
        return cls(passes, recompute, (0.0,) * num_workers, source=source)

    @staticmethod
    def recomputation(
        forward: Sequence[float], *, split_backward: bool
    ) -> dict[str, tuple[float, ...]]:
        """What a checkpointed micro-batch adds per pass kind and stage, from forward times.

        B runs the forward again; a split backward's W reuses what B's
        recomputation stashed (``runtime/deferred.py``), so W adds nothing, and
        ``split_backward`` does not change the answer (kept for callers).
        """
        del split_backward
        zero = (0.0,) * len(forward)
        return {FORWARD: zero, BACKWARD: tuple(forward), WEIGHT: zero}


def predict(schedule: Schedule, model: StepModel, checkpoint_stop: int | Sequence[int]) -> Timeline:
    """``schedule`` played with ``model``'s costs; micro-batches ``i < checkpoint_stop`` recompute.

    ``checkpoint_stop``: for every stage, or per stage (a sequence).

    Each action starts when its worker has finished its previous action and
    spent its overhead, and its input has arrived (plus ``model.latency``
    from another worker). The returned Timeline's breakdown splits its idle
    time by cause (:class:`~pipesched.schedule.breakdown.Breakdown`): the
    same schedule is played five times, switching on one cause after another.

    Raises:
        ScheduleError: the schedule cannot run.
    """
    schedule.validate()
    n, workers = schedule.num_stages, schedule.num_workers
    mean: Costs = {k: (sum(v) / len(v),) * n for k, v in model.passes.items()}
    zero: Costs = {k: (0.0,) * n for k in _KINDS}
    no_gap = (0.0,) * workers
    whole = model.whole
    level = (sum(whole) / len(whole),) * n if whole else ()  # the ideal: every stage at the mean
    levels: list[tuple[Costs, Costs, float, tuple[float, ...], tuple[float, ...]]] = [
        (mean, zero, 0.0, no_gap, level),
        (model.passes, zero, 0.0, no_gap, whole),
        (model.passes, model.recompute, 0.0, no_gap, whole),
        (model.passes, model.recompute, model.latency, no_gap, whole),
        (model.passes, model.recompute, model.latency, model.overhead, whole),
    ]
    stops = _stops(checkpoint_stop, n)
    with paused_gc():
        played = [_play(schedule, stops, *level) for level in levels]
        played.append(_typical(schedule, stops, model, played[-1]))
    idle = [sum(t.idle) for t in played]
    parts = [idle[0], *(b - a for a, b in itertools.pairwise(idle))]
    ideal, imbalance, recomputation, communication, overhead, variability = parts
    breakdown = Breakdown(
        ideal,
        imbalance,
        recomputation,
        communication,
        overhead,
        variability,
        model.outside,
        model.source,
    )
    return replace(played[-1], breakdown=breakdown)


def _whole_costs(
    joined: Mapping[tuple[int, bool], list[float]],
    split: set[int],
    passes: Mapping[str, list[float]],
    recompute: Mapping[str, list[float]],
) -> tuple[float, ...]:
    """Each stage's whole backward, without recomputation: the mean of those measured
    (``joined``, by stage and whether checkpointed) on a stage that also split some
    (``split``); else B + W (a stage that never split measured its whole ones as B)."""
    costs = []
    for s in range(len(passes[BACKWARD])):
        kept, recomputed = joined.get((s, False)), joined.get((s, True))
        if s not in split or not (kept or recomputed):
            costs.append(passes[BACKWARD][s] + passes[WEIGHT][s])
        elif kept:
            costs.append(sum(kept) / len(kept))
        else:
            runs = recomputed or [0.0]
            costs.append(sum(runs) / len(runs) - recompute[BACKWARD][s])
    return tuple(costs)


SAMPLES = 31
"""Steps played with durations drawn from the measured spread; the median one is returned."""


def _typical(
    schedule: Schedule, stop: tuple[int, ...], model: StepModel, steady: Timeline
) -> Timeline:
    """The step of median makespan among :data:`SAMPLES` played with durations drawn from
    ``model.spread`` (seeded: the same model gives the same step); ``steady`` without a spread.
    """
    spread = model.spread
    if not any(r for rows in spread.values() for r in rows):
        return steady
    rng = random.Random(0)
    order = schedule.order()
    plays = []
    for _ in range(SAMPLES):
        factor = {}
        for a in order:
            rows = spread.get(a.kind, ())
            choices = rows[a.stage] if a.stage < len(rows) else ()
            factor[a] = rng.choice(choices) if choices else 1.0
        plays.append(
            _play(
                schedule,
                stop,
                model.passes,
                model.recompute,
                model.latency,
                model.overhead,
                model.whole,
                factor,
            )
        )
    plays.sort(key=lambda t: t.makespan)
    return plays[len(plays) // 2]


def _play(
    schedule: Schedule,
    stop: tuple[int, ...],
    passes: Mapping[str, tuple[float, ...]],
    recompute: Mapping[str, tuple[float, ...]],
    latency: float,
    overhead: tuple[float, ...],
    whole: tuple[float, ...] = (),
    factor: Mapping[Action, float] | None = None,
) -> Timeline:
    """``schedule`` played; ``whole`` (each stage's whole backward, empty: none) is what
    the pairs of ``Schedule.whole_backwards`` take in B, their W nothing."""
    order = schedule.order()
    placement, n = schedule.placement, schedule.num_stages
    joined = schedule.whole_backwards if whole else frozenset()
    end: dict[tuple[int, str, int], float] = {}
    free = [0.0] * schedule.num_workers
    events = []
    for action in order:
        s, kind, i = action
        w = placement[s]
        start = free[w] + overhead[w]
        need = data_predecessor(action, n)
        if need is not None and placement[need[0]] != w:
            start = max(start, end[need] + latency)
        duration = passes[kind][s] + (recompute[kind][s] if i < stop[s] else 0.0)
        if (s, i) in joined and kind != FORWARD:  # one whole backward: B all of it, W nothing
            duration = 0.0 if kind == WEIGHT else duration - passes[kind][s] + whole[s]
        if factor is not None:
            duration *= factor[action]
        end[action] = free[w] = start + duration
        events.append(Event(action, w, start, start + duration))
    return Timeline(tuple(events), placement)


def _stops(checkpoint_stop: int | Sequence[int], num_stages: int) -> tuple[int, ...]:
    """Each stage's checkpoint stop."""
    if isinstance(checkpoint_stop, int):
        return (checkpoint_stop,) * num_stages
    if len(checkpoint_stop) != num_stages:
        raise ScheduleError(
            f"checkpoint_stop has {len(checkpoint_stop)} values for {num_stages} stages: "
            "give one per stage, or one int for all"
        )
    return tuple(checkpoint_stop)


def _gaps(timeline: Timeline) -> tuple[tuple[float, ...], float]:
    """Per worker the median overhead before an action, and the transfer latency.

    The latency is the one with which the model's starts of the actions fed from
    another worker, ``max(previous end + overhead, producer's end + latency)``, sum
    to the measured ones (:func:`_fit_latency`). Why not the mean wait of the
    consumers whose producer ended after their previous action: a consumer whose
    producer ended just before that also waits for the transfer, and on 2 gloo
    ranks such waits made the step 4-7% longer than that mean predicts.
    """
    ends: dict[tuple[int, str, int], float] = {
        (e.action.stage, e.action.kind, e.action.microbatch): e.end for e in timeline.events
    }
    overhead: list[float] = []
    fed: list[tuple[float, float, float]] = []  # (earliest by its worker, producer's end, start)
    for w in range(timeline.num_workers):
        gaps: list[float] = []
        crossing: list[tuple[float | None, float, float]] = []
        previous: Event | None = None
        for e in timeline.worker_events(w):
            need = data_predecessor(e.action, timeline.num_stages)
            ready = ends.get(need) if need is not None else None
            after = None if previous is None else previous.end
            crosses = need is not None and timeline.placement[need[0]] != w
            if ready is not None and crosses:
                crossing.append((after, ready, e.start))
                if after is not None and ready <= after:
                    gaps.append(e.start - after)
            elif after is not None:
                gaps.append(e.start - after)
            previous = e
        overhead.append(max(0.0, statistics.median(gaps)) if gaps else 0.0)
        fed += [(-math.inf if a is None else a + overhead[w], r, s) for a, r, s in crossing]
    return tuple(overhead), _fit_latency(fed)


def _fit_latency(fed: list[tuple[float, float, float]]) -> float:
    """The latency ``L >= 0`` at which ``sum(max(earliest, ready + L) - start)`` over ``fed``
    is 0 (a nondecreasing function of ``L``: bisected); 0 if it is positive at 0."""
    if not fed:
        return 0.0

    def excess(latency: float) -> float:
        return sum(max(earliest, ready + latency) - start for earliest, ready, start in fed)

    low, high = 0.0, max(0.0, max(start - ready for _, ready, start in fed))
    if excess(low) >= 0:
        return 0.0
    for _ in range(60):  # far below a nanosecond of any real step
        middle = (low + high) / 2
        if excess(middle) < 0:
            low = middle
        else:
            high = middle
    return (low + high) / 2
