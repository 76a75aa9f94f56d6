"""Schedules on paper: each action as early as its dependencies and its worker allow."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipesched.errors import ConfigTypeError
from pipesched.schedule.action import BACKWARD, FORWARD
from pipesched.schedule.costs import Costs
from pipesched.schedule.gc_pause import paused_gc
from pipesched.schedule.timeline import Event, Timeline

if TYPE_CHECKING:
    from pipesched.schedule.action import Action
    from pipesched.schedule.schedule import Schedule

__all__ = ["simulate"]


def simulate(schedule: Schedule, costs: Costs | None = None) -> Timeline:
    """Plays ``schedule`` with ``costs`` and returns its Timeline.

    Each action starts when its worker has finished its previous action and
    its data has arrived (the producer's end, plus ``costs.send`` if the
    producer ran on another worker): the longest path to the action in the
    schedule graph (:meth:`Schedule.graph`), computed in one pass over a
    topological order.

    Args:
        schedule: a schedule; validated first.
        costs: durations; unit costs (F = B = W = 1, send 0) when None.

    Raises:
        ScheduleError: the schedule cannot run.
        ConfigError: a per-stage cost list does not match ``schedule.num_stages``.
        ConfigTypeError: ``costs`` is not a :class:`Costs`.

    Example:
        >>> from pipesched.schedule import get_schedule
        >>> t = simulate(get_schedule("gpipe", 4, 8))
        >>> t.makespan, round(t.bubble_fraction, 4)
        (33.0, 0.2727)
    """
    if costs is not None and not isinstance(costs, Costs):
        raise ConfigTypeError(
            f"simulate(costs=...) takes one Costs (None: unit costs), got "
            f"{type(costs).__name__} {costs!r:.80}; for a cost per stage give each field a "
            "tuple, e.g. Costs(forward=(1.0, 1.2), backward=(2.0, 2.4))"
        )
    costs = costs or Costs()
    duration = costs.per_stage(schedule.num_stages, split_backward=schedule.split_backward)
    schedule.validate()
    order: list[Action] = schedule._cache["order"]  # type: ignore[assignment]
    placement, num_stages, send = schedule.placement, schedule.num_stages, costs.send
    with paused_gc():
        return _play(order, duration, placement, num_stages, send, schedule.num_workers)


def _play(
    order: list[Action],
    duration: dict[str, tuple[float, ...]],
    placement: tuple[int, ...],
    num_stages: int,
    send: float,
    num_workers: int,
) -> Timeline:
    end: dict[tuple[int, str, int], float] = {}
    worker_free = [0.0] * num_workers
    events = []
    make_event = Event._make
    last = num_stages - 1
    for action in order:
        s, kind, i = action
        # data_predecessor, inlined: this loop runs once per action of large schedules.
        if kind == FORWARD:
            need = (s - 1, FORWARD, i) if s else None
        elif kind == BACKWARD:
            need = (s + 1, BACKWARD, i) if s < last else (s, FORWARD, i)
        else:
            need = (s, BACKWARD, i)
        w = placement[s]
        start = worker_free[w]
        if need is not None:
            arrival = end[need] + (send if placement[need[0]] != w else 0.0)
            if arrival > start:
                start = arrival
        finish = start + duration[kind][s]
        end[action] = worker_free[w] = finish
        events.append(make_event((action, w, start, finish)))
    return Timeline(tuple(events), placement)
