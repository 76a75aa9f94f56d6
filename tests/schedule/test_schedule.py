"""The Schedule record: construction, CSV, validation errors, the graph."""

from __future__ import annotations

import pytest

from pipesched import ScheduleError
from pipesched.schedule import SCHEDULES, Action, Schedule, get_schedule, stages_per_worker


def test_action_short_form_round_trips():
    for a in (Action(0, "F", 0), Action(12, "B", 7), Action(3, "W", 120)):
        assert Action.parse(str(a)) == a
    assert Action.parse(" 2 F 0 ") == Action(2, "F", 0)


@pytest.mark.parametrize("text", ["", "F0", "2X0", "2F", "-1F0", "2f0", "2F0x"])
def test_bad_short_form(text):
    with pytest.raises(ScheduleError, match="short form"):
        Action.parse(text)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_csv_round_trip(name):
    v = stages_per_worker(name)
    schedule = get_schedule(name, 3 * v, 5)
    again = Schedule.from_csv(schedule.to_csv(), name=name)
    assert again == schedule
    assert again.placement == schedule.placement


def test_from_csv_skips_comments_and_blanks():
    text = "# my schedule\n0F0,0B0,,\n\n1F0, 1B0\n"
    s = Schedule.from_csv(text)
    assert s.actions == (
        (Action(0, "F", 0), Action(0, "B", 0)),
        (Action(1, "F", 0), Action(1, "B", 0)),
    )
    assert (s.num_stages, s.num_workers, s.num_microbatches, s.name) == (2, 2, 1, "custom")


@pytest.mark.parametrize(
    "make",
    [
        lambda: Action(-1, "F", 0),  # was accepted, then "placement is empty"
        lambda: Action(0, "F", -2),
        lambda: Action(1.0, "F", 0),
        lambda: Schedule.from_lists([[Action(-1, "F", 0), Action(-1, "B", 0)]]),
    ],
)
def test_an_action_of_a_negative_or_non_int_index_is_refused_naming_it(make):
    with pytest.raises(ScheduleError, match="a stage and a micro-batch are ints >= 0"):
        make()


def test_a_schedule_takes_actions_in_the_short_form():
    """Before, Schedule((("0F0", "0B0"),), ...) failed in validate() with a bare TypeError."""
    assert Schedule((("0F0", "0B0"),), (0,), 1).validate().actions == (
        (Action(0, "F", 0), Action(0, "B", 0)),
    )


def test_from_lists_infers_placement():
    s = Schedule.from_lists([["0F0", "3F0", "3B0", "0B0"], ["1F0", "2F0", "2B0", "1B0"]])
    assert s.placement == (0, 1, 1, 0)
    assert s.virtual_stages == 2
    assert s.stages_of(1) == (1, 2)


def test_a_stage_on_two_workers_is_rejected():
    with pytest.raises(ScheduleError, match="stage 0 has actions on workers 0 and 1"):
        Schedule.from_lists([["0F0"], ["0B0"]])


def test_stage_without_actions_is_rejected():
    with pytest.raises(ScheduleError, match=r"stages \[1\] have no actions"):
        Schedule.from_lists([["0F0", "2F0", "2B0", "0B0"]])


def test_bad_placement():
    with pytest.raises(ScheduleError, match=r"names workers \[2\]"):
        Schedule(((), ()), (0, 2), 1)
    with pytest.raises(ScheduleError, match=r"workers \[1\] run no stage"):
        Schedule(((), ()), (0, 0), 1)


def test_missing_and_duplicated_actions_are_listed_with_the_table():
    s = Schedule.from_lists([["0F0", "0F1", "0B0", "0B0"], ["1F0", "1F1", "1B0", "1B1"]])
    with pytest.raises(ScheduleError) as info:
        s.validate()
    message = str(info.value)
    assert "duplicated: 0B0" in message
    assert "missing: 0B1" in message
    assert "worker 0: 0F0 0F1 0B0 0B0" in message


def test_missing_weight_pass_once_any_w_appears():
    s = Schedule.from_lists([["0F0", "0B0", "0W0", "0F1", "0B1"]])
    with pytest.raises(ScheduleError, match="missing: 0W1"):
        s.validate()


def test_out_of_range_and_misplaced():
    s = Schedule(
        ((Action(0, "F", 0), Action(0, "B", 0), Action(1, "F", 0)), (Action(1, "B", 0),)), (0, 1), 1
    )
    with pytest.raises(ScheduleError, match="1F0: on worker 0, but stage 1 is placed on worker 1"):
        s.validate()
    s = Schedule(((Action(0, "F", 0), Action(0, "B", 0), Action(0, "F", 5)),), (0,), 1)
    with pytest.raises(ScheduleError, match="0F5: out of range"):
        s.validate()


def test_deadlock_names_the_cycle():
    # Stage 0 waits for 0B0 before sending 0F1; stage 1 wants 1F1 before 1B0.
    s = Schedule.from_lists([["0F0", "0B0", "0F1", "0B1"], ["1F0", "1F1", "1B0", "1B1"]])
    with pytest.raises(ScheduleError) as info:
        s.validate()
    message = str(info.value)
    assert "deadlocks on the cycle" in message
    for action in ("0F1", "1F1", "1B0", "0B0"):
        assert action in message
    assert "worker 1 runs 1F1 before 1B0" in message
    assert "worker 1: 1F0 1F1 1B0 1B1" in message


def test_graph_edges():
    s = get_schedule("1f1b", 2, 2)
    g = s.graph()
    a = Action.parse
    assert g.edges[a("0F0"), a("1F0")] == {"kind": "data", "send": True}
    assert g.edges[a("1F0"), a("1B0")] == {"kind": "data", "send": False}
    assert g.edges[a("1B0"), a("0B0")]["send"] is True
    assert g.edges[a("0F0"), a("0F1")] == {"kind": "order", "send": False}
    assert g.nodes[a("1B1")]["worker"] == 1
    assert g.number_of_nodes() == 8
    with pytest.raises(Exception, match="Frozen"):
        g.add_edge(a("0F0"), a("1B1"))


def test_graph_split_backward_edges():
    g = get_schedule("zb-h1", 2, 1).graph()
    a = Action.parse
    assert g.edges[a("1B0"), a("1W0")]["kind"] == "data"
    assert g.edges[a("1B0"), a("0B0")]["kind"] == "data"


def test_str_is_the_order_table():
    assert str(get_schedule("gpipe", 2, 1)) == (
        "gpipe: 2 stages on 2 workers, 1 micro-batches\nworker 0: 0F0 0B0\nworker 1: 1F0 1B0"
    )


@pytest.mark.parametrize("name", ["1f1b", "zb-v"])
def test_order_is_every_action_once_each_after_its_dependencies(name):
    schedule = get_schedule(name, 4, 6)
    order = schedule.order()
    assert sorted(order) == sorted(a for worker in schedule.actions for a in worker)
    position = {a: i for i, a in enumerate(order)}
    graph = schedule.graph()
    assert all(position[u] < position[v] for u, v in graph.edges)


@pytest.mark.parametrize("change", ["deadlock", "missing"])
def test_a_schedule_changed_with_replace_is_validated_afresh(change: str) -> None:
    """dataclasses.replace carried the validated order over: a broken copy passed."""
    import dataclasses

    good = Schedule.from_csv("0F0,0F1,0B0,0F2,0B1,0B2\n1F0,1B0,1F1,1B1,1F2,1B2\n").validate()
    good.simulate()  # fills the transfer plan too
    if change == "deadlock":
        rows = Schedule.from_csv("0F0,0F1,0B2,0F2,0B1,0B0\n1F0,1B0,1F1,1B1,1F2,1B2\n").actions
        match = "deadlocks on the cycle"
    else:
        rows = (good.actions[0][:-1], good.actions[1])
        match = "cannot run"
    changed = dataclasses.replace(good, actions=rows)
    for check in (changed.validate, changed.simulate, changed.order):
        with pytest.raises(ScheduleError, match=match):
            check()
