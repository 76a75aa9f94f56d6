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
