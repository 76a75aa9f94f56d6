"""Properties of every built schedule over random (p, m, v), drawn by hypothesis."""

from __future__ import annotations

import itertools
import random

import networkx as nx
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesched import ScheduleError
from pipesched.schedule import SCHEDULES, Schedule, get_schedule, stages_per_worker

# The schedules whose backward is split into B and W, every (stage, micro-batch) having both.
SPLIT_BACKWARD = {"zb-h1", "zb-v", "zb-h2", "dualpipev", "v-half", "v-min"}


@st.composite
def schedules(draw) -> Schedule:
    name = draw(st.sampled_from(sorted(SCHEDULES)))
    workers = draw(st.integers(1, 8))
    m = draw(st.integers(1, 24))
    options = {}
    if name == "interleaved-1f1b":
        options["virtual_stages"] = draw(st.integers(1, 4))
    v = stages_per_worker(name, **options)
    return get_schedule(name, workers * v, m, **options)


@settings(max_examples=300, deadline=None)
@given(schedules())
def test_every_schedule_is_a_complete_dag(schedule):
    graph = schedule.graph()
    assert nx.is_directed_acyclic_graph(graph)
    kinds = "FBW" if schedule.name in SPLIT_BACKWARD else "FB"
    expected = {
        (s, k, i)
        for s in range(schedule.num_stages)
        for i in range(schedule.num_microbatches)
        for k in kinds
    }
    actions = [a for row in schedule.actions for a in row]
    assert len(actions) == len(expected) == len(set(actions))
    assert set(actions) == expected
    for w, row in enumerate(schedule.actions):
        assert all(schedule.placement[a.stage] == w for a in row)
    schedule.validate()


@settings(max_examples=200, deadline=None)
@given(schedules())
def test_forward_before_backward_before_weight(schedule):
    t = schedule.simulate()
    start = {e.action: e.start for e in t.events}
    end = {e.action: e.end for e in t.events}
    for (s, kind, i), t0 in start.items():
        if kind == "B":
            assert end[(s, "F", i)] <= t0
        if kind == "W":
            assert end[(s, "B", i)] <= t0
    # One worker never runs two actions at once.
    for w in range(t.num_workers):
        events = t.worker_events(w)
        assert all(a.end <= b.start for a, b in itertools.pairwise(events))


@settings(max_examples=200, deadline=None)
@given(schedules(), st.randoms(use_true_random=False))
def test_validate_agrees_with_networkx_on_shuffled_orders(schedule, rnd: random.Random):
    # Swap two actions of one worker: sometimes still runnable, sometimes a deadlock.
    rows = [list(r) for r in schedule.actions]
    row = rows[rnd.randrange(len(rows))]
    i, j = rnd.randrange(len(row)), rnd.randrange(len(row))
    row[i], row[j] = row[j], row[i]
    shuffled = Schedule(tuple(map(tuple, rows)), schedule.placement, schedule.num_microbatches)
    acyclic = nx.is_directed_acyclic_graph(shuffled.graph())
    try:
        shuffled.validate()
    except ScheduleError as error:
        assert not acyclic
        assert "deadlocks on the cycle" in str(error)
    else:
        assert acyclic
