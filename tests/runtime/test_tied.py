"""Tied weights: contributions of stages in several threads summed in stage order (issue 25)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipesched import Pipeline
from pipesched.schedule import stages_per_worker

pytestmark = pytest.mark.usefixtures("fp64")

X = torch.randn(64, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
Y = torch.randn(64, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)


def _tied(n: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(n):
        layers += [nn.Linear(6, 6), nn.Tanh()]
    model = nn.Sequential(*layers)
    model[2 * n - 2].weight = model[0].weight  # first and last Linear share a weight
    return model


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"])
def test_tied_weight_bitwise_run_to_run_and_exact(schedule: str) -> None:
    stages = 2 * stages_per_worker(schedule)
    grads = []
    for _ in range(5):
        model = _tied(stages)
        plain = copy.deepcopy(model)
        pipe = Pipeline(model, 8, balance=[2] * stages, devices=["cpu", "cpu"],
                        schedule=schedule)  # fmt: skip
        pipe.step(X, Y, loss_fn=nn.functional.mse_loss)
        grads.append(model[0].weight.grad.clone())
    assert all(torch.equal(g, grads[0]) for g in grads)
    nn.functional.mse_loss(plain(X), Y).backward()
    torch.testing.assert_close(grads[0], plain[0].weight.grad, rtol=1e-12, atol=1e-15)
