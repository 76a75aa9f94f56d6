"""Gradient hooks on parameters run once per micro-batch: said once, and what it says is true."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from pipesched import Pipeline
from pipesched.errors import PipeschedWarning


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _step(pipe: Pipeline, x: torch.Tensor) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pipe.step(x, loss_fn=lambda y: y.square().sum())
    return [w for w in seen if "gradient hooks" in str(w.message)]


def test_a_clamping_hook_is_named_once_and_its_gradients_do_differ_from_the_plain_models():
    model, plain = _model(), _model()
    for m in (model, plain):
        m[0].weight.register_hook(lambda g: g.clamp(-0.01, 0.01))
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe = Pipeline(model, chunks=4, devices=["cpu", "cpu"])
    (first,) = _step(pipe, x)
    assert issubclass(first.category, PipeschedWarning)
    assert "1 parameter (0.weight) has gradient hooks" in str(first.message)
    assert "4 times a step" in str(first.message)
    assert first.filename == __file__  # the user's line
    plain(x).square().sum().backward()
    assert not torch.allclose(model[0].weight.grad, plain[0].weight.grad, rtol=1e-3)
    assert _step(pipe, x) == []  # once per pipeline


def test_a_linear_hook_is_named_too_and_gives_the_plain_models_gradients():
    model, plain = _model(), _model()
    for m in (model, plain):
        m[2].bias.register_post_accumulate_grad_hook(lambda p: None)
        m[2].weight.register_hook(lambda g: 2 * g)
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe = Pipeline(model, chunks=4, devices=["cpu", "cpu"])
    (seen,) = _step(pipe, x)
    assert "2 parameters (2.weight, 2.bias) have gradient hooks" in str(seen.message)
    (plain(x).square().sum() / 4).backward()  # step() averages the micro-batches' losses
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("chunks", [1, 4])
def test_silent_without_hooks_or_with_one_micro_batch(chunks):
    model = _model()
    if chunks == 1:
        model[0].weight.register_hook(lambda g: g.clamp(-0.01, 0.01))
    pipe = Pipeline(model, chunks=chunks, devices=["cpu", "cpu"] if chunks > 1 else ["cpu"])
    assert _step(pipe, torch.randn(8, 4, dtype=torch.float64)) == []
