"""Backward hooks a trace drops (a module's, a tensor's registered in forward) are told."""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from pipesched import Pipeline
from pipesched.errors import PipeschedWarning


class Net(nn.Module):
    def __init__(self, tensor_hook: bool = False) -> None:
        super().__init__()
        self.tensor_hook = tensor_hook
        self.a, self.b, self.c = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.tensor_hook and h.requires_grad:
            h.register_hook(lambda g: g * 3)
        return self.c(torch.tanh(self.b(h)))


def _told(call) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in seen if issubclass(w.category, PipeschedWarning)]


def _triple(module, grad_input, grad_output):
    return (grad_input[0] * 3,)


def test_a_traced_modules_backward_hook_is_told_once():
    """Before, silent: the hook never ran and the gradients were another model's."""
    model = Net()
    model.b.register_full_backward_hook(_triple)
    pipe = Pipeline(model, 2, devices=["cpu"] * 2)
    x = torch.randn(8, 4)
    (message,) = _told(lambda: pipe(x).sum().backward())
    assert message.startswith("Net has backward hooks on b, which torch.export does not record")
    assert "p.register_hook" in message
    assert _told(lambda: pipe(x).sum().backward()) == []  # once


def test_a_tensor_hook_registered_in_forward_is_told_with_its_line():
    pipe = Pipeline(Net(tensor_hook=True), 2, devices=["cpu"] * 2)
    (message,) = _told(lambda: pipe(torch.randn(8, 4)))
    assert "tensor hooks registered in forward (" in message
    assert f"{__file__}:{Net.forward.__code__.co_firstlineno + 3})" in message


def test_a_sequentials_backward_hook_runs_and_is_not_told():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    plain = copy.deepcopy(model)
    for m in (model, plain):
        m[2].register_full_backward_hook(_triple)
    x = torch.randn(8, 4)
    plain(x).sum().backward()
    pipe = Pipeline(model, 2, balance=[2, 3], devices=["cpu"] * 2)
    assert _told(lambda: pipe(x).sum().backward()) == []
    torch.testing.assert_close(model[0].weight.grad, plain[0].weight.grad)


def test_a_traced_model_without_backward_hooks_is_not_told():
    model = Net()
    model.b.register_forward_hook(lambda m, i, o: o * 2)  # forward hooks run in the trace
    pipe = Pipeline(model, 2, devices=["cpu"] * 2)
    x = torch.randn(8, 4)
    assert _told(lambda: pipe(x)) == []
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))
