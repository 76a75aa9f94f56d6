"""When each action ran, planned or measured, and what follows from it: bubbles, memory."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from operator import itemgetter
from pathlib import Path
from typing import Any, NamedTuple

from pipesched.errors import ConfigError, ScheduleError
from pipesched.schedule.action import BACKWARD, FORWARD, WEIGHT, Action
from pipesched.schedule.breakdown import Breakdown
from pipesched.schedule.costs import Costs
from pipesched.schedule.gc_pause import paused_gc
from pipesched.schedule.limits import MAX_ACTIONS, limit_text

__all__ = ["Event", "Timeline"]

_FORMAT = "pipesched.timeline"
_VERSION = 1


class Event(NamedTuple):
    """One action on one worker, from ``start`` to ``end`` (any unit; seconds when measured).

    A NamedTuple, like Action, because a large timeline holds hundreds of
    thousands of them.
    """

    action: Action
    worker: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        """``end - start``."""
        return self.end - self.start


@dataclass(frozen=True)
class Timeline:
    """The events of one pipeline step: simulated by the schedule core or measured by a runtime.

    Both kinds are this one type, so whatever reports or draws a plan also
    reports and draws reality.

    Args:
        events: every action with its start and end.
        placement: ``placement[s]`` is the worker that ran stage ``s``.
        breakdown: a prediction's split of its idle time by cause, and the
            step time outside the actions (:meth:`pipesched.Pipeline.predict`);
            None for plans and measured runs.
    """

    events: tuple[Event, ...]
    placement: tuple[int, ...]
    breakdown: Breakdown | None = None
    _by_worker: dict[int, list[Event]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "events", tuple(self.events))
        object.__setattr__(self, "placement", tuple(self.placement))
        by_worker: dict[int, list[Event]] = defaultdict(list)
        for e in sorted(self.events, key=itemgetter(2, 3)):  # (start, end)
            by_worker[e.worker].append(e)
        object.__setattr__(self, "_by_worker", dict(by_worker))

    @property
    def num_stages(self) -> int:
        """Stages of the pipeline."""
        return len(self.placement)

    @property
    def num_workers(self) -> int:
        """Workers of the pipeline."""
        return max(self.placement) + 1

    def worker_events(self, worker: int) -> list[Event]:
        """``worker``'s events in time order."""
        return list(self._by_worker.get(worker, []))

    @cached_property
    def start(self) -> float:
        """When the first action started."""
        return min((e.start for e in self.events), default=0.0)

    @cached_property
    def makespan(self) -> float:
        """From the first action's start to the last action's end."""
        return max((e.end for e in self.events), default=0.0) - self.start

    @property
    def step_time(self) -> float:
        """The makespan plus the step time outside the actions, where a breakdown says it."""
        return self.makespan + (self.breakdown.outside if self.breakdown is not None else 0.0)

    @cached_property
    def busy(self) -> tuple[float, ...]:
        """Time each worker spent running actions."""
        return tuple(
            sum(e[3] - e[2] for e in self._by_worker.get(w, [])) for w in range(self.num_workers)
        )

    @cached_property
    def idle(self) -> tuple[float, ...]:
        """Time each worker spent waiting within the makespan."""
        return tuple(self.makespan - b for b in self.busy)

    @cached_property
    def bubble_fraction(self) -> float:
        """Idle worker-time over ``num_workers * makespan``; 0.0 for an empty timeline."""
        total = self.num_workers * self.makespan
        return sum(self.idle) / total if total > 0 else 0.0

    @cached_property
    def _holds(self) -> list[tuple[int, float, float]]:
        """(stage, acquire, release) of each micro-batch's activations on each stage.

        A stage holds a micro-batch's activations from the start of its F to
        the end of its last backward pass (W where backward is split, else B).
        """
        ends: dict[str, dict[tuple[int, int], float]] = {FORWARD: {}, BACKWARD: {}, WEIGHT: {}}
        start: dict[tuple[int, int], float] = {}
        for (s, kind, i), _, begin, end in self.events:  # comprehension-speed unpacking
            ends[kind][s, i] = end
            if kind == FORWARD:
                start[s, i] = begin
        last = ends[FORWARD] | ends[BACKWARD] | ends[WEIGHT]  # later passes overwrite
        return [(key[0], t, last[key]) for key, t in start.items()]

    @cached_property
    def activations_over_time(self) -> tuple[tuple[tuple[float, int], ...], ...]:
        """Per stage, the step function (time, micro-batches held from then on)."""
        changes: list[list[tuple[float, int]]] = [[] for _ in range(self.num_stages)]
        for stage, acquire, release in self._holds:
            changes[stage] += [(acquire, 1), (release, -1)]
        series = []
        for stage_changes in changes:
            held, points = 0, list[tuple[float, int]]()
            # At equal times a release comes first: a slot freed by one pass is reused by the next.
            for t, delta in sorted(stage_changes):
                held += delta
                if points and points[-1][0] == t:
                    points[-1] = (t, held)
                else:
                    points.append((t, held))
            series.append(tuple(points))
        return tuple(series)

    @cached_property
    def peak_activations(self) -> tuple[int, ...]:
        """Per stage, the most micro-batches whose activations it held at once."""
        with paused_gc():
            series = self.activations_over_time
        return tuple(max((n for _, n in s), default=0) for s in series)

    def measured_costs(self, send: float = 0.0) -> Costs:
        """Each stage's mean F, B and W duration in this timeline, as Costs for the simulator.

        Simulating the same schedule with these costs gives the plan a
        measured run should have followed; the gap is overhead and noise.
        A stage without W gets weight 0 (its B already includes it).
        """
        totals: dict[tuple[str, int], list[float]] = defaultdict(list)
        for e in self.events:
            totals[e.action.kind, e.action.stage].append(e.duration)

        def mean(kind: str) -> list[float]:
            return [
                sum(totals[kind, s]) / len(totals[kind, s]) if totals[kind, s] else 0.0
                for s in range(self.num_stages)
            ]

        return Costs(mean(FORWARD), mean(BACKWARD), mean(WEIGHT), send=send)

    def summary(self) -> str:
        """One line: makespan, bubble and peak activations; a prediction's breakdown after it."""
        peaks = " ".join(str(n) for n in self.peak_activations)
        line = (
            f"makespan {self.makespan:g}, bubble {100 * self.bubble_fraction:.1f}%, "
            f"peak activations per stage [{peaks}]"
        )
        b = self.breakdown
        if b is None:
            return line
        return (
            f"{line}\npredicted step {self.step_time:g} (makespan + {b.outside:g} outside the "
            f"actions), from {b.source}\nidle worker-time {sum(self.idle):g} = {b.text()}"
        )

    def to_json(self) -> str:
        """The timeline as JSON text that :meth:`from_json` reads back into an equal Timeline.

        Each event is ``[action, worker, start, end]`` with the action in its
        short form (``"2F0"``); times are written as Python writes floats, so
        they come back bit for bit.

        Raises:
            ConfigError: a time is NaN or infinite (JSON has no such numbers).

        Example:
            >>> from pipesched.schedule import get_schedule
            >>> t = get_schedule("1f1b", 2, 2).simulate()
            >>> Timeline.from_json(t.to_json()) == t
            True
        """
        bad = [e for e in self.events if not (math.isfinite(e.start) and math.isfinite(e.end))]
        if bad:
            raise ConfigError(
                f"timeline event {bad[0].action} has start {bad[0].start!r} and end "
                f"{bad[0].end!r}; only finite times can be written as JSON"
            )
        events = ",\n".join(
            json.dumps([str(e.action), e.worker, e.start, e.end]) for e in self.events
        )
        extra = ""
        if self.breakdown is not None:
            extra = f'"breakdown": {json.dumps(self.breakdown.to_dict())},\n'
        return (
            f'{{"format": "{_FORMAT}", "version": {_VERSION}, '
            f'"placement": {json.dumps(list(self.placement))},\n{extra}'
            f'"events": [\n{events}\n]}}\n'
        )

    @classmethod
    def from_json(cls, text: str) -> Timeline:
        """Reads the JSON that :meth:`to_json` writes.

        Raises:
            ConfigError: ``text`` is not a pipesched timeline, or an event names
                a stage, worker or time that does not fit the placement, or
                the placement names a worker past its stage count, or there
                are more events than MAX_ACTIONS.
        """
        try:
            data: Any = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"timeline JSON does not parse: {error}") from None
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise ConfigError(
                f'timeline JSON needs "format": "{_FORMAT}" at its top level; this text is '
                "not a timeline written by Timeline.to_json"
            )
        if data.get("version") != _VERSION:
            raise ConfigError(
                f"timeline JSON has version {data.get('version')!r}; this pipesched reads "
                f"version {_VERSION}"
            )
        placement = data.get("placement")
        if (
            not isinstance(placement, list)
            or not placement
            or not all(type(w) is int and w >= 0 for w in placement)
        ):
            raise ConfigError(
                f"timeline JSON placement must be a non-empty list of worker indices, "
                f"got {placement!r}"
            )
        far = [w for w in placement if w >= len(placement)]
        if far:
            raise ConfigError(
                f"timeline JSON placement names worker {far[0]}, but its {len(placement)} "
                f"stages run on at most {len(placement)} workers (0..{len(placement) - 1})"
            )
        rows = data.get("events")
        if not isinstance(rows, list):
            raise ConfigError(f"timeline JSON events must be a list, got {_shown(rows)}")
        if len(rows) > MAX_ACTIONS:
            raise ConfigError(f"timeline JSON has {len(rows)} events, more than {limit_text()}")
        breakdown = data.get("breakdown")
        return cls(
            tuple(_event(row, placement) for row in rows),
            tuple(placement),
            None if breakdown is None else Breakdown.from_dict(breakdown),
        )

    def save(self, path: str | Path) -> Path:
        """Writes :meth:`to_json` to ``path``; returns the path."""
        path = Path(path)
        path.write_text(self.to_json(), encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Timeline:
        """Reads a timeline that :meth:`save` wrote.

        Raises:
            ConfigError: the file is not a pipesched timeline (see :meth:`from_json`).
            OSError: the file cannot be read.
        """
        try:
            return cls.from_json(Path(path).read_text(encoding="utf-8"))
        except ConfigError as error:
            raise ConfigError(f"{path}: {error}") from None
        except UnicodeDecodeError:
            raise ConfigError(
                f"{path} is not a pipesched timeline: it is not text (a picture, a "
                "checkpoint?); give the JSON file Timeline.save or `pipesched trace` wrote"
            ) from None


def _shown(value: object) -> str:
    """``repr(value)``, cut to 80 characters for an error message."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _event(row: Any, placement: list[int]) -> Event:
    """One ``[action, worker, start, end]`` row of the JSON, checked against ``placement``."""
    if not (
        isinstance(row, list)
        and len(row) == 4
        and isinstance(row[0], str)
        and type(row[1]) is int
        and all(isinstance(x, int | float) and not isinstance(x, bool) for x in row[2:])
    ):
        raise ConfigError(
            f"timeline JSON event {_shown(row)} is not [action, worker, start, end], "
            'e.g. ["2F0", 1, 0.5, 1.25]'
        )
    try:
        action = Action.parse(row[0])
    except ScheduleError as error:
        raise ConfigError(f"timeline JSON event {_shown(row)}: {error}") from None
    if action.stage >= len(placement) or placement[action.stage] != row[1]:
        where = f"worker {placement[action.stage]}" if action.stage < len(placement) else "none"
        raise ConfigError(
            f"timeline JSON event {row!r} puts stage {action.stage} on worker {row[1]}, but "
            f"the placement {placement} says {where}"
        )
    if not row[2] <= row[3]:
        raise ConfigError(f"timeline JSON event {row!r} ends before it starts")
    return Event(action, row[1], row[2], row[3])
