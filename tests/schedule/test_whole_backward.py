"""Which B and W of a split schedule run as one whole backward: never moving a transfer."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pipesched.schedule import SCHEDULES, Schedule, get_schedule, stages_per_worker
from pipesched.schedule.whole_backward import whole_backwards
from tests.list_scheduler import play


def _times(schedule: Schedule, cost, whole: frozenset[tuple[int, int]]) -> dict:
    """Each action's (start, end) as early as possible; a pair in ``whole`` runs as B
    lasting B + W, then W lasting nothing."""

    def duration(s: int, kind: str, i: int) -> float:
        if (s, i) in whole and kind != "F":
            return cost(s, "B") + cost(s, "W") if kind == "B" else 0.0
        return cost(s, kind)

    return {e.action: (e.start, e.end) for e in play(schedule, duration).events}


@st.composite
def split_schedules(draw):
    name = draw(st.sampled_from(sorted(n for n in SCHEDULES if "zb" in n or "v" in n)))
    workers = draw(st.integers(1, 4))
    m = draw(st.integers(1, 9))
    return get_schedule(name, workers * stages_per_worker(name), m)


@settings(max_examples=60, deadline=None)
@given(split_schedules(), st.randoms(use_true_random=False))
def test_running_the_pairs_whole_moves_no_action(schedule, rng) -> None:
    # Eighths: sums exact in floating point, so instants compare equal.
    costs = {(s, k): rng.randint(1, 24) / 8 for s in range(schedule.num_stages) for k in "FBW"}
    whole = whole_backwards(schedule)

    def cost(s: int, kind: str) -> float:
        return costs[s, kind]

    split, joined = _times(schedule, cost, frozenset()), _times(schedule, cost, whole)
    for (s, kind, i), (start, end) in split.items():
        if (s, i) not in whole:
            assert joined[s, kind, i] == (start, end)  # every other action, to the instant
        elif kind == "B":
            assert joined[s, kind, i][0] == start  # the whole backward starts as B did
        elif kind == "W":
            assert joined[s, kind, i][1] == end  # and ends as W did


def test_zb_v_runs_whole_where_the_gradient_stays_on_its_worker() -> None:
    schedule = get_schedule("zb-v", 4, 8)  # stages 0 and 3 on worker 0, 1 and 2 on worker 1
    assert schedule.placement == (0, 1, 1, 0)
    expected = {(0, i) for i in range(8)} | {(2, i) for i in range(7)}
    assert whole_backwards(schedule) == schedule.whole_backwards == expected
    row = schedule.actions[1]
    b7 = row.index((2, "B", 7))
    assert row[b7 + 1] != (2, "W", 7)  # its W waits: the split is what the schedule wants
    # Stages 1 and 3 send their input gradient to the other worker: never whole.
    assert not any(s in (1, 3) for s, _ in whole_backwards(schedule))


def test_a_pending_w_of_the_stage_keeps_the_pair_split() -> None:
    in_order = Schedule.from_lists([["0F0", "0F1", "0B0", "0W0", "0B1", "0W1"]])
    assert whole_backwards(in_order) == {(0, 0), (0, 1)}
    # B1 W1 are adjacent, but W0 is pending: whole, micro-batch 1 would reach .grad first.
    late = Schedule.from_lists([["0F0", "0F1", "0B0", "0B1", "0W1", "0W0"]])
    assert whole_backwards(late) == frozenset()


def test_schedules_that_do_not_split_have_no_pairs() -> None:
    for name in ("gpipe", "1f1b", "interleaved-1f1b"):
        assert whole_backwards(get_schedule(name, 4, 8)) == frozenset()
