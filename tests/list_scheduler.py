"""An independent list scheduler for tests: each action as early as its worker and data allow."""

from __future__ import annotations

from collections.abc import Callable

from pipesched.schedule import Event, Schedule, Timeline


def play(schedule: Schedule, cost: Callable[[int, str, int], float]) -> Timeline:
    """``schedule`` with ``cost(stage, kind, microbatch)`` per action, no gaps or latency:
    written apart from the library's simulator and predictor, to check them against."""
    last = schedule.num_stages - 1
    end: dict[tuple[int, str, int], float] = {}
    free = [0.0] * schedule.num_workers
    position = [0] * schedule.num_workers
    events: list[Event] = []
    while len(events) < sum(map(len, schedule.actions)):
        for w, row in enumerate(schedule.actions):
            while position[w] < len(row):
                action = row[position[w]]
                s, kind, i = action.stage, str(action.kind), action.microbatch
                need = {
                    "F": [(s - 1, "F", i)] if s else [],
                    "B": [(s, "F", i)] + ([(s + 1, "B", i)] if s < last else []),
                    "W": [(s, "B", i)],
                }[kind]
                if any(n not in end for n in need):
                    break
                start = max([free[w], *(end[n] for n in need)])
                end[s, kind, i] = free[w] = start + cost(s, kind, i)
                events.append(Event(action, w, start, free[w]))
                position[w] += 1
    return Timeline(tuple(events), schedule.placement)
