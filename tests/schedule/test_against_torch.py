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
