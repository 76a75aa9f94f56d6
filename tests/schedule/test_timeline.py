"""Timeline: idle time, bubble, held activations, from hand-made events."""

from __future__ import annotations

import pytest

from pipesched.schedule import Action, Event, Timeline


def _timeline() -> Timeline:
    a = Action.parse
    events = [
        Event(a("0F0"), 0, 0.0, 1.0),
        Event(a("0F1"), 0, 1.0, 2.0),
        Event(a("1F0"), 1, 1.0, 2.0),
        Event(a("1B0"), 1, 2.0, 4.0),
        Event(a("1F1"), 1, 4.0, 5.0),
        Event(a("0B0"), 0, 4.0, 6.0),
        Event(a("1B1"), 1, 5.0, 7.0),
        Event(a("0B1"), 0, 7.0, 9.0),
    ]
    return Timeline(tuple(events), (0, 1))


def test_makespan_idle_and_bubble():
    t = _timeline()
    assert t.makespan == 9.0
    assert t.busy == (6.0, 6.0)
    assert t.idle == (3.0, 3.0)
    assert t.bubble_fraction == pytest.approx(6 / 18)


def test_held_activations_over_time():
    t = _timeline()
    assert t.activations_over_time[0] == ((0.0, 1), (1.0, 2), (6.0, 1), (9.0, 0))
    # Stage 1 frees micro-batch 0 at 4.0 and takes micro-batch 1 at 4.0: never 2 at once.
    assert t.activations_over_time[1] == ((1.0, 1), (4.0, 1), (7.0, 0))
    assert t.peak_activations == (2, 1)


def test_weight_pass_releases_activations():
    a = Action.parse
    t = Timeline(
        (Event(a("0F0"), 0, 0, 1), Event(a("0B0"), 0, 1, 2), Event(a("0W0"), 0, 5, 6)), (0,)
    )
    assert t.activations_over_time[0] == ((0, 1), (6, 0))


def test_measured_timelines_start_anywhere():
    a = Action.parse
    t = Timeline((Event(a("0F0"), 0, 100.0, 101.5), Event(a("0B0"), 0, 102.0, 103.0)), (0,))
    assert t.start == 100.0
    assert t.makespan == 3.0
    assert t.idle == (0.5,)


def test_empty_timeline():
    t = Timeline((), (0, 1))
    assert t.makespan == 0.0
    assert t.bubble_fraction == 0.0
    assert t.peak_activations == (0, 0)


def test_measured_costs_are_per_stage_means():
    costs = _timeline().measured_costs(send=0.5)
    assert costs.forward == (1.0, 1.0)
    assert costs.backward == (2.0, 2.0)
    assert costs.weight == (0.0, 0.0)
    assert costs.send == 0.5
