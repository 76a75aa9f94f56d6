"""A forward updating buffers is told: it does per micro-batch what the plain model does once."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from pipesched import Pipeline
from pipesched.errors import PipeschedWarning

pytestmark = pytest.mark.usefixtures("fp64")


class _Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return self.lin(x)


def _told(model: nn.Module, chunks: int) -> list[str]:
    pipe = Pipeline(model, chunks, balance=[1, len(model) - 1], devices=["cpu"] * 2)
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pipe.step(x, y, loss_fn=nn.functional.mse_loss)
        pipe.step(x, y, loss_fn=nn.functional.mse_loss)  # once per Pipeline
    return [str(w.message) for w in seen if issubclass(w.category, PipeschedWarning)]


def test_a_counter_and_a_spectral_norm_updated_per_micro_batch_are_told_once() -> None:
    """Against the plain model: its counter counts 1 a step, the pipeline's 4: told."""
    torch.manual_seed(0)
    norm = torch.nn.utils.parametrizations.spectral_norm(nn.Linear(6, 6))
    model = nn.Sequential(nn.Linear(6, 6), _Counting(), norm)
    (message,) = _told(model, 4)
    assert int(model[1].calls) == 8  # 4 micro-batches, 2 steps; the plain model: 2
    assert "'1.calls'" in message and "_u'" in message and "4 times this step" in message


def test_a_forward_that_updates_nothing_but_batch_norms_is_not_told_here() -> None:
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 6))
    messages = _told(model, 4)
    assert not [m for m in messages if "updated buffer" in m]  # BatchNorm's warning says it
    assert [m for m in messages if "BatchNorm" in m]


def test_one_micro_batch_is_the_plain_model_and_is_not_told() -> None:
    model = nn.Sequential(nn.Linear(6, 6), _Counting(), nn.Linear(6, 6))
    assert _told(model, 1) == []


def test_a_warning_made_an_error_after_the_step_ran_leaves_nothing_half_done() -> None:
    """Under -W error the warning raised after the commit: gradients stayed in .grad, the
    accumulator uncounted, and Ctrl-C held for good (the step was never kept nor undone)."""
    import signal

    from pipesched import GradientAccumulator

    model = nn.Sequential(nn.Linear(6, 6), _Counting(), nn.Linear(6, 6))
    pipe = Pipeline(model, 4, balance=[1, 2], devices=["cpu"] * 2)
    acc = GradientAccumulator(
        pipe, torch.optim.SGD(pipe.parameters(), lr=0.1), accumulation_steps=2
    )
    handler = signal.getsignal(signal.SIGINT)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PipeschedWarning)
        with pytest.raises(PipeschedWarning, match="updated buffer"):
            acc.step(torch.randn(8, 6), torch.randn(8, 6), loss_fn=nn.functional.mse_loss)
    assert all(p.grad is None for p in model.parameters()) and acc.steps == 0
    assert signal.getsignal(signal.SIGINT) is handler


def test_a_counter_updated_per_micro_batch_in_pipe_x_is_told_too() -> None:
    """Before, silent where a model trained through pipe(x) and loss.backward()."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), _Counting(), nn.Linear(6, 6))
    pipe = Pipeline(model, 4, balance=[1, 2], devices=["cpu"] * 2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pipe(torch.randn(8, 6)).sum().backward()
        pipe(torch.randn(8, 6)).sum().backward()  # once per Pipeline
    (message,) = [str(w.message) for w in seen if issubclass(w.category, PipeschedWarning)]
    assert int(model[1].calls) == 8 and "'1.calls'" in message and "4 times" in message
