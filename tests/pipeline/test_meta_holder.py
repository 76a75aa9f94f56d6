"""A meta-built Pipeline holds the tensors its model holds: the builder returns its swaps."""

from __future__ import annotations

import torch
from torch import nn

from pipesched import Pipeline
from pipesched.partition.materialize import Swaps


class _Scaled(nn.Module):
    """A model with its own parameter and buffer (which the Pipeline registers on itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.empty(4))
        self.register_buffer("mask", torch.empty(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) * self.scale + self.mask


def _init(name: str, module: nn.Module) -> None:
    if name == "":
        module.scale.fill_(2.0)
        module.mask = torch.ones(4)  # assigned anew: the Pipeline follows it too


def test_the_pipeline_holds_what_the_model_holds_after_a_meta_build():
    with torch.device("meta"):
        model = _Scaled()
    pipe = Pipeline(
        model, 2, devices=["cpu", "cpu"], example_inputs=(torch.randn(2, 4),), init_weights=_init
    )
    assert not any(t.is_meta for t in (*pipe.parameters(), *pipe.buffers()))
    assert pipe.get_parameter("scale") is model.scale
    assert torch.equal(pipe.get_parameter("scale"), torch.full((4,), 2.0))
    assert pipe.get_buffer("mask") is model.mask
    assert torch.equal(pipe.get_buffer("mask"), torch.ones(4))
    assert dict(pipe.named_parameters()).keys() == dict(model.named_parameters()).keys()
    for name, t in model.state_dict(keep_vars=True).items():
        assert pipe.state_dict(keep_vars=True)[name] is t, name


def test_a_replacement_replaced_again_maps_from_the_first_tensor():
    first, second, third = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    holder = nn.Module()
    holder.register_buffer("x", first)
    swaps = Swaps()
    swaps.add(first, second)
    swaps.add(second, third)
    assert len(swaps) == 1
    swaps.apply(holder)
    assert holder.x is third
