"""synthesize and lower_bound with a memory limit in bytes: stages that hold different amounts.

Costs and sizes are multiples of 0.25 or integers so every sum is exact in
floating point.
"""

from __future__ import annotations

import importlib.util

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesched.analysis import lower_bound, synthesize
from pipesched.analysis.bound import stage_costs, synth_placement
from pipesched.analysis.heuristic import Player, Problem
from pipesched.analysis.memory_cap import memory_cap
from pipesched.analysis.synthesize import peak_memory
from pipesched.errors import ConfigError, ConfigTypeError
from pipesched.schedule import Costs, get_schedule
from tests.analysis.test_synthesize import EFFORT, QUARTERS, in_order_rows

has_ortools = importlib.util.find_spec("ortools") is not None


@st.composite
def byte_cases(draw):
    """(workers, micro-batches, stages per worker, costs, bytes per stage, limit per worker)."""
    v = draw(st.sampled_from((1, 2)))
    p = draw(st.integers(1, 3))
    m = draw(st.integers(1, 6))
    n = p * v
    costs = [Costs(draw(QUARTERS), draw(QUARTERS), draw(QUARTERS)) for _ in range(n)]
    sizes = [draw(st.integers(0, 4)) for _ in range(n)]
    sizes[-1] *= draw(st.sampled_from((1, 10)))  # a head holding its logits
    placement = synth_placement(p, v)
    least = [sum(sizes[s] for s in range(n) if placement[s] == w) for w in range(p)]
    limit = [x * draw(st.sampled_from((1, 1.5, 2, 4))) + draw(st.integers(0, 3)) for x in least]
    return p, m, v, costs, sizes, limit


@settings(max_examples=30, deadline=None)
@given(byte_cases())
def test_a_schedule_made_for_bytes_holds_no_more_than_each_worker_s_limit(case):
    p, m, v, costs, sizes, limit = case
    made = synthesize(
        p, m, costs, stages_per_worker=v, memory_limit=limit, stage_memory=sizes, effort=EFFORT
    )
    made.validate()
    resolved = stage_costs(costs, p * v).as_costs()
    held = peak_memory(made, resolved, stage_memory=sizes)
    assert all(h <= x for h, x in zip(held, limit, strict=True))
    bound = lower_bound(p, m, costs, stages_per_worker=v, memory_limit=limit, stage_memory=sizes)
    assert lower_bound(p, m, costs, stages_per_worker=v) <= bound
    assert bound <= made.simulate(resolved).makespan
    for name in ("zb-h1",) if v == 1 else ("zb-v",):  # never slower than a built-in that fits
        try:
            built = get_schedule(name, p * v, m)
        except ConfigError:
            continue
        held = peak_memory(built, resolved, stage_memory=sizes)
        if all(h <= x for h, x in zip(held, limit, strict=True)):
            assert made.simulate(resolved).makespan <= built.simulate(resolved).makespan


@settings(max_examples=10, deadline=None)
@given(f=QUARTERS, b=QUARTERS, w=QUARTERS, sizes=st.tuples(st.integers(1, 3), st.integers(1, 3)))
def test_the_bound_in_bytes_is_below_every_order_that_fits_on_two_workers(f, b, w, sizes):
    costs = Costs(f, b, w)
    limit = [sizes[0] * 1.5, sizes[1]]  # worker 0 holds one and a half, worker 1 one
    problem = Problem(synth_placement(2, 1), 2, stage_costs(costs, 2), (3, 2), (2, 2))
    player = Player(problem)  # in halves of a size, the same cap as ``limit``
    rows = [in_order_rows(problem, worker) for worker in (0, 1)]
    best = min(player.makespan([a, c]) for a in rows[0] for c in rows[1])
    assert lower_bound(2, 2, costs, memory_limit=limit, stage_memory=sizes) <= best < float("inf")


def test_equal_sizes_in_bytes_mean_what_micro_batches_of_a_share_mean():
    costs = Costs(0.5, 1.0, 0.75)
    for v, limit in ((1, 3), (2, 3), (2, 1.5)):
        shares = synthesize(4, 8, costs, stages_per_worker=v, memory_limit=limit, effort=EFFORT)
        in_bytes = synthesize(
            4,
            8,
            costs,
            stages_per_worker=v,
            memory_limit=limit * v * 7.0,
            stage_memory=[7.0] * (4 * v),
            effort=EFFORT,
        )
        assert shares.actions == in_bytes.actions
        assert lower_bound(4, 8, costs, stages_per_worker=v, memory_limit=limit) == lower_bound(
            4, 8, costs, stages_per_worker=v, memory_limit=limit * v, stage_memory=[1] * (4 * v)
        )


def test_a_heavy_head_in_bytes_beats_counting_every_stage_as_the_heaviest():
    # A V on 2 workers: the last stage (worker 0's way up) holds 10 units a micro-batch, the
    # others 1. Counted as micro-batches of the heaviest stage, worker 0 may hold 1 of its
    # whole share: the V runs one micro-batch at a time. In bytes, its small stage can run
    # ahead while the head's micro-batches finish one by one.
    costs = Costs(1, 1, 1)
    sizes = [1, 1, 1, 10]
    limit = [14, 14]
    in_bytes = synthesize(2, 8, costs, stages_per_worker=2, memory_limit=limit, stage_memory=sizes)
    share = 14 / (2 * 10)  # what the old conversion allowed: 0.7, below 1, so at least 1
    coarse = synthesize(2, 8, costs, stages_per_worker=2, memory_limit=max(1, share))
    assert max(peak_memory(in_bytes, costs, stage_memory=sizes)) <= 14
    assert in_bytes.simulate(costs).makespan < coarse.simulate(costs).makespan
    bound = lower_bound(2, 8, costs, stages_per_worker=2, memory_limit=limit, stage_memory=sizes)
    assert bound <= in_bytes.simulate(costs).makespan


def test_memory_limits_per_worker_and_their_errors():
    placement = synth_placement(2, 2)
    cap = memory_cap([5, 9], [1, 2, 3, 4], placement, 4)
    assert cap is not None and cap.capacity == (5, 9) and cap.sizes == (1, 2, 3, 4)
    assert cap.slots() == ((5, 9), (1, 2, 3, 4))  # whole numbers (bytes) are kept
    halves = memory_cap([5, 9], [0.5, 2, 3, 4], placement, 4)
    assert halves is not None and halves.slots() == ((1250, 2250), (125, 500, 750, 1000))
    assert memory_cap(None, [1, 2, 3, 4], placement, 4) is None
    with pytest.raises(
        ConfigError, match=r"memory_limit=4 for worker 0 is below the minimum .*, 5"
    ):
        synthesize(2, 4, Costs(), stages_per_worker=2, memory_limit=4, stage_memory=[1, 2, 3, 4])
    with pytest.raises(ConfigError, match="stage_memory has 3 entries; give one per stage"):
        synthesize(2, 4, Costs(), memory_limit=4, stage_memory=[1, 2, 3])
    with pytest.raises(ConfigError, match="memory_limit has 3 entries; give one per worker"):
        lower_bound(2, 4, Costs(), memory_limit=[4, 4, 4])
    with pytest.raises(ConfigError, match="stage_memory must be finite and >= 0"):
        lower_bound(2, 4, Costs(), memory_limit=4, stage_memory=[1, -1])
    with pytest.raises(ConfigTypeError, match="stage_memory must be a number or a list"):
        lower_bound(2, 4, Costs(), memory_limit=4, stage_memory=[1, "2"])  # type: ignore[list-item]
    # At the minimum but for the synthesizer's rounding (units of 10 / 1000): it says how much.
    with pytest.raises(ConfigError, match="within rounding of one micro-batch .* needs 11.01"):
        synthesize(
            2,
            4,
            Costs(),
            stages_per_worker=2,
            memory_limit=11.0004,
            stage_memory=[1.0004, 1, 1, 10],
        )
    with pytest.raises(ConfigTypeError, match="memory_limit must be a number"):
        synthesize(2, 2, Costs(), memory_limit="4")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="stage_memory has 2 entries; give one per stage"):
        peak_memory(get_schedule("zb-v", 4, 8), stage_memory=[1, 1])
    free = synthesize(2, 4, Costs(), memory_limit=[2, 3], stage_memory=[0, 0])  # holds nothing
    assert free.simulate().makespan == synthesize(2, 4, Costs()).simulate().makespan


@pytest.mark.skipif(not has_ortools, reason="needs OR-Tools: pip install 'pipesched[solver]'")
def test_the_exact_solver_keeps_each_worker_within_its_bytes():
    costs, sizes, limit = Costs(1, 1, 1), [1, 1, 1, 10], [14, 12]
    made = synthesize(
        2,
        4,
        costs,
        stages_per_worker=2,
        memory_limit=limit,
        stage_memory=sizes,
        solver="exact",
        time_limit=5,
    )
    held = peak_memory(made, costs, stage_memory=sizes)
    assert held[0] <= 14 and held[1] <= 12
    bound = lower_bound(2, 4, costs, stages_per_worker=2, memory_limit=limit, stage_memory=sizes)
    assert bound <= made.simulate(costs).makespan


@pytest.mark.parametrize("m", [1, 2, 8])
def test_a_limit_that_cannot_bind_is_no_limit_whatever_the_rounding(m):
    # Sizes far apart: the small stage is a fraction of a unit (largest / 1000). A limit
    # above everything a worker could hold must not be refused for rounding.
    plain = synthesize(2, m, Costs(), effort=EFFORT).simulate().makespan
    for limit in (float("inf"), 1e9):
        made = synthesize(2, m, Costs(), memory_limit=limit, stage_memory=[1.5, 0.0001])
        assert made.simulate().makespan == plain
    made = synthesize(3, 1, Costs(), memory_limit=1e9, stage_memory=[0.1, 0.62, 0.987])
    assert made.simulate().makespan == synthesize(3, 1, Costs()).simulate().makespan
