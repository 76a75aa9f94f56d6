"""pipesched against torchgpipe, the anchor, where torchgpipe supports the case."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipesched import Pipeline

torchgpipe = pytest.importorskip("torchgpipe")


pytestmark = pytest.mark.usefixtures("fp64")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 3))


@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("batch", [4, 9, 16])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_outputs_and_gradients_equal_torchgpipe(schedule, checkpoint, batch, chunks):
    ours_model, theirs_model = _model(), _model()
    theirs = torchgpipe.GPipe(
        theirs_model, balance=[2, 3], devices=["cpu", "cpu"], chunks=chunks, checkpoint=checkpoint
    )
    pipe = Pipeline(
        ours_model,
        chunks,
        balance=[2, 3],
        devices=["cpu", "cpu"],
        schedule=schedule,
        checkpoint=checkpoint,
    )
    x, y = torch.randn(batch, 5), torch.randn(batch, 3)
    expected = theirs(x)
    torch.testing.assert_close(pipe(x), expected, rtol=1e-12, atol=1e-14)
    nn.functional.mse_loss(expected, y).backward()
    for p in ours_model.parameters():
        p.grad = None
    pipe.step(x, y, loss_fn=nn.functional.mse_loss)
    for (name, ours), theirs_p in zip(
        pipe.named_parameters(), theirs_model.parameters(), strict=True
    ):
        torch.testing.assert_close(ours.grad, theirs_p.grad, rtol=1e-12, atol=1e-14, msg=name)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_deferred_batch_norm_equals_torchgpipes_where_it_commits(schedule):
    # torchgpipe commits only when a batch yields exactly `chunks` micro-batches, and
    # stores a biased variance: compare running means (and variances via momentum 0.1
    # on large batches, where bias is negligible only approximately) on such batches.
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))

    theirs = torchgpipe.GPipe(
        model(), balance=[2, 1], devices=["cpu", "cpu"], chunks=4, deferred_batch_norm=True
    )
    pipe = Pipeline(
        model(),
        4,
        balance=[2, 1],
        devices=["cpu", "cpu"],
        schedule=schedule,
        deferred_batch_norm=True,
    )
    for _ in range(2):
        x = torch.randn(16, 4)
        theirs(x)
        pipe(x)
    ours_bn, theirs_bn = pipe.get_submodule("1"), theirs.partitions[0][1]
    torch.testing.assert_close(ours_bn.running_mean, theirs_bn.running_mean, rtol=1e-12, atol=1e-14)
    assert int(ours_bn.num_batches_tracked) == int(theirs_bn.num_batches_tracked) == 2
