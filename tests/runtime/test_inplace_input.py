"""A stage that modifies its input in place trains as the plain model does (issue 25)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipesched import Pipeline

pytestmark = pytest.mark.usefixtures("fp64")


class Double(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2)


@pytest.mark.parametrize("mode", ["never", "always", "except_last"])
@pytest.mark.parametrize("where", [0, 3])  # the first stage's input, a middle stage's
def test_in_place_on_stage_input(mode: str, where: int) -> None:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6),
                               nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)]  # fmt: skip
    layers.insert(where, Double())
    model = nn.Sequential(*layers)
    plain = copy.deepcopy(model)
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    nn.functional.mse_loss(plain(x.clone()), y).backward()
    pipe = Pipeline(model, 4, balance=[4, 3] if where == 0 else [3, 4],
                    devices=["cpu", "cpu"], checkpoint=mode)  # fmt: skip
    pipe.step(x.clone(), y, loss_fn=nn.functional.mse_loss)
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15)


def test_in_place_on_saved_output_is_refused_as_in_plain_model() -> None:
    """The previous stage saved its output (Tanh): modifying it is an error, as in torch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), Double(), nn.Linear(6, 6))
    pipe = Pipeline(model, 2, balance=[2, 2], devices=["cpu", "cpu"], checkpoint="never")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        pipe.step(torch.randn(4, 6), torch.randn(4, 6), loss_fn=nn.functional.mse_loss)
