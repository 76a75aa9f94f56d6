"""Our orders against torch.distributed.pipelining's generators, where both define one.

torch's generators are methods of its runtime schedule classes; we call them
on a bare instance with only the attributes they read, so no process group
or stage is needed. Its lockstep padding (None) is dropped and its "I"
(input-gradient backward) is our B.
"""

from __future__ import annotations

import pytest

from pipesched.schedule import Action, get_schedule

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


def _torch_rows(cls, num_workers: int, m: int, **attrs) -> list[list[Action]]:
    generator = object.__new__(cls)
    generator.pp_group_size = num_workers
    generator._n_microbatches = m
    for name, value in attrs.items():
        setattr(generator, name, value)
    kind = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
    rows = []
    for rank in range(num_workers):
        row = []
        for a in generator._calculate_single_rank_operations(rank):
            if a is not None:
                row.append(Action(a.stage_index, kind[a.computation_type.name], a.microbatch_index))
        rows.append(row)
    return rows


@pytest.mark.parametrize(
    ("p", "v", "m"), [(2, 2, 4), (4, 2, 8), (4, 2, 3), (3, 3, 6), (4, 2, 10), (2, 4, 6), (4, 3, 12)]
)
def test_interleaved_matches_torch_where_torch_runs(p, v, m):
    rounds = max(1, m // p)
    assert m % rounds == 0, "torch rejects this m"
    ours = get_schedule("interleaved-1f1b", p * v, m, virtual_stages=v)
    theirs = _torch_rows(
        schedules.ScheduleInterleaved1F1B,
        p,
        m,
        n_local_stages=v,
        number_of_rounds=rounds,
        microbatches_per_round=m // rounds,
    )
    assert [list(r) for r in ours.actions] == theirs


@pytest.mark.parametrize(("p", "m"), [(2, 1), (2, 3), (2, 8), (3, 5), (4, 4), (4, 9)])
def test_zb_v_matches_torch(p, m):
    ours = get_schedule("zb-v", 2 * p, m)
    theirs = _torch_rows(
        schedules.ScheduleZBVZeroBubble, p, m, n_local_stages=2, num_stages=2 * p, rank=0
    )
    assert [list(r) for r in ours.actions] == theirs


def _torch_dualpipe_v_rows(num_workers: int, m: int) -> list[list[Action]]:
    """torch's ScheduleDualPipeV order with each torch action mapped onto our kinds.

    FORWARD is F; BACKWARD_INPUT is B; BACKWARD_WEIGHT is W; FULL_BACKWARD
    (input and weight gradient in one call) is B then at once W of the same
    stage and micro-batch; OVERLAP_F_B (a forward and a backward torch may
    run overlapped) is its sub-actions in torch's order, mapped the same way:
    F, then B and W.
    """
    generator = object.__new__(schedules.ScheduleDualPipeV)
    generator.pp_group_size = num_workers
    generator._n_microbatches = m

    def ours(a) -> list[Action]:
        kind = a.computation_type.name
        if kind == "OVERLAP_F_B":
            return [b for sub in a.sub_actions for b in ours(sub)]
        letters = {
            "FORWARD": "F",
            "BACKWARD_INPUT": "B",
            "BACKWARD_WEIGHT": "W",
            "FULL_BACKWARD": "BW",
        }[kind]
        return [Action(a.stage_index, k, a.microbatch_index) for k in letters]

    rows = []
    for rank in range(num_workers):
        torch_row = generator._calculate_single_rank_operations(rank)
        rows.append([b for a in torch_row if a is not None for b in ours(a)])
    return rows


@pytest.mark.parametrize(
    ("p", "m"), [(1, 2), (2, 4), (2, 7), (3, 6), (3, 10), (4, 8), (4, 9), (4, 12), (8, 16), (8, 24)]
)
def test_dualpipev_matches_torch(p, m):
    # torch defines the order for m >= 2p (its constructor refuses fewer micro-batches).
    ours = get_schedule("dualpipev", 2 * p, m)
    theirs = _torch_dualpipe_v_rows(p, m)
    assert [list(r) for r in ours.actions] == theirs
    # Overlapped and fused pairs really occur in these orders, so the mapping is exercised.
    generator = object.__new__(schedules.ScheduleDualPipeV)
    generator.pp_group_size, generator._n_microbatches = p, m
    kinds = {a.computation_type.name for a in generator._calculate_single_rank_operations(p - 1)}
    assert {"FULL_BACKWARD", "FORWARD"} <= kinds
    if m > 2 * p - 1 and p > 1:
        assert "OVERLAP_F_B" in kinds
