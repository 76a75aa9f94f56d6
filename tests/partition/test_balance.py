"""Balancing: min-max cuts against brute force, by time on real layers, schedule-aware, memory."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from pipesched import PartitionError, Pipeline
from pipesched.partition import min_max_counts, search_schedule
from pipesched.partition.balance import EXHAUSTIVE_LIMIT, bounds_of, simulate_counts
from pipesched.schedule import get_schedule


class Work(nn.Module):
    """The same small Linear applied ``reps`` times: equal parameters, time proportional to reps."""

    def __init__(self, reps: int, width: int = 256) -> None:
        super().__init__()
        self.reps = reps
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.reps):
            x = torch.tanh(self.linear(x))
        return x


def _cuts(n: int, p: int):
    for cuts in itertools.combinations(range(1, n), p - 1):
        yield [b - a for a, b in itertools.pairwise([0, *cuts, n])]


def _worst(costs: list[float], counts: list[int]) -> float:
    bounds = bounds_of(counts)
    return max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))


@settings(max_examples=60, deadline=None)
@given(
    costs=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    stages=st.integers(1, 4),
)
def test_min_max_counts_equals_brute_force(costs, stages):
    n = len(costs)
    stages = min(stages, n)
    prefix = list(itertools.accumulate(costs, initial=0))
    counts = min_max_counts(n, stages, lambda k, i, j: prefix[j] - prefix[i])
    assert len(counts) == stages and sum(counts) == n and min(counts) >= 1
    assert _worst(costs, counts) == min(_worst(costs, c) for c in _cuts(n, stages))


@pytest.mark.parametrize(("stages", "expected"), [(2, [1, 5]), (3, [1, 1, 4])])
def test_balance_by_time_cuts_where_brute_force_does(stages, expected):
    torch.manual_seed(0)
    # Equal parameters, tenfold different time. [1, 5] beats [2, 4] while a heavy
    # layer costs more than 4 light ones: a margin of 2.5x for timing noise.
    reps = [10, 10, 1, 1, 1, 1]
    model = nn.Sequential(*[Work(r) for r in reps])
    pipe = Pipeline(
        model,
        chunks=2,
        balance="time",
        example_inputs=(torch.randn(128, 256),),
        devices=["cpu"] * stages,
    )
    graph = pipe.stage_graph
    times = [
        graph.nodes[str(i)]["forward_time"] + graph.nodes[str(i)]["backward_time"]
        for i in range(len(reps))
    ]
    brute = min(_cuts(len(reps), stages), key=lambda c: _worst(times, c))
    assert pipe.balance == brute == expected
    by_params = Pipeline(nn.Sequential(*[Work(r) for r in reps]), 2, devices=["cpu"] * stages)
    assert by_params.balance != expected  # parameters alone cannot see the difference


def _passes(forward: list[float], backward: list[float], activation: list[float]):
    f, b, a = (list(itertools.accumulate(v, initial=0.0)) for v in (forward, backward, activation))
    return lambda k, i, j: (f[j] - f[i], b[j] - b[i], a[j] - a[i])


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_schedule_aware_search_equals_brute_force(name):
    forward = [1.0, 3.0, 1.0, 2.0, 5.0, 1.0, 1.0, 2.0]
    backward = [2 * f for f in forward]
    passes = _passes(forward, backward, [1.0] * 8)
    schedule = get_schedule(name, 3, 6)
    best = search_schedule(schedule, 8, passes, lambda k, i, j: 0.0, start=[3, 3, 2])
    brute = min(
        _cuts(8, 3),
        key=lambda c: simulate_counts(schedule, c, passes, lambda k, i, j: 0.0).timeline.makespan,
    )
    expected = simulate_counts(schedule, brute, passes, lambda k, i, j: 0.0).timeline.makespan
    assert best.timeline.makespan == pytest.approx(expected)


def test_hill_climbing_beyond_the_exhaustive_limit():
    n, p = 40, 5
    assert math.comb(n - 1, p - 1) > EXHAUSTIVE_LIMIT
    forward = [1.0 + (i % 7) for i in range(n)]
    passes = _passes(forward, [2 * f for f in forward], [0.0] * n)
    schedule = get_schedule("1f1b", p, 8)
    start = [36, 1, 1, 1, 1]
    best = search_schedule(schedule, n, passes, lambda k, i, j: 0.0, start=start)
    first = simulate_counts(schedule, start, passes, lambda k, i, j: 0.0).timeline.makespan
    assert best.timeline.makespan < first / 2
    for neighbour in _one_move(list(best.counts)):  # a local optimum
        score = simulate_counts(schedule, neighbour, passes, lambda k, i, j: 0.0)
        assert score.timeline.makespan >= best.timeline.makespan


def _one_move(counts: list[int]):
    for k in range(len(counts) - 1):
        for d in (-1, 1):
            moved = list(counts)
            moved[k] += d
            moved[k + 1] -= d
            if min(moved) >= 1:
                yield moved


def test_memory_budget_rules_out_the_fastest_cuts():
    forward = [1.0] * 6
    activation = [100.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # the first layer's activations are big
    passes = _passes(forward, forward, activation)
    schedule = get_schedule("1f1b", 2, 4)  # stage 0 holds 2 micro-batches, stage 1 one
    free = search_schedule(schedule, 6, passes, lambda k, i, j: 0.0, start=[3, 3])
    assert free.counts == (3, 3) and max(free.peak_memory) == 2 * 102.0
    with pytest.raises(PartitionError, match=r"smallest peak found is 200"):
        search_schedule(schedule, 6, passes, lambda k, i, j: 0.0, start=[3, 3], memory_budget=150)
    tight = search_schedule(
        schedule, 6, passes, lambda k, i, j: 0.0, start=[3, 3], memory_budget=201
    )
    assert tight.counts == (1, 5) and max(tight.peak_memory) <= 201


def test_memory_balance_knows_1f1b_holds_fewer_microbatches_on_later_stages():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    example = (torch.randn(64, 64),)  # activations dominate the parameters

    def counts(schedule: str) -> list[int]:
        pipe = Pipeline(
            model,
            4,
            devices=["cpu"] * 2,
            schedule=schedule,
            balance="memory",
            example_inputs=example,
        )
        return pipe.balance

    assert counts("gpipe") == [4, 4]
    first, last = counts("1f1b")  # stage 0 holds 2 micro-batches, stage 1 holds 1
    assert first < last


def test_schedule_balance_through_the_pipeline():
    torch.manual_seed(0)
    model = nn.Sequential(*[Work(r) for r in [6, 1, 1, 1, 1, 1, 1, 6]])
    pipe = Pipeline(
        model,
        4,
        devices=["cpu"] * 2,
        schedule="1f1b",
        balance="schedule",
        example_inputs=(torch.randn(16, 256),),
    )
    assert pipe.partition.balance == "schedule" and sum(pipe.balance) == 8
    assert pipe.partition.simulated is not None


def test_more_stages_than_cut_points():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    with pytest.raises(PartitionError, match=r"cannot cut 3 layers into 4 stages: .* 2 cut points"):
        Pipeline(model, 2, balance="params", devices=["cpu"] * 4)
