"""A model changed after its Pipeline was built is refused (a module) or told (a trace's Python).

The reference is the plain model after the change: before, the pipeline ran the
modules and Python it was built on (a swapped-in head never ran and got no
gradient; a traced temperature stayed at its first value).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from pipesched import ConfigError, Pipeline
from pipesched.errors import PipeschedWarning

pytestmark = pytest.mark.usefixtures("fp64")


class _Config:
    """Settings the forward reads, as a Hugging Face config holds them."""

    def __init__(self) -> None:
        self.scale = 1.0


class _Tempered(nn.Module):
    """A traced model whose forward reads a plain attribute and a flag."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 4)
        self.temp = 1.0
        self.extra = False
        self.config = _Config()

    def forward(self, x):
        x = self.b(self.a(x).tanh()).tanh()
        if self.extra:
            x = x * 2
        return self.c(x) / self.temp * self.config.scale


def _traced() -> tuple[_Tempered, Pipeline]:
    model = _Tempered()
    x = torch.randn(4, 6)
    return model, Pipeline(model, 2, devices=["cpu"] * 2, split_points=["b"], example_inputs=(x,))


def _stepped() -> tuple[_Tempered, Pipeline, torch.Tensor, torch.Tensor]:
    """A traced model's pipeline after one step, and the step's batch."""
    model, pipe = _traced()
    x, y = torch.randn(8, 6), torch.randn(8, 4)
    pipe.step(x, y, loss_fn=nn.functional.mse_loss)
    return model, pipe, x, y


def _hook(module, args, output):
    return output * 3


REPLACED = {
    "head replaced": (lambda m: setattr(m, "c", nn.Linear(6, 4)), r"module 'c' was replaced"),
    "module added": (lambda m: m.c.add_module("lora", nn.Linear(6, 4)), r"'c.lora' was added"),
}

PYTHON = {
    "attribute": (lambda m: setattr(m, "temp", 3.0), r"'temp' of module .* from 1.0 to 3.0"),
    "flag": (lambda m: setattr(m, "extra", True), r"'extra' .* from False to True"),
    "config": (lambda m: setattr(m.config, "scale", 2.0), r"'config.scale' .* 1.0 to 2.0"),
    "hook": (lambda m: m.b.register_forward_hook(_hook), r"module 'b''s hooks changed"),
    "forward": (lambda m: setattr(m.b, "forward", lambda x: x), r"'b''s forward was replaced"),
}


@pytest.mark.parametrize("change", list(REPLACED))
def test_a_module_replaced_after_the_build_is_refused_naming_it(change: str) -> None:
    """Before, the stages ran the old module: the new head never ran, nor got a gradient."""
    apply, said = REPLACED[change]
    model, pipe, x, y = _stepped()
    apply(model)
    for call in (lambda: pipe.step(x, y, loss_fn=nn.functional.mse_loss), lambda: pipe(x)):
        with pytest.raises(ConfigError, match=said) as raised:
            call()
        assert "build a new Pipeline" in str(raised.value)


@pytest.mark.parametrize("change", list(PYTHON))
def test_a_traced_models_python_changed_after_the_trace_is_told_once(change: str) -> None:
    """Before, the trace ran the old values silently (a temperature stayed 1.0)."""
    apply, said = PYTHON[change]
    model, pipe, x, y = _stepped()
    before = nn.functional.mse_loss(model(x), y)
    apply(model)
    assert not torch.equal(before, nn.functional.mse_loss(model(x), y))  # the model changed
    with pytest.warns(PipeschedWarning, match=said):
        pipe.step(x, y, loss_fn=nn.functional.mse_loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PipeschedWarning)
        pipe(x)  # once per change


def test_an_attribute_the_forward_never_reads_is_only_told() -> None:
    """An epoch counter on the model: told once, the steps run as the plain model's."""
    model, pipe, x, y = _stepped()
    model.current_epoch = 3
    with pytest.warns(PipeschedWarning, match="'current_epoch'"):
        loss = pipe.step(x, y, loss_fn=nn.functional.mse_loss)
    torch.testing.assert_close(loss, nn.functional.mse_loss(model(x), y), rtol=1e-12, atol=0)


@pytest.mark.parametrize("value", [None, 0])
def test_an_attribute_added_or_removed_is_told_whatever_its_value(value) -> None:
    """Before, an attribute added as None raised a bare StopIteration at every later call."""
    model, pipe, x, y = _stepped()
    model.note = value
    with pytest.warns(PipeschedWarning, match=f"'note' = {value!r} was added"):
        pipe(x)
    del model.note
    with pytest.warns(PipeschedWarning, match="'note' was removed"):
        loss = pipe.step(x, y, loss_fn=nn.functional.mse_loss)
    torch.testing.assert_close(loss, nn.functional.mse_loss(model(x), y), rtol=1e-12, atol=0)


def test_a_sequentials_replaced_layer_is_refused_and_its_live_changes_are_not() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.0), nn.Tanh(), nn.Linear(6, 4))
    pipe = Pipeline(model, 2, balance=[2, 2], devices=["cpu"] * 2)
    x, y = torch.randn(8, 6), torch.randn(8, 4)
    # What a layer's own code reads runs live: a hook, a dropout's p.
    model[3].register_forward_hook(_hook)
    model[1].p = 0.5
    model.eval()
    torch.testing.assert_close(pipe(x), model(x), rtol=0, atol=0)
    model[3] = nn.Linear(6, 4)
    with pytest.raises(ConfigError, match=r"module '3' was replaced"):
        pipe.step(x, y, loss_fn=nn.functional.mse_loss)


def test_a_new_pipeline_over_the_changed_model_runs_it() -> None:
    """The fix the message names: the changed model, pipelined, equals it."""
    model, pipe = _traced()
    x = torch.randn(8, 6)
    pipe(x)
    model.temp = 3.0
    fresh = Pipeline(model, 2, devices=["cpu"] * 2, split_points=["b"])
    torch.testing.assert_close(fresh(x), model(x), rtol=1e-12, atol=1e-14)
