"""A model whose layers a mesh pipeline freed is refused, not re-initialized or half-run."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipesched import Pipeline
from pipesched.errors import ConfigError
from pipesched.runtime.placement import keep_own_stages


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)]).double()


def _free_on_rank(model: nn.Sequential, pp_rank: int) -> None:
    """What Pipeline(model, mesh=...) does on ``pp_rank`` of 2, stages of 2 layers."""
    stages = [model[0:2], model[2:4]]
    keep_own_stages(stages, [0, 1], pp_rank, torch.device("cpu"))


@pytest.mark.parametrize("pp_rank", [0, 1])
def test_a_second_pipeline_on_a_freed_model_is_refused_naming_the_layers(pp_rank):
    model = _model()
    _free_on_rank(model, pp_rank)
    freed = ["2", "3"] if pp_rank == 0 else ["0", "1"]
    assert all(model[int(n)].weight.is_meta for n in freed)  # the weights are gone here
    with pytest.raises(ConfigError, match="freed on this rank") as caught:
        Pipeline(model, chunks=2, schedule="1f1b")
    assert all(repr(n) in str(caught.value) for n in freed)
    assert "copy.deepcopy(model)" in str(caught.value)


def test_a_copy_taken_before_the_first_pipeline_still_trains_like_the_model():
    model = _model()
    kept = copy.deepcopy(model)
    _free_on_rank(model, 0)
    pipe = Pipeline(kept, chunks=2, balance=[2, 2], schedule="1f1b")
    x = torch.randn(4, 4, dtype=torch.float64)
    pipe.step(x, loss_fn=lambda y: y.square().mean())
    reference = _model()
    reference(x).square().mean().backward()
    for got, want in zip(kept.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=1e-14)


def test_a_model_built_on_meta_is_not_taken_for_a_freed_one():
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    model[0:2].to_empty(device="cpu")  # rank 0 allocated its own stage, as a Pipeline does
    _free_on_rank(model, 0)  # its other stage was on meta already: nothing freed
    pipe = Pipeline(model, chunks=2, balance=[2, 2], schedule="1f1b")
    assert not any(p.is_meta for p in pipe.parameters())
