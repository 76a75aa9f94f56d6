"""StepModel and predict: costs measured from hand-made timelines, and the step played back."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipesched.analysis.prediction import StepModel, predict
from pipesched.schedule import (
    SCHEDULES,
    Action,
    Costs,
    Event,
    Schedule,
    Timeline,
    get_schedule,
)
from pipesched.schedule.breakdown import PARTS, Breakdown
from tests.list_scheduler import play

F, B, OVERHEAD, LATENCY = 1.0, 2.0, 0.1, 0.5


def _measured() -> Timeline:
    """GPipe, 2 stages on 2 workers, 2 micro-batches: F 1, B 2, a 0.1 gap before each
    action whose input is there, 0.5 from a producer's end to its consumer on the other worker.
    """
    a = Action.parse
    rows = [
        ("0F0", 0, 0.1),  # first action: its worker's gap
        ("0F1", 0, 1.2),  # 1.1 + 0.1
        ("1F0", 1, 1.6),  # waits for 0F0: 1.1 + 0.5
        ("1F1", 1, 2.7),  # 2.6 + 0.1 (0F1 arrived at 2.2 + 0.5 = 2.7 too)
        ("1B0", 1, 3.8),
        ("1B1", 1, 5.9),
        ("0B0", 0, 6.3),  # waits for 1B0: 5.8 + 0.5
        ("0B1", 0, 8.4),  # 8.3 + 0.1 = 7.9 + 0.5
    ]
    events = [
        Event(a(name), w, start, start + (F if "F" in name else B)) for name, w, start in rows
    ]
    return Timeline(tuple(events), (0, 1))


def test_costs_measured_from_a_hand_made_timeline():
    model = StepModel.measure(_measured(), checkpoint_stop=0, outside=0.25)
    assert model.passes["F"] == pytest.approx((F, F))
    assert model.passes["B"] == pytest.approx((B, B))
    assert model.passes["W"] == (0.0, 0.0)
    assert model.overhead == pytest.approx((OVERHEAD, OVERHEAD))
    assert model.latency == pytest.approx(LATENCY)
    assert model.outside == 0.25


def test_latency_counts_consumers_whose_producer_ended_just_before_their_worker_was_free():
    """1F1's producer ends at 2.0, before worker 1 is free (2.3), yet 1F1 starts at 2.8: its
    transfer took longer than 1F0's (0.2). The latency is the one with which the model's
    starts ``max(previous end + overhead, producer's end + latency)`` of the consumers fed
    from worker 0 add up to the measured ones: (1 + L - 1.2) + (2 + L - 2.8) = 0, L = 0.5
    (the waits of the consumers whose producer ended after their worker was free, 1F0's
    alone, would say 0.2 and predict 1F1 at 2.3)."""
    a = Action.parse
    rows = [
        ("0F0", 0, 0.0, 1.0),
        ("0F1", 0, 1.0, 2.0),
        ("0F2", 0, 2.0, 3.0),
        ("0F3", 0, 3.0, 4.0),
        ("1F0", 1, 1.2, 2.3),  # its producer ended at 1.0: waited 0.2
        ("1F1", 1, 2.8, 3.9),  # its producer ended at 2.0, before 2.3: waited 0.8
        ("1F2", 1, 3.9, 5.0),  # there already: no gap
        ("1F3", 1, 5.0, 6.1),
    ]
    timeline = Timeline(tuple(Event(a(n), w, s, e) for n, w, s, e in rows), (0, 1))
    model = StepModel.measure(timeline, checkpoint_stop=0)
    assert model.overhead == pytest.approx((0.0, 0.0))
    assert model.latency == pytest.approx(0.5)


def test_predicted_makespan_is_the_hand_computed_one():
    measured = _measured()
    model = StepModel.measure(measured, checkpoint_stop=0, outside=0.25)
    predicted = predict(get_schedule("gpipe", 2, 2), model, checkpoint_stop=0)
    # worker 1 ends at 1.6 (0F0 + latency) + 2 F + 2 B + 3 gaps = 7.9; 0B1 at 7.9 + 0.5 + 2.
    assert predicted.makespan == pytest.approx(10.4 - 0.1)
    assert predicted.step_time == pytest.approx(10.3 + 0.25)
    got = {e.action: (e.start, e.end) for e in predicted.events}
    for e in measured.events:
        assert got[e.action] == pytest.approx((e.start, e.end))


def test_recomputation_is_the_checkpointed_micro_batches_extra_backward():
    a = Action.parse
    events = [  # 1 stage, 3 micro-batches, the first two checkpointed: their B is 0.75 longer
        Event(a("0F0"), 0, 0.0, 1.0),
        Event(a("0B0"), 0, 1.0, 3.75),
        Event(a("0F1"), 0, 3.75, 4.75),
        Event(a("0B1"), 0, 4.75, 7.5),
        Event(a("0F2"), 0, 7.5, 8.5),
        Event(a("0B2"), 0, 8.5, 10.5),
    ]
    model = StepModel.measure(Timeline(tuple(events), (0,)), checkpoint_stop=2)
    assert model.passes["B"] == (2.0,)
    assert model.recompute["B"] == (0.75,)
    for k, stop in ((3, 2), (5, 4), (1, 0)):  # except_last at other sizes
        t = predict(get_schedule("gpipe", 1, k), model, checkpoint_stop=stop)
        assert t.makespan == pytest.approx(3.0 * k + 0.75 * stop)
        assert t.breakdown is not None and t.breakdown.idle == pytest.approx(0.0)


def test_only_checkpointed_micro_batches_take_the_forward_as_recomputation():
    a = Action.parse
    events = [Event(a("0F0"), 0, 0.0, 1.0), Event(a("0B0"), 0, 1.0, 4.0)]
    model = StepModel.measure(Timeline(tuple(events), (0,)), checkpoint_stop=1)
    assert (model.passes["B"], model.recompute["B"]) == ((2.0,), (1.0,))


def test_a_split_backward_recomputes_in_b_only() -> None:
    # B's recomputation stashes what W needs (runtime/deferred.py): W adds no forward.
    for split in (False, True):
        again = StepModel.recomputation([1.0, 2.0, 3.0], split_backward=split)
        assert again == {"F": (0.0,) * 3, "B": (1.0, 2.0, 3.0), "W": (0.0,) * 3}


def test_pairs_run_as_one_whole_backward_are_measured_and_played_as_such() -> None:
    """zb-v runs most pairs of stages 0 and 2 as one whole backward (2, cheaper than B + W =
    1.25 + 1): measured apart from the split ones, and played back to the instant."""
    schedule = get_schedule("zb-v", 4, 4)
    whole = schedule.whole_backwards
    assert {s for s, _ in whole} == {0, 2} and (2, 3) not in whole

    def cost(s: int, kind: str, i: int) -> float:
        if (s, i) in whole and kind != "F":
            return 2.0 if kind == "B" else 0.0
        return {"F": 1.0, "B": 1.25, "W": 1.0}[kind]

    measured = play(schedule, cost)
    model = StepModel.measure(measured, checkpoint_stop=0, whole=whole)
    assert model.whole == pytest.approx((2.0, 2.25, 2.0, 2.25))  # stage 0 measured B as whole
    assert model.passes["B"] == pytest.approx((2.0, 1.25, 1.25, 1.25))
    assert model.passes["W"] == pytest.approx((0.0, 1.0, 1.0, 1.0))
    predicted = predict(schedule, model, checkpoint_stop=0)
    got = {e.action: (e.start, e.end) for e in predicted.events}
    for e in measured.events:
        assert got[e.action] == pytest.approx((e.start, e.end))
    split = predict(schedule, replace(model, whole=()), checkpoint_stop=0)
    assert split.makespan > predicted.makespan  # B + W where it ran whole: longer


def _schedule(name: str, m: int) -> Schedule:
    """4 stages: on 2 workers for the schedules with 2 stages per worker, else on 4."""
    return get_schedule(name, 4, m)


def _model(num_stages: int, num_workers: int, *, split: bool, gaps: bool) -> StepModel:
    forward = tuple(1.0 + 0.25 * s for s in range(num_stages))
    backward = tuple(2.0 - 0.25 * s for s in range(num_stages))
    model = StepModel.from_stage_times(
        forward, backward, num_workers, split_backward=split, source="test"
    )
    if gaps:
        return StepModel(model.passes, model.recompute, (0.05,) * num_workers, 0.3, 1.0, "test")
    return model


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("m", [2, 4, 8])
def test_without_overhead_predict_scales_as_the_simulator(name, m):
    schedule = _schedule(name, m)
    model = _model(4, schedule.num_workers, split=schedule.split_backward, gaps=False)
    model = StepModel(model.passes, model.recompute, model.overhead, latency=0.3)
    predicted = predict(schedule, model, checkpoint_stop=0)
    p = model.passes
    costs = Costs(p["F"], p["B"], p["W"], send=0.3)
    if not schedule.split_backward:
        costs = Costs(p["F"], p["B"], 0.0, send=0.3)
    assert predicted.makespan == pytest.approx(schedule.simulate(costs).makespan)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_the_bubble_breakdown_sums_to_the_idle_time(name):
    schedule = _schedule(name, 6)
    model = _model(4, schedule.num_workers, split=schedule.split_backward, gaps=True)
    t = predict(schedule, model, checkpoint_stop=5)
    b = t.breakdown
    assert b is not None and b.source == "test" and b.outside == 1.0
    assert b.idle == pytest.approx(sum(t.idle))
    assert sum(getattr(b, part) for part in PARTS) == pytest.approx(sum(t.idle))
    uniform = {k: sum(v) / 4 for k, v in model.passes.items()}
    w = uniform["W"] if schedule.split_backward else 0.0
    ideal = schedule.simulate(Costs(uniform["F"], uniform["B"], w))
    assert b.ideal == pytest.approx(sum(ideal.idle))
    # Recomputation lengthens the step (its share of idle time may be 0: v-half's W fills it).
    assert t.makespan > predict(schedule, model, checkpoint_stop=0).makespan
    assert b.communication > 0 and b.overhead > 0
    assert t.step_time == pytest.approx(t.makespan + 1.0)


def test_a_prediction_round_trips_through_json_and_says_its_breakdown():
    t = predict(get_schedule("1f1b", 2, 4), _model(2, 2, split=False, gaps=True), 3)
    again = Timeline.from_json(t.to_json())
    assert again == t and again.breakdown == t.breakdown
    text = t.summary()
    assert "predicted step" in text and "from test" in text
    assert all(part in text for part in PARTS)
    plain = get_schedule("1f1b", 2, 4).simulate()
    assert plain.breakdown is None and Timeline.from_json(plain.to_json()) == plain
    assert "predicted" not in plain.summary()


def test_a_bad_breakdown_in_json_is_refused():
    from pipesched import ConfigError

    t = predict(get_schedule("1f1b", 2, 2), _model(2, 2, split=False, gaps=False), 0)
    text = t.to_json().replace('"source": "test"', '"source": 3')
    with pytest.raises(ConfigError, match="breakdown"):
        Timeline.from_json(text)
    with pytest.raises(ConfigError, match="keys"):
        Breakdown.from_dict({"ideal": 1.0})


def test_varying_like_actions_are_played_from_their_spread_reproducibly():
    measured = _measured()
    uneven = Timeline(  # the same step, each worker's second F and first B 40% longer
        tuple(
            e._replace(end=e.start + 1.4 * e.duration) if e.action.microbatch == 1 else e
            for e in measured.events
        ),
        measured.placement,
    )
    model = StepModel.measure(uneven, checkpoint_stop=0)
    assert sorted(model.spread["F"][0]) == pytest.approx([2 / 2.4, 2.8 / 2.4])
    first = predict(get_schedule("1f1b", 2, 6), model, checkpoint_stop=0)
    again = predict(get_schedule("1f1b", 2, 6), model, checkpoint_stop=0)
    assert first == again  # seeded: every rank of a mesh gets the same step
    b = first.breakdown
    assert b is not None and b.variability != 0
    assert b.idle == pytest.approx(sum(first.idle))
    steady = StepModel(model.passes, model.recompute, model.overhead, model.latency)
    plain = predict(get_schedule("1f1b", 2, 6), steady, checkpoint_stop=0)
    assert plain.breakdown is not None and plain.breakdown.variability == 0


def test_a_stop_per_stage_recomputes_only_on_those_stages():
    """Stage 0 checkpoints micro-batch 0 only, stage 1 none: only 0B0 pays a forward more."""
    measured = StepModel.measure(_measured(), checkpoint_stop=0)
    model = StepModel(
        measured.passes, {"F": (0.0, 0.0), "B": (F, F), "W": (0.0, 0.0)}, (0.0, 0.0), 0.0
    )
    t = predict(get_schedule("gpipe", 2, 2), model, checkpoint_stop=(1, 0))
    durations = {str(e.action): e.end - e.start for e in t.events}
    assert durations == pytest.approx(
        {"0F0": F, "0F1": F, "1F0": F, "1F1": F, "1B0": B, "1B1": B, "0B0": B + F, "0B1": B}
    )
    # Measured the other way round: the recomputation is told from stage 0's two B's alone.
    again = StepModel.measure(t, checkpoint_stop=(1, 0))
    assert again.recompute["B"][0] == pytest.approx(F)
    with pytest.raises(ValueError, match="3 values for 2 stages"):
        predict(get_schedule("gpipe", 2, 2), model, checkpoint_stop=(1, 0, 0))


def test_whole_pairs_checkpointed_or_kept_are_measured_at_one_stop_and_played_at_any() -> None:
    """except_last on zb-v: stage 0 ran every pair whole (checkpointed and kept ones), stage 2
    its checkpointed pairs whole and its kept one split. A checkpointed backward recomputes
    the forward; played at stop 0, 7 or 8 the step is the one run so."""
    m = 8
    schedule = get_schedule("zb-v", 4, m)
    whole = schedule.whole_backwards

    def costs(stop: int):
        def cost(s: int, kind: str, i: int) -> float:
            again = 1.0 if kind == "B" and i < stop else 0.0  # the forward, run again
            if (s, i) in whole and kind != "F":
                return 2.0 + again if kind == "B" else 0.0
            return {"F": 1.0, "B": 1.25, "W": 1.0}[kind] + again

        return cost

    model = StepModel.measure(play(schedule, costs(m - 1)), checkpoint_stop=m - 1, whole=whole)
    assert model.recompute["B"] == pytest.approx((1.0,) * 4)
    assert model.whole == pytest.approx((2.0, 2.25, 2.0, 2.25))
    for stop in (m - 1, 0, m):
        truth = play(schedule, costs(stop)).makespan
        assert predict(schedule, model, checkpoint_stop=stop).makespan == pytest.approx(truth)
