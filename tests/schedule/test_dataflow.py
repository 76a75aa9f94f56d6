"""The data-flow rule, written once: the helpers, the simulator's inlined copy, the closed Kind."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesched import ScheduleError
from pipesched.schedule import (
    BACKWARD,
    FORWARD,
    KINDS,
    SCHEDULES,
    WEIGHT,
    Action,
    Costs,
    Kind,
    Message,
    data_predecessor,
    get_schedule,
    message_in,
    message_out,
    stages_per_worker,
)


@st.composite
def schedules(draw):
    name = draw(st.sampled_from(sorted(SCHEDULES)))
    workers = draw(st.integers(1, 5))
    m = draw(st.integers(1, 9))
    v = stages_per_worker(name)
    return get_schedule(name, workers * v, m)


def _replay(schedule, costs):
    """The simulator's longest-path pass, written with the public data_predecessor."""
    duration = costs.per_stage(schedule.num_stages, split_backward=schedule.split_backward)
    end, free, starts = {}, [0.0] * schedule.num_workers, {}
    for action in schedule.validate()._cache["order"]:
        w = schedule.placement[action.stage]
        start = free[w]
        need = data_predecessor(action, schedule.num_stages)
        if need is not None:
            arrival = end[need] + (costs.send if schedule.placement[need[0]] != w else 0.0)
            start = max(start, arrival)
        end[action] = free[w] = start + duration[action.kind][action.stage]
        starts[action] = start
    return starts, end


@settings(max_examples=120, deadline=None)
@given(schedules(), st.randoms(use_true_random=False))
def test_the_simulators_inlined_rule_equals_data_predecessor(schedule, rng):
    """simulate() inlines the rule in its inner loop: it must time every action as the helper."""
    p = schedule.num_stages
    costs = Costs(
        forward=[rng.uniform(0.5, 2) for _ in range(p)],
        backward=[rng.uniform(0.5, 2) for _ in range(p)],
        weight=[rng.uniform(0.5, 2) for _ in range(p)],
        send=rng.uniform(0, 0.5),
    )
    starts, ends = _replay(schedule, costs)
    timeline = schedule.simulate(costs)
    assert len(timeline.events) == len(starts)
    for event in timeline.events:
        assert event.start == starts[event.action], event.action
        assert event.end == ends[event.action], event.action


@settings(max_examples=120, deadline=None)
@given(schedules())
def test_every_message_is_made_by_one_action_and_taken_by_the_one_it_names(schedule):
    p = schedule.num_stages
    actions = [a for row in schedule.actions for a in row]
    made = [m for a in actions if (m := message_out(a, p)) is not None]
    taken = {m: a for a in actions if (m := message_in(a, p)) is not None}
    assert sorted(made) == sorted(taken)  # each value made once, taken once
    for a in actions:
        out = message_out(a, p)
        if out is not None:
            consumer = taken[out]
            assert (consumer.stage, consumer.kind, consumer.microbatch) == (
                out.stage,
                out.kind,
                out.microbatch,
            )
            assert out.source == a.stage
            # The consumer's data predecessor is the producer: one rule, two views of it.
            assert data_predecessor(consumer, p) == a


def test_what_crosses_stages_and_what_does_not():
    p = 3
    assert message_in(Action(0, "F", 2), p) is None  # the batch itself
    assert message_in(Action(2, "F", 2), p) == Message(FORWARD, 2, 2)
    assert message_in(Action(2, "B", 2), p) is None  # the last stage starts from its loss
    assert message_in(Action(1, "B", 2), p) == Message(BACKWARD, 1, 2)
    assert message_in(Action(1, "W", 2), p) is None  # W stays on its stage
    assert message_out(Action(2, "F", 0), p) is None
    assert message_out(Action(0, "B", 0), p) is None
    assert message_out(Action(1, "W", 0), p) is None
    assert Message(FORWARD, 2, 0).source == 1 and Message(BACKWARD, 0, 0).source == 1


@pytest.mark.parametrize("kind", ["X", "f", "", "FB", 1, None])
def test_an_unknown_kind_cannot_be_built(kind):
    with pytest.raises(ScheduleError, match="is not one of 'F', 'B', 'W'"):
        Action(0, kind, 0)


def test_kinds_are_a_closed_enum_stored_as_plain_letters():
    assert set(Kind) == {Kind.F, Kind.B, Kind.W} and KINDS == (FORWARD, BACKWARD, WEIGHT)
    a = Action(2, Kind.B, 3)
    assert a == Action(2, "B", 3) == (2, "B", 3) and hash(a) == hash((2, "B", 3))
    assert type(a.kind) is str and str(a) == "2B3"
    assert pickle.loads(pickle.dumps(a)) == a
    buffer = io.BytesIO()
    torch.save([tuple(a)], buffer)  # a timeline's events, saved and loaded safely
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == [(2, "B", 3)]
