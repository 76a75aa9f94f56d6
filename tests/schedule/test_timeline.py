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


# Saving and loading: JSON that round-trips every time bit for bit.


def test_json_round_trips_exactly(tmp_path):
    from pipesched.schedule import Costs, get_schedule

    plan = get_schedule("zb-v", 4, 3).simulate(Costs(0.1, 0.7, 1 / 3, send=0.01))
    assert Timeline.from_json(plan.to_json()) == plan
    measured = _timeline()
    back = Timeline.load(measured.save(tmp_path / "run.json"))
    assert back == measured
    assert [e.start for e in back.events] == [e.start for e in measured.events]
    assert Timeline.from_json(Timeline((), (0, 1)).to_json()) == Timeline((), (0, 1))


def test_json_keeps_awkward_floats():
    a = Action.parse
    times = [1e-9, 0.1 + 0.2, 123456.789012345, 5e-324, 2.0**-30]
    events = tuple(Event(a(f"0F{i}"), 0, t, t * 3) for i, t in enumerate(times))
    back = Timeline.from_json(Timeline(events, (0,)).to_json())
    assert [(e.start, e.end) for e in back.events] == [(t, t * 3) for t in times]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "does not parse"),
        ('{"events": []}', '"format": "pipesched.timeline"'),
        ('{"format": "pipesched.timeline", "version": 9}', "version 9"),
        ('{"format": "pipesched.timeline", "version": 1, "placement": []}', "placement"),
        (
            '{"format": "pipesched.timeline", "version": 1, "placement": [0], "events": [["0F0"]]}',
            r"not \[action, worker, start, end\]",
        ),
        (
            '{"format": "pipesched.timeline", "version": 1, "placement": [0, 1], '
            '"events": [["1F0", 0, 0.0, 1.0]]}',
            "puts stage 1 on worker 0",
        ),
        (
            '{"format": "pipesched.timeline", "version": 1, "placement": [0], '
            '"events": [["0X0", 0, 0.0, 1.0]]}',
            "short form",
        ),
        (
            '{"format": "pipesched.timeline", "version": 1, "placement": [0], '
            '"events": [["0F0", 0, 2.0, 1.0]]}',
            "ends before it starts",
        ),
    ],
)
def test_json_errors_name_the_problem(text, message):
    from pipesched.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        Timeline.from_json(text)


def test_json_refuses_non_finite_times(tmp_path):
    from pipesched.errors import ConfigError

    t = Timeline((Event(Action.parse("0F0"), 0, 0.0, float("inf")),), (0,))
    with pytest.raises(ConfigError, match="only finite times"):
        t.to_json()
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(ConfigError, match=r"bad\.json: .*format"):
        Timeline.load(tmp_path / "bad.json")
    (tmp_path / "picture.png").write_bytes(b"\x89PNG\r\n\x1a\n")  # was a UnicodeDecodeError
    with pytest.raises(ConfigError, match=r"picture\.png is not a pipesched timeline"):
        Timeline.load(tmp_path / "picture.png")
