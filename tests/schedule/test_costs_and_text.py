"""Costs checks, and the text grids of schedules and timelines."""

from __future__ import annotations

import pytest

from pipesched import ConfigError
from pipesched.schedule import Costs, get_schedule, render_timeline


def test_per_stage_costs():
    c = Costs(forward=[1, 2], backward=3, weight=[0.5, 1])
    assert c.per_stage(2, split_backward=True) == {"F": (1, 2), "B": (3, 3), "W": (0.5, 1)}
    assert c.per_stage(2, split_backward=False)["B"] == (3.5, 4)
    with pytest.raises(
        ConfigError, match="Costs.forward has 2 values but the schedule has 3 stages"
    ):
        c.per_stage(3, split_backward=False)


@pytest.mark.parametrize(
    "bad",
    [
        {"forward": -1},
        {"backward": [1, float("nan")]},
        {"weight": "x"},
        {"send": [1, 2]},
        {"send": -0.5},
        {"forward": "12"},  # was read as the per-stage list (1.0, 2.0)
        {"backward": "3"},  # was read as (3.0,)
        {"forward": [1, "2"]},
        {"forward": True},
        {"weight": None},
        {"forward": 1e308, "backward": 1e308},  # a makespan of inf
    ],
)
def test_bad_costs(bad):
    with pytest.raises(ConfigError, match="Costs"):
        Costs(**bad)


def test_costs_take_numbers_of_any_kind_once():
    numpy = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    costs = Costs(forward=torch.tensor(3.0), backward=numpy.array(2.0), weight=iter([1.0, 2.0]))
    assert costs == Costs(3.0, 2.0, (1.0, 2.0))  # a generator is read once, not emptied
    assert Costs(torch.tensor([1.0, 2.0])).forward == (1.0, 2.0)
    with pytest.raises(ConfigError, match="Costs.forward"):
        Costs(forward=torch.tensor(True))


def test_scaled():
    assert Costs(2, [2, 4], 1, send=3).scaled(0.5) == Costs(1, [1, 2], 0.5, send=3)


def test_timeline_grid():
    grid = render_timeline(get_schedule("1f1b", 2, 3).simulate())
    assert grid.splitlines() == [
        "worker 0: F0 F1  .  . B0 -- F2 B1 --  . B2 --",
        "worker 1:  . F0 B0 -- F1 B1 -- F2 B2 --  .  .",
        "makespan 12, bubble 25.0%, peak activations per stage [2 1]",
    ]


def test_timeline_grid_labels_stages_when_a_worker_runs_several():
    grid = render_timeline(get_schedule("zb-v", 4, 1).simulate())
    assert grid.splitlines()[0].split()[:3] == ["worker", "0:", "0F0"]


def test_timeline_grid_is_cut():
    grid = render_timeline(get_schedule("gpipe", 2, 50).simulate(), max_columns=10)
    assert "... (143 more)" in grid.splitlines()[0]


def test_timeline_grid_with_fractional_times_is_exact():
    grid = render_timeline(get_schedule("1f1b", 2, 2).simulate(Costs(1, 2, 0, send=0.5)))
    assert grid.splitlines()[:2] == [
        "worker 0: F0 -- F1 --  .  .  .  .  .  . B0 -- -- --  .  . B1 -- -- --",
        "worker 1:  .  .  . F0 -- B0 -- -- -- F1 -- B1 -- -- --  .  .  .  .  .",
    ]


def test_timeline_grid_with_irregular_times_keeps_every_label():
    grid = render_timeline(get_schedule("1f1b", 2, 3).simulate(Costs(1, 2, 1, send=0.1)))
    for row in grid.splitlines()[:2]:
        assert sorted(cell for cell in row.split()[2:] if cell[0] in "FB") == [
            "B0",
            "B1",
            "B2",
            "F0",
            "F1",
            "F2",
        ]
