"""The planner's search on per-layer numbers: scores, memory, the pick, the budget."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesched.analysis.prediction import StepModel, predict
from pipesched.errors import ConfigError
from pipesched.planning import LayerCost, peak_bytes, plan_layers
from pipesched.planning.candidate import Candidate, Planning
from pipesched.planning.search import MARGIN
from pipesched.runtime.stage.recompute import stage_stops
from pipesched.schedule import get_schedule


def lm(
    blocks: int = 8, head: float = 6.0, act: float = 10.0, params: float = 100.0
) -> list[LayerCost]:
    """A language model's layers: an embedding, equal blocks, then a head ``head`` blocks heavy."""
    embed = LayerCost("embed", 0.1, 0.5, act, 4 * params, 1.0)
    body = [LayerCost(f"h.{k}", 1.0, 2.0, act, params, 1.0) for k in range(blocks)]
    return [embed, *body, LayerCost("head", head, 2 * head, 4 * act, 4 * params, 1.0)]


def test_every_candidate_is_its_schedule_played_by_predict_with_its_cut() -> None:
    layers = lm()
    planning = plan_layers(layers, 2, 6)
    assert len(planning.candidates) > 20
    for c in planning.candidates:
        schedule = get_schedule(c.schedule, len(c.counts), 6) if c.table is None else c.table
        spans = list(itertools.pairwise(itertools.accumulate(c.counts, initial=0)))
        forward = [sum(x.forward for x in layers[i:j]) for i, j in spans]
        backward = [sum(x.backward for x in layers[i:j]) for i, j in spans]
        model = StepModel.from_stage_times(
            forward, backward, 2, split_backward=schedule.split_backward, source="test"
        )
        step = predict(schedule, model, stage_stops(c.checkpoint, len(c.counts), 6)).makespan
        assert c.step == pytest.approx(step, rel=1e-12), c


def test_the_pick_is_the_fastest_that_fits_and_beats_equal_layers_with_a_heavy_head() -> None:
    layers = lm()
    planning = plan_layers(layers, 2, 8)
    fastest = min(c.step for c in planning.candidates if c.fits)
    assert planning.pick.fits
    assert planning.pick.step <= fastest * (1 + MARGIN)
    # Equal blocks per stage: the embedding and 4 blocks, then 4 blocks and the head.
    equal = plan_layers(
        layers, 2, 8, schedules=["1f1b"], checkpoints=["never"], counts=[5, 5], synthesized=False
    )
    assert planning.pick.step < 0.8 * equal.pick.step
    assert planning.pick.counts[-1] < 5  # the head's stage gets fewer blocks
    text = str(planning)
    assert "*" in text and "picked" in text and planning.pick.schedule in text


def test_a_budget_is_kept_and_costs_time_or_recomputation() -> None:
    layers = lm()
    free = plan_layers(layers, 2, 8)
    budget = 0.8 * free.pick.peak_bytes
    tight = plan_layers(layers, 2, 8, memory_budget=budget)
    assert tight.pick.peak_bytes <= budget
    assert tight.pick.step >= free.pick.step
    assert all(c.fits == (c.peak_bytes <= budget) for c in tight.candidates)
    # A synthesized order is made within the budget, by its held micro-batches.
    made = [c for c in tight.candidates if c.schedule == "synthesized"]
    assert made and all(c.fits for c in made)
    assert "over budget" in str(tight)


def test_nothing_fits_names_the_least_memory_and_the_fixes() -> None:
    with pytest.raises(ConfigError, match=r"no plan fits memory_budget=.*least memory.*raise"):
        plan_layers(lm(), 2, 8, memory_budget=10.0)


def test_a_given_balance_compares_only_schedules_of_that_many_stages() -> None:
    planning = plan_layers(lm(), 2, 8, counts=[4, 6], synthesized=False)
    assert {c.schedule for c in planning.candidates} == {"gpipe", "1f1b", "zb-h1", "zb-h2"}
    assert all(c.counts == (4, 6) for c in planning.candidates)
    assert {name for name, _ in planning.skipped} >= {"zb-v", "interleaved-1f1b"}


def test_checkpointing_is_chosen_only_when_memory_needs_it() -> None:
    # Activations dominate: without recomputation nothing fits in a small budget.
    layers = lm(act=1000.0, params=1.0)
    free = plan_layers(layers, 2, 8, synthesized=False)
    assert free.pick.checkpoint == "never"
    never = min(c.peak_bytes for c in free.candidates if c.checkpoint == "never")
    tight = plan_layers(layers, 2, 8, memory_budget=0.6 * never, synthesized=False)
    modes = tight.pick.checkpoint
    assert {modes} if isinstance(modes, str) else set(modes) != {"never"}
    assert "checkpoint=" in tight.explain()


def test_a_mode_per_stage_wins_where_only_some_stages_fill_memory() -> None:
    # Blocks hold much and recompute cheaply; the head holds little and is costly to
    # recompute: checkpoint the blocks' stages, keep the head's.
    embed = LayerCost("embed", 0.1, 0.5, 10.0, 4.0, 1.0)
    body = [LayerCost(f"h.{k}", 1.0, 2.0, 1000.0, 1.0, 1.0) for k in range(8)]
    layers = [embed, *body, LayerCost("head", 6.0, 12.0, 10.0, 4.0, 1.0)]
    free = plan_layers(layers, 2, 8, synthesized=False, mixed=False)
    assert all(isinstance(c.checkpoint, str) for c in free.candidates)
    budget = 0.6 * min(c.peak_bytes for c in free.candidates if c.checkpoint == "never")
    uniform = plan_layers(layers, 2, 8, memory_budget=budget, synthesized=False, mixed=False)
    mixed = plan_layers(layers, 2, 8, memory_budget=budget, synthesized=False)
    pick = mixed.pick
    assert isinstance(pick.checkpoint, tuple) and len(pick.checkpoint) == len(pick.counts)
    assert pick.fits and pick.step < 0.9 * uniform.pick.step
    assert pick.checkpoint[-1] == "never"  # the head's stage (the last) is not recomputed
    assert ",".join(pick.checkpoint) in str(mixed)
    # A mix is shown only where it trades time for memory against its schedule's modes.
    for c in mixed.candidates:
        if isinstance(c.checkpoint, tuple) and c.table is None:
            assert not any(
                isinstance(o.checkpoint, str)
                and o.schedule == c.schedule
                and o.step <= c.step
                and o.peak_bytes <= c.peak_bytes
                for o in mixed.candidates
            ), c


def test_peak_bytes_is_the_closed_form_of_1f1b() -> None:
    # 1F1B's stage s holds min(p - s, m) whole micro-batches at its peak.
    p, m = 4, 8
    timeline = get_schedule("1f1b", p, m).simulate()
    held = [(1.0, 10.0)] * p
    for s in range(p):
        fixed = [0.0] * p
        fixed[s] = 0.0
        only = [(0.0, 0.0)] * p
        only[s] = held[s]
        assert peak_bytes(timeline, 0, only, fixed) == 10.0 * min(p - s, m)
        # checkpointed: inputs of the held ones, plus one recomputed whole during its backward
        assert peak_bytes(timeline, m, only, fixed) == 1.0 * min(p - s, m) + 9.0


@settings(max_examples=25, deadline=None)
@given(
    costs=st.lists(st.tuples(st.floats(0.1, 3.0), st.floats(0.1, 3.0)), min_size=4, max_size=9),
    workers=st.sampled_from([1, 2]),
    chunks=st.sampled_from([1, 2, 4, 6]),
    fraction=st.sampled_from([None, 0.0, 0.5]),
)
def test_the_pick_fits_and_no_fitting_candidate_is_faster_than_the_margin(
    costs: list[tuple[float, float]], workers: int, chunks: int, fraction: float | None
) -> None:
    layers = [LayerCost(f"l{k}", f, b, 5.0, 3.0, 1.0) for k, (f, b) in enumerate(costs)]
    free = plan_layers(layers, workers, chunks, synthesized=False)
    low, high = (f(c.peak_bytes for c in free.candidates) for f in (min, max))
    budget = None if fraction is None else low + fraction * (high - low)
    planning = plan_layers(layers, workers, chunks, memory_budget=budget, synthesized=False)
    assert planning.pick.fits and planning.pick.peak_bytes <= (budget or math.inf)
    assert all(c.step >= planning.pick.step for c in planning.candidates if c.fits)
    assert all(sum(c.counts) == len(layers) and min(c.counts) >= 1 for c in planning.candidates)


def test_a_parameter_shared_by_layers_on_one_worker_is_held_once() -> None:
    # A tied embedding and head (1000 bytes each as counted per layer): on a V both sit on
    # worker 0, which holds the parameter and its gradient once; 1F1B puts them apart.
    def layers(shared: bool) -> list[LayerCost]:
        tied = (("wte", 1000.0),) if shared else ()
        embed = LayerCost("embed", 0.1, 0.5, 10.0, 1000.0, 1.0, shared=tied)
        body = [LayerCost(f"h.{k}", 1.0, 2.0, 10.0, 100.0, 1.0) for k in range(8)]
        return [embed, *body, LayerCost("head", 2.0, 4.0, 10.0, 1000.0, 1.0, shared=tied)]

    def peak(shared: bool, schedule: str, counts: list[int]) -> float:
        planning = plan_layers(
            layers(shared), 2, 4, schedules=[schedule], checkpoints=["never"], counts=counts
        )
        return next(c.peak_bytes for c in planning.candidates if c.schedule == schedule)

    assert peak(False, "zb-v", [1, 4, 4, 1]) - peak(True, "zb-v", [1, 4, 4, 1]) == 2000.0
    assert peak(False, "1f1b", [5, 5]) == peak(True, "1f1b", [5, 5])
    # Within one stage too: one worker runs every layer.
    whole = plan_layers(layers(True), 1, 4, schedules=["1f1b"], checkpoints=["never"])
    apart = plan_layers(layers(False), 1, 4, schedules=["1f1b"], checkpoints=["never"])
    assert apart.pick.peak_bytes - whole.pick.peak_bytes == 2000.0


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
def test_peak_bytes_counts_what_a_micro_batch_holds_between_b_and_w(schedule) -> None:
    p, m = 2, 6
    timeline = get_schedule(schedule, p, m).simulate()
    stages = timeline.num_stages
    held, fixed = [(1.0, 10.0)] * stages, [0.0] * p
    plain = peak_bytes(timeline, 0, held, fixed)
    assert peak_bytes(timeline, 0, held, fixed, [10.0] * stages) == plain
    more = peak_bytes(timeline, 0, held, fixed, [25.0] * stages)
    less = peak_bytes(timeline, 0, held, fixed, [2.0] * stages)
    assert less <= plain < more  # the peak may come while none waits for its W
    # One micro-batch at a time (F, B, W in turn) holds the larger of the two.
    alone = get_schedule("zb-h1", 1, 3).simulate()
    assert peak_bytes(alone, 0, [(1.0, 10.0)], [0.0], [15.0]) == 15.0
    assert peak_bytes(alone, 0, [(1.0, 10.0)], [0.0], [3.0]) == 10.0


def test_a_baseline_over_the_budget_and_faster_reads_faster_not_negative_slower() -> None:
    pick = Candidate("zb-h1", "always", (2, 2), 4, step=0.012, peak_bytes=1e6, fits=True)
    baseline = Candidate("1f1b", "never", (2, 2), 4, step=0.010, peak_bytes=9e6, fits=False)
    slower = Candidate("gpipe", "always", (2, 2), 4, step=0.015, peak_bytes=1e6, fits=True)
    text = Planning((pick, slower, baseline), pick, 2, 2e6, baseline=baseline).explain()
    assert "16.7% faster, and over the budget" in text  # 0.010 against 0.012
    assert "next best: " in text and "25.0% slower" in text
    assert "-16.7%" not in text
