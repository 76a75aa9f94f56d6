"""pipe(x) concatenates only outputs that follow the batch in dim 0."""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from pipesched import Pipeline


class Stats(nn.Module):
    """Per-sample logits, a per-feature mean over the batch, and a weight norm."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.head = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.inner(x))
        norms = (self.inner.weight**2).sum(1)  # (16,): the same for every batch
        return {"out": self.head(h), "mean": h.mean(0), "norms": norms}


def _called(pipe: Pipeline, x: torch.Tensor) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = pipe(x)
    return out, [str(w.message) for w in seen if "not per sample" in str(w.message)]


def test_a_traced_models_batch_statistic_is_not_concatenated_and_a_constant_is_exact():
    torch.manual_seed(0)
    model = Stats().double()
    plain = copy.deepcopy(model)
    x = torch.randn(8, 8, dtype=torch.float64)  # 4 even micro-batches: only the export can tell
    out, (message,) = _called(Pipeline(model, chunks=4, devices=["cpu", "cpu"]), x)
    expected = plain(x)
    torch.testing.assert_close(out["out"], expected["out"], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(out["norms"], expected["norms"], rtol=1e-12, atol=0)
    out["norms"].sum().backward()  # its gradient is the plain model's
    expected["norms"].sum().backward()
    torch.testing.assert_close(model.inner.weight.grad, plain.inner.weight.grad)
    assert isinstance(out["mean"], list) and len(out["mean"]) == 4
    for got, part in zip(out["mean"], x.tensor_split(4), strict=True):
        torch.testing.assert_close(got, plain(part)["mean"], rtol=1e-12, atol=1e-14)
    assert "output['mean']" in message and "[2, 2, 2, 2] rows" in message


def test_uneven_micro_batches_show_a_sequentials_non_per_sample_output():
    class Last(nn.Module):
        def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return h, h.mean(0)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), Last()).double()
    x = torch.randn(10, 8, dtype=torch.float64)  # rows 3, 3, 2, 2
    (rows, means), (message,) = _called(Pipeline(model, chunks=4, devices=["cpu", "cpu"]), x)
    torch.testing.assert_close(rows, model(x)[0], rtol=1e-12, atol=1e-14)
    assert isinstance(means, list) and [m.shape for m in means] == [(6,)] * 4
    assert "output[1]" in message


def test_per_sample_outputs_are_joined_silently():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.Tanh()).double()
    x = torch.randn(10, 8, dtype=torch.float64)
    out, messages = _called(Pipeline(model, chunks=4, devices=["cpu", "cpu"]), x)
    assert messages == []
    torch.testing.assert_close(out, model(x), rtol=1e-12, atol=1e-14)


def test_an_output_sized_by_the_sequence_not_the_batch_is_not_concatenated():
    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.inner(x)  # (batch, tokens, 4)
            return h, h.mean(0)  # the second: (tokens, 4), dim 0 a symbol of the sequence

    torch.manual_seed(0)
    model = Tokens().double()
    x = torch.randn(6, 5, 4, dtype=torch.float64)
    (h, means), (message,) = _called(Pipeline(model, chunks=2, devices=["cpu", "cpu"]), x)
    torch.testing.assert_close(h, model(x)[0], rtol=1e-12, atol=1e-14)
    assert [m.shape for m in means] == [(5, 4)] * 2 and "output[1]" in message
