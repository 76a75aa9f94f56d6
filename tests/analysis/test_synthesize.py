"""synthesize and lower_bound: valid schedules within the memory limit, a bound nothing beats.

Costs are drawn as multiples of 0.25 so every sum is exact in floating point
and makespans compare with ``==`` and ``<=`` without tolerance.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesched.analysis import lower_bound, synthesize
from pipesched.analysis.bound import stage_costs, synth_placement
from pipesched.analysis.synthesize import peak_memory
from pipesched.errors import ConfigError, ConfigTypeError
from pipesched.schedule import SCHEDULES, Costs, get_schedule

EFFORT = 150  # local-search moves: enough for these sizes, keeps the file fast
QUARTERS = st.integers(2, 8).map(lambda k: k / 4)  # 0.5 .. 2.0 in steps of 0.25
ZERO_BUBBLE = ("zb-h1", "zb-v", "dualpipev")
has_ortools = importlib.util.find_spec("ortools") is not None


@st.composite
def cases(draw):
    """(workers, micro-batches, stages per worker, per-stage costs, memory limit)."""
    v = draw(st.sampled_from((1, 2)))
    p = draw(st.integers(1, 4))
    m = draw(st.integers(1, 8))
    stages = p * v
    costs = [Costs(draw(QUARTERS), draw(QUARTERS), draw(QUARTERS)) for _ in range(stages)]
    if draw(st.booleans()):  # a heavy last stage, as with an LM head
        last = costs[-1]
        costs[-1] = Costs(3 * last.forward, 3 * last.backward, 3 * last.weight)  # type: ignore[operator]
    limit = draw(st.sampled_from((None, 1, 2, p, 1.5)))
    return p, m, v, costs, limit


def built_ins(p: int, m: int, v: int):
    """Every built-in schedule on synthesize's placement for (p, v), split backward or not."""
    for name, builder in SCHEDULES.items():
        try:
            schedule = builder(p * v, m)
        except (ConfigError, TypeError):
            continue
        if schedule.placement == synth_placement(p, v):
            yield name, schedule


@settings(max_examples=25, deadline=None)
@given(cases())
def test_synthesized_schedule_is_complete_valid_and_within_the_memory_limit(case):
    p, m, v, costs, limit = case
    schedule = synthesize(p, m, costs, stages_per_worker=v, memory_limit=limit, effort=EFFORT)
    schedule.validate()
    assert schedule.placement == synth_placement(p, v)
    actions = sorted(a for row in schedule.actions for a in row)
    assert actions == sorted((s, k, i) for s in range(p * v) for k in "FBW" for i in range(m))
    resolved = stage_costs(costs, p * v).as_costs()
    if limit is not None:
        assert max(peak_memory(schedule, resolved)) <= limit


@settings(max_examples=25, deadline=None)
@given(cases())
def test_lower_bound_is_below_every_built_in_and_the_synthesized(case):
    p, m, v, costs, limit = case
    bound = lower_bound(p, m, costs, stages_per_worker=v)
    within = lower_bound(p, m, costs, stages_per_worker=v, memory_limit=limit)
    assert bound <= within
    resolved = stage_costs(costs, p * v).as_costs()
    for name, schedule in built_ins(p, m, v):
        makespan = schedule.simulate(resolved).makespan
        assert bound <= makespan, name
        if limit is None or max(peak_memory(schedule, resolved)) <= limit:
            assert within <= makespan, name
    schedule = synthesize(p, m, costs, stages_per_worker=v, memory_limit=limit, effort=EFFORT)
    assert within <= schedule.simulate(resolved).makespan


def in_order_rows(problem, worker: int):
    """Every order of a worker's actions that keeps each (stage, kind)'s micro-batches in order."""
    m = problem.num_microbatches
    classes = [(s, k) for s, w in enumerate(problem.placement) if w == worker for k in range(3)]

    def extend(taken: tuple[int, ...]):
        if sum(taken) == m * len(classes):
            yield []
            return
        for c, (s, k) in enumerate(classes):
            if taken[c] < m:
                rest = extend((*taken[:c], taken[c] + 1, *taken[c + 1 :]))
                yield from ([problem.number(s, k, taken[c]), *tail] for tail in rest)

    return list(extend((0,) * len(classes)))


@settings(max_examples=12, deadline=None)
@given(f=QUARTERS, b=QUARTERS, w=QUARTERS, slots=st.sampled_from((1, 2)))
def test_the_memory_bound_is_below_every_order_that_fits_on_two_workers(f, b, w, slots):
    # The independent reference: every pair of in-order worker orders (90 x 90) played.
    from pipesched.analysis.heuristic import Player, Problem

    costs = Costs(f, b, w)
    problem = Problem(synth_placement(2, 1), 2, stage_costs(costs, 2), slots)
    player = Player(problem)
    rows = [in_order_rows(problem, worker) for worker in (0, 1)]
    best = min(player.makespan([a, c]) for a in rows[0] for c in rows[1])
    bound = lower_bound(2, 2, costs, memory_limit=slots)
    assert bound <= best < float("inf")


def test_the_memory_bound_proves_zb_v_optimal_where_the_plain_bound_cannot():
    # B twice F: worker 3 holds stages 3 and 4, its first B can start at 7, and before
    # that its 8 slots take 8 forwards of 0.5: 3 units idle, so 7 + 32 - 4 = 35.
    costs = Costs(0.5, 1.0, 0.5)
    zb_v = get_schedule("zb-v", 8, 8)
    assert max(peak_memory(zb_v, costs)) == 4
    assert zb_v.simulate(costs).makespan == 35.0
    assert lower_bound(4, 8, costs, stages_per_worker=2, memory_limit=4) == 35.0
    assert lower_bound(4, 8, costs, stages_per_worker=2) == 33.5
    # One stage per worker, 1F1B's memory: worker 0 waits p F + (p-1) B = 10 for its
    # first B with 4 forwards to run: 10 + 32 - 4 = 38, zb-h1's makespan.
    heavy_b = Costs(1, 2, 1)
    assert get_schedule("zb-h1", 4, 8).simulate(heavy_b).makespan == 38.0
    assert lower_bound(4, 8, heavy_b, memory_limit=4) == 38.0
    assert lower_bound(4, 8, heavy_b) == 35.0  # zb-h2's, with twice the memory


@settings(max_examples=25, deadline=None)
@given(cases())
def test_synthesized_is_never_slower_than_a_zero_bubble_built_in_that_fits(case):
    p, m, v, costs, limit = case
    resolved = stage_costs(costs, p * v).as_costs()
    schedule = synthesize(p, m, costs, stages_per_worker=v, memory_limit=limit, effort=EFFORT)
    ours = schedule.simulate(resolved).makespan
    for name, built in built_ins(p, m, v):
        fits = limit is None or max(peak_memory(built, resolved)) <= limit
        if name in ZERO_BUBBLE and fits:
            assert ours <= built.simulate(resolved).makespan, name


@pytest.mark.parametrize("p", [2, 3, 4, 5])
@pytest.mark.parametrize("factor", [1, 2, 3])
def test_equal_costs_reach_the_zero_bubble_optimum(p, factor):
    # F = B = W and no memory limit: after the ramp of p - 1 forwards every worker is busy,
    # 3m + (p - 1) with one stage per worker (ZB-H2's value), 3m + (p - 1)/2 on a V (ZB-V's).
    m = factor * p
    one = synthesize(p, m, Costs(1, 1, 1), effort=EFFORT).simulate(Costs(1, 1, 1)).makespan
    assert one == lower_bound(p, m, Costs(1, 1, 1)) == 3 * m + p - 1
    half = Costs(0.5, 0.5, 0.5)
    vee = synthesize(p, m, half, stages_per_worker=2, effort=EFFORT).simulate(half).makespan
    assert vee == lower_bound(p, m, half, stages_per_worker=2) == 3 * m + (p - 1) / 2


def test_lower_bound_is_tight_for_zb_v_and_the_ramp():
    assert lower_bound(4, 8, Costs(0.5, 0.5, 0.5), stages_per_worker=2) == 25.5
    assert get_schedule("zb-v", 8, 8).simulate(Costs(0.5, 0.5, 0.5)).makespan == 25.5
    # One micro-batch: the bound is its critical path, F down, B back, the last W.
    assert lower_bound(3, 1, Costs(1, 2, 1, send=0.5)) == 3 + 2 * 0.5 + 6 + 2 * 0.5 + 1


def test_a_memory_limit_below_one_micro_batch_is_refused_naming_the_minimum():
    with pytest.raises(ConfigError, match=r"memory_limit=0.5 is below the minimum feasible, 1"):
        synthesize(2, 4, Costs(), memory_limit=0.5)
    with pytest.raises(ConfigTypeError, match="memory_limit must be a number"):
        synthesize(2, 4, Costs(), memory_limit=True)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"memory_limit=0 is below the minimum feasible"):
        lower_bound(2, 4, Costs(), memory_limit=0)


def test_the_least_memory_runs_one_micro_batch_at_a_time_per_worker():
    for v in (1, 2):
        schedule = synthesize(3, 4, Costs(), stages_per_worker=v, memory_limit=1)
        assert max(peak_memory(schedule)) <= 1


def test_bad_arguments_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="stages_per_worker must be 1"):
        synthesize(2, 4, Costs(), stages_per_worker=3)
    with pytest.raises(ConfigError, match="costs has 3 entries but the schedule has 2 stages"):
        synthesize(2, 4, [Costs()] * 3)
    with pytest.raises(ConfigError, match="disagree on send"):
        lower_bound(2, 4, [Costs(send=0), Costs(send=1)])
    with pytest.raises(ConfigError, match="solver must be"):
        synthesize(2, 4, Costs(), solver="magic")  # type: ignore[arg-type]


@pytest.mark.skipif(not has_ortools, reason="needs OR-Tools: pip install 'pipesched[solver]'")
@settings(max_examples=6, deadline=None)
@given(
    p=st.integers(2, 3),
    m=st.integers(2, 4),
    f=QUARTERS,
    b=QUARTERS,
    w=QUARTERS,
    limit=st.sampled_from((None, 1, 2)),
)
def test_exact_solver_lies_between_the_bound_and_the_heuristic(p, m, f, b, w, limit):
    from pipesched.analysis.exact import solve
    from pipesched.analysis.heuristic import Player, Problem

    costs = Costs(f, b, w)
    heuristic = synthesize(p, m, costs, memory_limit=limit, effort=EFFORT)
    slots = m if limit is None else limit
    problem = Problem(synth_placement(p, 1), m, stage_costs(costs, p), slots)
    result = solve(problem, time_limit=10)
    assert result is not None
    exact = Player(problem).makespan(result.rows)
    assert lower_bound(p, m, costs, memory_limit=limit) <= exact
    if result.optimal:
        assert exact <= heuristic.simulate(costs).makespan
    best = synthesize(p, m, costs, memory_limit=limit, effort=EFFORT, solver="exact")
    assert best.simulate(costs).makespan <= heuristic.simulate(costs).makespan


@pytest.mark.skipif(not has_ortools, reason="needs OR-Tools: pip install 'pipesched[solver]'")
def test_the_solver_starts_from_the_whole_hint_and_never_returns_worse_or_nothing():
    from pipesched.analysis.exact import solve
    from pipesched.analysis.heuristic import Player, Problem

    # With only start times hinted, CP-SAT found no schedule at all within 10 s
    # here (its horizon is the hint's makespan, which the heuristic made tight).
    f, b, w = 1.5795570296059311, 1.0982353133364031, 1.7372674657223495  # a worker's share
    for v, share in ((1, 1), (2, 0.5)):
        costs = Costs(share * f, share * b, share * w)
        hinted = synthesize(4, 8, costs, stages_per_worker=v, memory_limit=4)  # default effort
        problem = Problem(synth_placement(4, v), 8, stage_costs(costs, 4 * v), 4 * v)
        rows = [[problem.number(s, "FBW".index(k), i) for s, k, i in row] for row in hinted.actions]
        result = solve(problem, time_limit=2, hint=rows)
        assert result is not None, f"{v} stage(s) per worker"
        assert Player(problem).makespan(result.rows) <= hinted.simulate(costs).makespan + 1e-9


def test_the_docs_example_beats_zb_v_and_meets_the_bound():
    costs = Costs(0.5, 0.5, 1.0)  # per stage: half of a worker's share of F=1, B=1, W=2
    ours = synthesize(4, 8, costs, stages_per_worker=2, memory_limit=4)
    assert ours.name == "synthesized"
    assert ours.simulate(costs).makespan == 33.5 == lower_bound(4, 8, costs, stages_per_worker=2)
    assert get_schedule("zb-v", 8, 8).simulate(costs).makespan == 34.5
    assert max(peak_memory(ours, costs)) == 4


def test_per_stage_lists_and_a_list_of_costs_mean_the_same():
    listed = Costs([1, 1, 2], [1, 2, 2], [1, 1, 0.5], send=0.25)
    each = [Costs(1, 1, 1, 0.25), Costs(1, 2, 1, 0.25), Costs(2, 2, 0.5, 0.25)]
    assert lower_bound(3, 6, listed) == lower_bound(3, 6, each)
    a = synthesize(3, 6, listed, memory_limit=3, effort=EFFORT)
    b = synthesize(3, 6, each, memory_limit=3, effort=EFFORT)
    assert a.simulate(listed).makespan == b.simulate(listed).makespan


def test_effort_time_limit_and_odd_limits_are_checked():
    with pytest.raises(ConfigError, match="effort must be an integer >= 0"):
        synthesize(2, 4, Costs(), effort=-1)
    with pytest.raises(ConfigError, match="time_limit must be a positive number"):
        synthesize(2, 4, Costs(), time_limit=0)
    with pytest.raises(ConfigError, match="memory_limit is NaN"):
        synthesize(2, 4, Costs(), memory_limit=float("nan"))
    unlimited = synthesize(2, 4, Costs(), memory_limit=float("inf"), effort=0)
    assert unlimited.simulate().makespan == synthesize(2, 4, Costs(), effort=0).simulate().makespan


def test_the_exact_solver_without_or_tools_is_a_pipesched_error_naming_the_extra(monkeypatch):
    """Before, a bare ImportError (the one error of the package outside PipeschedError)."""
    from pipesched.errors import MissingDependencyError, PipeschedError

    monkeypatch.setitem(sys.modules, "ortools.sat.python", None)  # import fails
    with pytest.raises(MissingDependencyError, match=r"pipesched\[solver\]") as raised:
        synthesize(2, 4, Costs(1, 1, 1), solver="exact")
    assert isinstance(raised.value, ImportError) and isinstance(raised.value, PipeschedError)
