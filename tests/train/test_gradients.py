"""Gradient helpers against torch's own: clipping by a given global norm."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipesched.train.gradients import clip_to_


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_clip_to_equals_clip_grad_norm_bitwise_whatever_the_default_dtype(dtype) -> None:
    """The coefficient is computed in the gradients' dtype (float32 default dtype or not)."""
    assert torch.get_default_dtype() == torch.float32
    torch.manual_seed(0)
    ours, theirs = nn.Linear(7, 5).to(dtype), nn.Linear(7, 5).to(dtype)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(9, 7, dtype=dtype)
    for model in (ours, theirs):
        (model(x) ** 2).sum().backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in ours.parameters()])
    assert float(norm) > 0.5  # the clip acts
    clip_to_(list(ours.parameters()), 0.5, float(norm))
    torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5)
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


class _Bag(nn.Module):
    """A sparse embedding summed over its tokens (``sparse=True``: sparse gradients)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 4, sparse=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids).sum(1)


@pytest.mark.parametrize("backup", ["device", "disk"])
def test_windows_with_sparse_gradients_equal_the_plain_model(backup, fp64) -> None:
    # The window end checks, measures and clips a sparse gradient by its values.
    from pipesched import GradientAccumulator, Pipeline

    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(_Bag(), nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 10, (8, 3), generator=g), torch.randn(8, 2, generator=g))]
    batches *= 4
    pipe = Pipeline(model(), 4, balance=[2, 2], devices=["cpu"] * 2, grad_backup=backup)
    acc = GradientAccumulator(
        pipe, torch.optim.SGD(pipe.parameters(), lr=0.1), accumulation_steps=2, max_grad_norm=0.1
    )
    for x, y in batches:
        acc.step(x, y, loss_fn=nn.functional.mse_loss)
    plain = model()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for window in range(2):
        x, y = (torch.cat(t) for t in zip(*batches[2 * window : 2 * window + 2], strict=True))
        optimizer.zero_grad()
        nn.functional.mse_loss(plain(x), y).backward()
        grads = [p.grad for p in plain.parameters()]  # torch's clip_grad_norm_ refuses sparse
        values = [g.coalesce().values() if g.is_sparse else g for g in grads]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(v) for v in values]))
        for g in grads:
            g.mul_(torch.clamp(0.1 / (norm + 1e-6), max=1.0))
        optimizer.step()
    for got, want in zip(pipe.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
