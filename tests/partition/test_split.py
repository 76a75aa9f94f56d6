"""Layers are split by what their code does: a BatchNorm subclass with its own forward runs it."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from pipesched import MicroBatchNormWarning, Pipeline
from pipesched.runtime.stage.batchnorm import DeferredBatchNorm

pytestmark = pytest.mark.usefixtures("fp64")


class Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0


class BatchNormAct(nn.BatchNorm2d):
    """Like timm's BatchNormAct2d: normalizes, then a child module's activation (ReLU, x2)."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels)
        self.act = nn.Sequential(nn.ReLU(), Scale())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(super().forward(x))


class CheckedBatchNorm(nn.BatchNorm2d):
    """A subclass that keeps torch's forward: still a plain BatchNorm."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        assert input.dim() == 4


class Net(nn.Module):
    def __init__(self, norm: type[nn.BatchNorm2d] = BatchNormAct) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = norm(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn2(self.conv2(self.bn(self.conv(x))))
        return self.head(h.mean((2, 3)))


def _sequential(norm: type[nn.BatchNorm2d] = BatchNormAct) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        norm(4),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 5),
    )


def _pair(make):
    torch.manual_seed(0)
    plain = make()
    torch.manual_seed(0)
    return plain, make()


def _pipe(module: nn.Module, chunks: int, x: torch.Tensor, **kwargs) -> Pipeline:
    traced = not isinstance(module, nn.Sequential)
    return Pipeline(
        module,
        chunks=chunks,
        devices=["cpu"] * 2,
        example_inputs=(x[:2],) if traced else None,
        num_stages=2 if traced else None,
        balance=None if traced else [2, 5],
        **kwargs,
    )


MAKERS = {"traced": Net, "sequential": _sequential}


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("kind", MAKERS)
def test_batchnorm_subclass_with_its_own_forward_in_eval_is_the_plain_model(kind, chunks):
    plain, piped = _pair(MAKERS[kind])
    warm = torch.randn(6, 3, 5, 5)
    for m in (plain, piped):  # running statistics that are not the defaults
        m.train()(warm)
        m.eval()
    x = torch.randn(8, 3, 5, 5)
    pipe = _pipe(piped, chunks, x).eval()
    out = pipe(x)
    if chunks == 1:
        assert torch.equal(out, plain(x))
    else:
        torch.testing.assert_close(out, plain(x), rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("kind", MAKERS)
def test_batchnorm_subclass_in_training_equals_the_plain_model_per_microbatch(kind, deferred):
    plain, piped = _pair(MAKERS[kind])
    x, y = torch.randn(8, 3, 5, 5), torch.randn(8, 5)
    pipe = _pipe(piped, 4, x, deferred_batch_norm=deferred)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = pipe.step(x, y, loss_fn=nn.functional.mse_loss)
    subclass = piped.bn if kind == "traced" else piped[1]
    assert type(subclass) is BatchNormAct  # deferred_batch_norm leaves its forward in place
    pairs = zip(x.chunk(4), y.chunk(4), strict=True)
    expected = sum(nn.functional.mse_loss(plain(a), b) for a, b in pairs)
    (expected / 4).backward()
    torch.testing.assert_close(loss, expected.detach() / 4, rtol=1e-12, atol=0)
    plain_params = dict(plain.named_parameters())
    for name, p in piped.named_parameters():
        torch.testing.assert_close(p.grad, plain_params[name].grad, rtol=1e-10, atol=1e-13)
    reference = plain.bn if kind == "traced" else plain[1]
    # its running statistics move once per micro-batch, as the plain model's run per micro-batch
    torch.testing.assert_close(subclass.running_mean, reference.running_mean, rtol=1e-12, atol=0)
    torch.testing.assert_close(subclass.running_var, reference.running_var, rtol=1e-12, atol=0)
    assert int(subclass.num_batches_tracked) == int(reference.num_batches_tracked) == 4
    messages = [str(w.message) for w in caught if issubclass(w.category, MicroBatchNormWarning)]
    assert len(messages) == 1
    name = "bn" if kind == "traced" else "1"
    assert f"{name} runs its own forward" in messages[0]  # told, with the fix, even if deferred


@pytest.mark.parametrize("kind", MAKERS)
def test_a_subclass_keeping_torchs_forward_stays_a_deferred_batchnorm(kind):
    plain, piped = _pair(lambda: MAKERS[kind](CheckedBatchNorm))
    x = torch.randn(8, 3, 5, 5)
    pipe = _pipe(piped, 4, x, deferred_batch_norm=True)
    out = pipe(x)
    layer = piped.bn if kind == "traced" else piped[1]
    assert isinstance(layer, DeferredBatchNorm)
    expected = torch.cat([plain(a) for a in x.chunk(4)])  # normalized per micro-batch
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-14)
    _, whole = _pair(lambda: MAKERS[kind](CheckedBatchNorm))
    whole.train()(x)  # running statistics of the whole batch
    reference = whole.bn if kind == "traced" else whole[1]
    torch.testing.assert_close(layer.running_mean, reference.running_mean, rtol=1e-12, atol=0)
    torch.testing.assert_close(layer.running_var, reference.running_var, rtol=1e-12, atol=0)


class DropoutAct(nn.Dropout):
    """A Dropout subclass whose forward adds a child's activation: also run as written."""

    def __init__(self, p: float) -> None:
        super().__init__(p)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(super().forward(x))


def test_a_dropout_subclass_with_its_own_forward_in_eval_is_the_plain_model():
    class Small(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.drop, self.b = nn.Linear(4, 8), DropoutAct(0.5), nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.drop(self.a(x)))

    plain, piped = _pair(Small)
    x = torch.randn(6, 4)
    pipe = Pipeline(piped.eval(), chunks=1, devices=["cpu"] * 2, example_inputs=(x[:2],))
    assert torch.equal(pipe(x), plain.eval()(x))
