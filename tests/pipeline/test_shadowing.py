"""A model whose names are also Pipeline attributes trains and keeps its own names."""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
from torch import nn

from pipesched import GradientAccumulator, Pipeline

pytestmark = pytest.mark.usefixtures("fp64")


class Clash(nn.Module):
    """Like timm's ConvNeXt (``stages``), with more names a Pipeline uses itself."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.stages = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.devices = nn.Linear(8, 3)
        self.chunks = nn.Parameter(torch.linspace(0.5, 1.5, 3))
        self.register_buffer("schedule", torch.full((3,), 0.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.devices(self.stages(self.stem(x))) * self.chunks + self.schedule


def _sequential() -> nn.Sequential:
    layers = [("stem", nn.Linear(4, 8)), ("stages", nn.Tanh()), ("partition", nn.Linear(8, 3))]
    return nn.Sequential(OrderedDict(layers))


def _pipe(model: nn.Module, x: torch.Tensor) -> Pipeline:
    if isinstance(model, nn.Sequential):
        return Pipeline(model, chunks=3, devices=["cpu"] * 2, balance=[2, 1])
    return Pipeline(model, chunks=3, example_inputs=(x[:2],), devices=["cpu"] * 2, num_stages=2)


@pytest.mark.parametrize("make", [Clash, _sequential], ids=["traced", "sequential"])
def test_a_model_named_like_pipeline_attributes_trains_and_keeps_its_names(make, tmp_path):
    torch.manual_seed(0)
    plain = make()
    piped = copy.deepcopy(plain)
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    pipe = _pipe(piped, x)
    assert pipe.chunks == 3 and len(pipe.devices) == 2  # the Pipeline's attributes stay its own
    assert isinstance(pipe.stages, tuple) and pipe.num_stages == 2
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    acc = GradientAccumulator(
        pipe, torch.optim.SGD(pipe.parameters(), lr=0.1), accumulation_steps=1
    )
    for _ in range(2):
        loss = acc.step(x, y, loss_fn=nn.functional.mse_loss).loss
        expected = nn.functional.mse_loss(plain(x), y)
        expected.backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad()
        assert loss == pytest.approx(expected.item(), rel=1e-12)
    assert list(pipe.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in pipe.named_parameters()] == [n for n, _ in plain.named_parameters()]
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], value, rtol=1e-12, atol=0, msg=name)
    assert pipe.get_submodule("stages") is piped.stages
    path = str(tmp_path / "ckpt.pt")
    acc.save(path)
    saved = torch.load(path, weights_only=False)
    assert any(list(plain.state_dict()) == list(v) for v in _dicts(saved))  # the plain names
    pipe.load_state_dict(plain.state_dict())  # the plain model's checkpoint loads as it is
    with torch.no_grad():
        for p in pipe.parameters():
            p.zero_()
    acc.load(path)  # and the pipeline's own checkpoint loads back
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], value, rtol=1e-12, atol=0, msg=name)


def test_shadowed_names_leave_the_pipelines_attributes_assignable():
    x = torch.randn(6, 4)
    pipe = _pipe(Clash(), x)
    chunks = pipe.get_parameter("chunks")
    pipe.chunks = 2
    assert pipe.chunks == 2 and pipe.get_parameter("chunks") is chunks
    assert pipe.get_buffer("schedule").shape == (3,)
    assert pipe(x).shape == (6, 3)


def _dicts(value):
    if isinstance(value, dict):
        yield value
        for v in value.values():
            yield from _dicts(v)


class Shifted(nn.Module):
    """A traced model with a parameter and a buffer of its own (not a layer's)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.c = nn.Linear(4, 6), nn.Linear(6, 3)
        self.scale = nn.Parameter(torch.ones(6))
        self.register_buffer("shift", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.a(x)) * self.scale + self.shift)


@pytest.mark.parametrize("where", ["pipe.load_state_dict(assign=True)", "model.shift = t"])
def test_a_models_own_tensor_assigned_on_either_side_is_the_one_run_and_saved(where):
    """Before, silent: the Pipeline held its own dict of the model's top-level entries, so
    an assigned tensor was saved but not run (or run but not saved)."""
    torch.manual_seed(0)
    model = Shifted()
    pipe = Pipeline(model, 2, devices=["cpu"] * 2)
    x = torch.randn(8, 4)
    pipe(x)  # traced
    shift, scale = torch.full((6,), 0.3), nn.Parameter(torch.full((6,), 2.0))
    if where == "model.shift = t":
        model.shift, model.scale = shift, scale
    else:
        state = {**pipe.state_dict(), "shift": shift, "scale": scale}
        pipe.load_state_dict(state, assign=True)
    assert pipe.state_dict(keep_vars=True)["shift"] is model.shift is shift
    assert pipe.get_parameter("scale") is model.scale
    plain = copy.deepcopy(model)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), plain(x), rtol=1e-12, atol=0)
    fresh = Shifted()
    fresh.load_state_dict(pipe.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), plain(x), rtol=1e-12, atol=0)
