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
