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


def test_a_sparse_embedding_tied_to_a_dense_head_sums_like_the_plain_model():
    # Stage 0's part is sparse, stage 1's dense: torch adds only dense + sparse.
    def model():
        torch.manual_seed(0)
        embedding = nn.Embedding(10, 6, sparse=True)

        class Head(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embedding = embedding

            def forward(self, x):
                return x @ self.embedding.weight.t()

        return nn.Sequential(embedding, nn.Linear(6, 6), nn.Linear(6, 6), Head())

    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 10, (8,), generator=g), torch.randint(0, 10, (8,), generator=g)
    plain = model()
    for _ in range(2):
        nn.functional.cross_entropy(plain(x), y).backward()
    pipe = Pipeline(model(), 4, balance=[2, 2], devices=["cpu"] * 2, schedule="1f1b")
    for _ in range(2):
        pipe.step(x, y, loss_fn=nn.functional.cross_entropy)
    for got, want in zip(pipe.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got.grad.to_dense(), want.grad.to_dense())
