"""Cutting an nn.Sequential: balance checks, layer names, parameter balancing."""

from __future__ import annotations

import itertools

import pytest
from torch import nn

from pipesched import PartitionError
from pipesched.partition import balance_by_params, check_balance, split_sequential


def _model(widths: list[int]) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(w, w) for w in widths])


def test_split_keeps_names_and_shares_layers():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.Tanh())
    stages = split_sequential(model, [1, 3])
    assert [list(dict(s.named_children())) for s in stages] == [["0"], ["1", "2", "3"]]
    assert stages[1][1] is model[2]
    assert [n for s in stages for n, _ in s.named_parameters()] == [
        "0.weight",
        "0.bias",
        "2.weight",
        "2.bias",
    ]


@pytest.mark.parametrize(
    ("balance", "message"),
    [
        ([2, 1], r"module: 4, sum of balance: 3"),
        ([2, 0, 2], r"entries \[0\]"),
        ([2, 1.5, 0.5], r"entries \[1.5, 0.5\]"),
        ([], "balance is empty"),
    ],
)
def test_bad_balance(balance, message):
    with pytest.raises(PartitionError, match=message):
        check_balance(_model([2, 2, 2, 2]), balance)


@pytest.mark.parametrize("widths", [[4, 4, 4, 4], [1, 30, 2, 2, 2, 40, 3], [50, 1, 1, 1, 1, 1]])
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_balance_by_params_is_optimal(widths, stages):
    model = _model(widths)
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in model]

    def worst(counts):
        bounds = list(itertools.accumulate([0, *counts]))
        return max(sum(sizes[a:b]) for a, b in itertools.pairwise(bounds))

    n = len(widths)
    brute = min(
        worst([b - a for a, b in itertools.pairwise([0, *cuts, n])])
        for cuts in itertools.combinations(range(1, n), stages - 1)
    )
    counts = balance_by_params(model, stages)
    assert sum(counts) == n and min(counts) >= 1
    assert worst(counts) == brute


def test_more_stages_than_layers():
    with pytest.raises(PartitionError, match="cannot cut 2 layers into 3 stages"):
        balance_by_params(_model([2, 2]), 3)
