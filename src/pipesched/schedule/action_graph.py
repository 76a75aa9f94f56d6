"""The schedule as a networkx DAG, and the checks that make it runnable."""

from __future__ import annotations

from collections import Counter
from itertools import chain, islice, pairwise
from typing import TYPE_CHECKING

import networkx as nx

from pipesched.errors import ScheduleError
from pipesched.schedule.action import BACKWARD, FORWARD, KINDS, WEIGHT, Action
from pipesched.schedule.dataflow import data_predecessor

if TYPE_CHECKING:
    from pipesched.schedule.schedule import Schedule

__all__ = ["build_graph", "check_complete", "data_predecessor", "topological_order"]

_SHOWN = 12  # actions listed in an error before "... and N more"


def build_graph(schedule: Schedule) -> nx.DiGraph:
    """The dependency graph of ``schedule``, frozen (read-only).

    Nodes are the Actions, with attribute ``worker``. Edges have attribute
    ``kind``: ``"data"`` (a result flows from one action to the next;
    ``send=True`` when it crosses workers) or ``"order"`` (consecutive actions
    of one worker). The schedule is runnable iff it is complete (checked
    first) and this graph is acyclic.

    Raises:
        ScheduleError: an action is out of range, on the wrong worker,
            duplicated or missing.
    """
    check_complete(schedule)
    graph = nx.DiGraph()
    placement = schedule.placement
    for w, row in enumerate(schedule.actions):
        graph.add_nodes_from(row, worker=w)
        graph.add_edges_from(pairwise(row), kind="order", send=False)
    # A tuple key -> its Action, so that edges join the nodes already in the graph.
    node: dict[tuple[int, str, int], Action] = {a: a for row in schedule.actions for a in row}
    local: list[tuple[Action, Action]] = []
    remote: list[tuple[Action, Action]] = []
    for action in node.values():
        pred = data_predecessor(action, schedule.num_stages)
        if pred is not None:
            same = placement[pred[0]] == placement[action.stage]
            (local if same else remote).append((node[pred], action))
    # A data edge between consecutive actions of one worker replaces the order edge.
    graph.add_edges_from(local, kind="data", send=False)
    graph.add_edges_from(remote, kind="data", send=True)
    return nx.freeze(graph)


def topological_order(schedule: Schedule) -> list[Action]:
    """An order in which every action comes after its worker's previous action and its data.

    This is a topological order of :func:`build_graph`'s graph, found without
    building it: each action has at most two predecessors (the previous action
    of its worker and its data predecessor), so playing the workers' lists
    forward like a runtime would, each worker running until it waits for
    data, is a linear-time topological sort. It is what keeps large schedules
    (p=64, m=512: 200k actions) fast to validate. The networkx graph is built
    only to report a deadlock's cycle.

    Raises:
        ScheduleError: the schedule is incomplete, or deadlocks; the message
            shows the actions on one dependency cycle and the schedule table.
    """
    check_complete(schedule)
    rows = schedule.actions
    num_stages = schedule.num_stages
    done: set[tuple[int, str, int]] = set()
    blocked: dict[tuple[int, str, int], list[int]] = {}
    position = [0] * len(rows)
    order: list[Action] = []
    ready = list(range(len(rows)))
    while ready:
        w = ready.pop()
        row, i = rows[w], position[w]
        while i < len(row):
            action = row[i]
            need = data_predecessor(action, num_stages)
            if need is not None and need not in done:
                blocked.setdefault(need, []).append(w)
                break
            done.add(action)
            order.append(action)
            i += 1
            if action in blocked:
                ready += blocked.pop(action)
        position[w] = i
    if len(order) < sum(map(len, rows)):
        raise ScheduleError(_deadlock_message(schedule))
    return order


def _deadlock_message(schedule: Schedule) -> str:
    graph = schedule.graph()
    cycle = nx.find_cycle(graph)

    def why(u: Action, v: Action) -> str:
        if graph.edges[u, v]["kind"] == "order":
            return f"worker {graph.nodes[u]['worker']} runs {u} before {v}"
        return f"{v} needs {u}'s result"

    steps = "; ".join(why(u, v) for u, v in cycle)
    return (
        f"schedule {schedule.name!r} deadlocks on the cycle "
        f"{' -> '.join(str(u) for u, _ in cycle)} -> {cycle[0][0]} ({steps}). "
        f"Reorder the workers' actions so that none waits for one that comes after it.\n"
        f"{schedule.to_text()}"
    )


def check_complete(schedule: Schedule) -> None:
    """Checks every action is in range, on its stage's worker, and present exactly once.

    Raises:
        ScheduleError: listing out-of-range, misplaced, duplicated and missing actions.
    """
    p, m = schedule.num_stages, schedule.num_microbatches
    kinds = (FORWARD, BACKWARD, WEIGHT) if schedule.split_backward else (FORWARD, BACKWARD)
    counts = Counter(chain.from_iterable(schedule.actions))
    problems: list[str] = []
    for w, row in enumerate(schedule.actions):
        for a in row:
            if a.kind not in KINDS or not 0 <= a.stage < p or not 0 <= a.microbatch < m:
                problems.append(
                    f"{a}: out of range (kinds {'/'.join(KINDS)}, stages 0..{p - 1}, "
                    f"micro-batches 0..{m - 1})"
                )
            elif schedule.placement[a.stage] != w:
                problems.append(
                    f"{a}: on worker {w}, but stage {a.stage} is placed on worker "
                    f"{schedule.placement[a.stage]}"
                )
    if not problems and len(counts) == p * m * len(kinds) == counts.total():
        return  # every action in range, none twice, so none missing
    duplicated = sorted(a for a, n in counts.items() if n > 1)
    present = sum(1 for s, k, i in counts if k in kinds and 0 <= s < p and 0 <= i < m)
    # The first missing actions, found lazily: each step of the scan passes a present
    # action or finds a missing one, so it costs the actions listed, not p * m.
    missing = list(
        islice(
            (
                Action(s, k, i)
                for s in range(p)
                for i in range(m)
                for k in kinds
                if (s, k, i) not in counts
            ),
            _SHOWN,
        )
    )
    for label, actions, total in (
        ("duplicated", duplicated, len(duplicated)),
        ("missing", missing, p * m * len(kinds) - present),
    ):
        if actions:
            shown = " ".join(str(a) for a in actions[:_SHOWN])
            more = f" ... and {total - _SHOWN} more" if total > _SHOWN else ""
            problems.append(f"{label}: {shown}{more}")
    if problems:
        detail = "\n  ".join(problems[:_SHOWN])
        note = (
            " (every stage runs F and B once per micro-batch, and W once too if any W appears)"
            if missing
            else ""
        )
        raise ScheduleError(
            f"schedule {schedule.name!r} cannot run{note}:\n  {detail}\n{schedule.to_text()}"
        )
