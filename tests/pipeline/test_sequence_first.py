"""Layers that take (sequence, batch, ...) inputs are named at construction; the warning is true."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from pipesched import Pipeline
from pipesched.errors import PipeschedWarning


class Recurrent(nn.Module):
    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.rnn = nn.GRU(4, 6, batch_first=batch_first)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


def _built(model: nn.Module) -> tuple[Pipeline, list[str]]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pipe = Pipeline(model, chunks=2, devices=["cpu", "cpu"])
    found = [str(w.message) for w in seen if issubclass(w.category, PipeschedWarning)]
    return pipe, [m for m in found if "batch_first=False" in m]


def test_a_sequence_first_gru_is_named_and_the_pipeline_does_differ_from_the_model():
    torch.manual_seed(0)
    model = Recurrent(batch_first=False).double()
    plain = copy.deepcopy(model)
    pipe, (message,) = _built(model)
    assert "(rnn)" in message and "batch_first=True" in message
    x = torch.randn(6, 4, 4, dtype=torch.float64)  # (sequence, batch, features): the GRU reads
    assert not torch.allclose(pipe(x), plain(x))  # dim 0, the sequence, was cut


def test_batch_first_layers_are_silent_and_exact():
    torch.manual_seed(0)
    model = Recurrent(batch_first=True).double()
    plain = copy.deepcopy(model)
    pipe, messages = _built(model)
    assert messages == []
    x = torch.randn(6, 4, 4, dtype=torch.float64)  # (batch, sequence, features)
    torch.testing.assert_close(pipe(x), plain(x), rtol=1e-12, atol=1e-14)


@pytest.mark.filterwarnings("ignore:enable_nested_tensor")
def test_a_transformer_is_named_once_not_each_attention_inside_it():
    model = nn.Sequential(nn.Transformer(8, 2, 1, 1, 16), nn.Identity())
    _, (message,) = _built(model)
    assert "(0)" in message and "self_attn" not in message
