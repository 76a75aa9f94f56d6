"""The simulator against closed forms and against networkx's longest path."""

from __future__ import annotations

import networkx as nx
import pytest

from pipesched.errors import ConfigTypeError
from pipesched.schedule import Costs, Schedule, get_schedule, simulate

PM = [(p, m) for p in (1, 2, 3, 4, 5, 8) for m in (1, 2, 3, 4, 7, 8, 16, 33)]
RATIOS = [(1, 1, 1), (1, 2, 1), (2, 3, 1), (1, 1, 0.5)]  # (F, B, W)


@pytest.mark.parametrize(("F", "B", "W"), RATIOS)
@pytest.mark.parametrize(("p", "m"), PM)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, p, m, F, B, W):
    t = get_schedule(name, p, m).simulate(Costs(F, B, W))
    assert t.makespan == pytest.approx((m + p - 1) * (F + B + W), rel=1e-12)
    assert t.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(("F", "B", "W"), RATIOS)
@pytest.mark.parametrize("v", [1, 2, 3, 4])
@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in PM if m >= p])
def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1(p, m, v, F, B, W):
    t = get_schedule("interleaved-1f1b", p * v, m, virtual_stages=v).simulate(Costs(F, B, W))
    assert t.num_workers == p
    assert t.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(("F", "B", "W"), [(1, 1, 1), (2, 2, 1), (1, 2, 1), (3, 2, 1), (1, 1, 0.5)])
@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in PM if m >= p])
def test_zb_h1_idles_p_minus_1_times_f_plus_b_minus_w_per_stage(p, m, F, B, W):
    # The paper's closed form, for W no longer than F or B.
    t = get_schedule("zb-h1", p, m).simulate(Costs(F, B, W))
    assert t.idle == pytest.approx([(p - 1) * (F + B - W)] * p, rel=1e-12, abs=1e-12)
    if (F, B, W) == (1, 1, 1):
        assert t.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in PM if m >= 2 * p - 1])
def test_zb_v_idles_only_on_the_ramp(p, m):
    t = get_schedule("zb-v", 2 * p, m).simulate()
    assert t.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(("p", "m"), PM)
def test_peak_activations_closed_forms(p, m):
    assert get_schedule("gpipe", p, m).simulate().peak_activations == (m,) * p
    assert get_schedule("1f1b", p, m).simulate().peak_activations == tuple(
        min(p - s, m) for s in range(p)
    )
    assert get_schedule("zb-h1", p, m).simulate().peak_activations[0] == min(p, m)


@pytest.mark.parametrize(("p", "m"), [(2, 1), (2, 5), (4, 8), (5, 3)])
@pytest.mark.parametrize("send", [0.25, 3.0])
def test_gpipe_with_send_latency(p, m, send):
    # Forward fill (p-1)(F+send), all F and B on the last stage, backward drain (p-1)(B+send).
    F, B = 1.0, 2.0
    t = get_schedule("gpipe", p, m).simulate(Costs(F, B, 0.0, send=send))
    assert t.makespan == pytest.approx((m + p - 1) * (F + B) + 2 * (p - 1) * send, rel=1e-12)


def test_sends_between_stages_of_one_worker_are_free():
    # Stages 0 and 1 share worker 0: only 1 -> 2 and back cross workers.
    schedule = Schedule.from_lists([["0F0", "1F0", "1B0", "0B0"], ["2F0", "2B0"]])
    t = schedule.simulate(Costs(1, 1.5, 0.5, send=10.0))
    assert t.makespan == 3 * 1 + 3 * 2 + 2 * 10.0


def _reference_makespan(schedule, costs: Costs) -> float:
    """Longest path by networkx, with each action's duration on its out-edges."""
    graph = nx.DiGraph(schedule.graph())
    duration = costs.per_stage(schedule.num_stages, split_backward=schedule.split_backward)
    for u, _v, data in graph.edges(data=True):
        data["w"] = duration[u.kind][u.stage] + (costs.send if data["send"] else 0.0)
    sink = "end"
    for u in list(graph.nodes):
        graph.add_edge(u, sink, w=duration[u.kind][u.stage])
    return nx.dag_longest_path_length(graph, weight="w")


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"])
@pytest.mark.parametrize(("p", "m"), [(2, 3), (4, 4), (4, 9), (6, 5)])
def test_makespan_equals_networkx_longest_path(name, p, m):
    costs = Costs(
        forward=[1.0 + 0.1 * s for s in range(p)],
        backward=[2.0 - 0.2 * s for s in range(p)],
        weight=0.7,
        send=0.3,
    )
    schedule = get_schedule(name, p, m)
    assert simulate(schedule, costs).makespan == pytest.approx(
        _reference_makespan(schedule, costs), rel=1e-12
    )


def test_each_action_starts_after_its_worker_and_its_data():
    schedule = get_schedule("zb-v", 6, 7)
    t = schedule.simulate(Costs(1, 1.5, 0.5, send=0.2))
    end = {e.action: e.end for e in t.events}
    start = {e.action: e.start for e in t.events}
    for u, v, data in schedule.graph().edges(data=True):
        assert start[v] >= end[u] + (0.2 if data["send"] else 0.0) - 1e-12
    for w in range(t.num_workers):
        events = t.worker_events(w)
        assert [e.action for e in events] == list(schedule.actions[w])


def test_costs_that_are_not_a_costs_are_refused_by_name():
    schedule = get_schedule("1f1b", 2, 4)
    with pytest.raises(ConfigTypeError, match=r"simulate\(costs=...\) takes one Costs.*list"):
        schedule.simulate([Costs(), Costs()])  # type: ignore[arg-type]
