"""A model changed after its Pipeline was built is refused with what changed, never run stale.

The reference is the plain model after the change: before, the pipeline ran the
modules and Python it was built on (a swapped-in head never ran and got no
gradient; a traced temperature stayed at its first value).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipesched import ConfigError, Pipeline

pytestmark = pytest.mark.usefixtures("fp64")


class _Tempered(nn.Module):
    """A traced model whose forward reads a plain attribute and a flag."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 4)
        self.temp = 1.0
        self.extra = False

    def forward(self, x):
        x = self.b(self.a(x).tanh()).tanh()
        if self.extra:
            x = x * 2
        return self.c(x) / self.temp


def _traced() -> tuple[_Tempered, Pipeline]:
    model = _Tempered()
    x = torch.randn(4, 6)
    return model, Pipeline(model, 2, devices=["cpu"] * 2, split_points=["b"], example_inputs=(x,))


def _hook(module, args, output):
    return output * 3


CHANGES = {
    "head replaced": (lambda m: setattr(m, "c", nn.Linear(6, 4)), r"module 'c' was replaced"),
    "module added": (lambda m: m.c.add_module("lora", nn.Linear(6, 4)), r"'c.lora' was added"),
    "attribute": (lambda m: setattr(m, "temp", 3.0), r"'temp' of module .* from 1.0 to 3.0"),
    "flag": (lambda m: setattr(m, "extra", True), r"'extra' .* from False to True"),
    "hook": (lambda m: m.b.register_forward_hook(_hook), r"module 'b''s hooks changed"),
    "forward": (lambda m: setattr(m.b, "forward", lambda x: x), r"'b''s forward was replaced"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_traced_model_changed_after_the_build_is_refused_naming_the_change(change: str) -> None:
    apply, said = CHANGES[change]
    model, pipe = _traced()
    x, y = torch.randn(8, 6), torch.randn(8, 4)
    pipe.step(x, y, loss_fn=nn.functional.mse_loss)
    before = nn.functional.mse_loss(model(x), y)
    apply(model)
    after = nn.functional.mse_loss(model(x), y)
    assert not torch.equal(before, after) or change == "module added"  # the model changed
    for call in (lambda: pipe.step(x, y, loss_fn=nn.functional.mse_loss), lambda: pipe(x)):
        with pytest.raises(ConfigError, match=said) as raised:
            call()
        assert "build a new Pipeline" in str(raised.value)


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
