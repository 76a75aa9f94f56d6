"""The GradientAccumulator's arguments: refused before the first window, naming the fix."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipesched import ConfigError, GradientAccumulator, Pipeline


def _pipe() -> Pipeline:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    return Pipeline(model, 3, balance=[2, 1], devices=["cpu", "cpu"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"accumulation_steps": 0}, "accumulation_steps must be a positive integer, got 0"),
        ({"accumulation_steps": 2, "max_grad_norm": 0}, "max_grad_norm must be > 0, got 0"),
        ({"accumulation_steps": 2, "max_grad_norm": -1.0}, "max_grad_norm must be > 0"),
    ],
)
def test_bad_arguments(kwargs, message):
    pipe = _pipe()
    with pytest.raises(ConfigError, match=message):
        GradientAccumulator(pipe, torch.optim.SGD(pipe.parameters(), lr=0.1), **kwargs)


def test_an_optimizer_over_another_models_parameters_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    copy_of_model = copy.deepcopy(model)
    pipe = Pipeline(model, 2, devices=["cpu", "cpu"])
    GradientAccumulator(pipe, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    with pytest.raises(ConfigError, match=r"optimizer holds \d+ parameters, none of them"):
        GradientAccumulator(
            pipe, torch.optim.SGD(copy_of_model.parameters(), lr=0.1), accumulation_steps=2
        )


def test_a_scheduler_stepped_with_a_metric_is_refused_with_the_way_to_step_it() -> None:
    """ReduceLROnPlateau raised at every window end, and every retry (flush) again."""
    pipe = _pipe()
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    with pytest.raises(
        ConfigError, match=r"ReduceLROnPlateau\) steps with metrics.*step it yourself"
    ):
        GradientAccumulator(pipe, opt, accumulation_steps=2, lr_scheduler=plateau)
    with pytest.raises(TypeError, match="must have a step"):
        GradientAccumulator(pipe, opt, accumulation_steps=2, lr_scheduler=[object()])
    # The way it names works, and schedulers that step with no argument are taken.
    steplr = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    acc = GradientAccumulator(pipe, opt, accumulation_steps=1, lr_scheduler=steplr)
    x, y = torch.randn(6, 5), torch.randn(6, 3)
    result = acc.step(x, y, loss_fn=nn.functional.mse_loss)
    if result.stepped:
        plateau.step(result.window_loss)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)


def test_an_optimizer_stepped_with_a_closure_is_refused_before_the_first_window():
    """LBFGS raised torch's "missing closure" at every window end, and every retry (flush)."""
    pipe = _pipe()
    with pytest.raises(ConfigError, match=r"optimizer \(LBFGS\) steps with closure"):
        GradientAccumulator(pipe, torch.optim.LBFGS(pipe.parameters()), accumulation_steps=2)
