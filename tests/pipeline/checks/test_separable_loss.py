"""A loss_fn that does not add up over micro-batches is told once, with the numbers and the fix.

The reference is the plain model's loss on the batch: where loss_fn is a
per-sample mean (or a sum with num_items=), the step's loss equals it and
nothing is said; where it is not, the step's loss differs from it, and the
warning says so.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from pipesched import BatchCoupledWarning, Pipeline

pytestmark = pytest.mark.usefixtures("fp64")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 4))


def _contrastive(o: torch.Tensor) -> torch.Tensor:
    o = nn.functional.normalize(o, dim=-1)
    return nn.functional.cross_entropy(o @ o.T / 0.1, torch.arange(o.shape[0]))


def _token_mean(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy's mean over the labels it keeps (-100 ignored)."""
    return nn.functional.cross_entropy(o, y, ignore_index=-100)


def _token_sum(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(o, y, ignore_index=-100, reduction="sum")


def _labels() -> torch.Tensor:
    y = torch.arange(12) % 4
    y[:5] = -100  # micro-batch 0 keeps 1 label of 6, micro-batch 1 all 6
    return y


CASES = {
    "contrastive": (_contrastive, None, {}, True),
    "token mean": (_token_mean, _labels(), {}, True),
    "sum without num_items": (_token_sum, _labels(), {}, True),
    "token sum with num_items": (_token_sum, _labels(), {"num_items": 7}, False),
    "mse mean": (nn.functional.mse_loss, torch.randn(12, 4), {}, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_loss_that_does_not_add_up_is_told_and_one_that_does_is_not(case: str) -> None:
    loss_fn, target, extra, mixes = CASES[case]
    x = torch.randn(12, 6)
    plain_model = _model()
    args = () if target is None else (target,)
    plain = loss_fn(plain_model(x), *args)
    if extra:
        plain = plain / extra["num_items"]
    pipe = Pipeline(_model(), 2, balance=[2, 1], devices=["cpu"] * 2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loss = pipe.step(x, target, loss_fn=loss_fn, **extra)
        pipe.step(x, target, loss_fn=loss_fn, **extra)  # told once per Pipeline
    told = [w for w in seen if issubclass(w.category, BatchCoupledWarning)]
    differs = not torch.allclose(loss, plain, rtol=1e-10, atol=0)
    assert differs == mixes  # the property the warning reports, against the plain model
    assert len(told) == (1 if mixes else 0)
    if mixes:
        assert "does not add up over micro-batches" in str(told[0].message)
        assert "num_items=" in str(told[0].message)


def test_the_check_leaves_the_random_state_and_the_step_as_they_were() -> None:
    """loss_fn runs twice more on the first step: no draw of it moves the user's generator,
    and one that draws is not judged (its values on a micro-batch do not repeat)."""

    def noisy(o: torch.Tensor) -> torch.Tensor:
        return (o + 0.01 * torch.randn_like(o)).square().mean()

    x = torch.randn(12, 6)
    states = []
    for check in (True, False):
        pipe = Pipeline(_model(), 2, balance=[2, 1], devices=["cpu"] * 2)
        if not check:  # as if already checked
            from pipesched.pipeline.checks import separable_loss

            separable_loss._checked.add(pipe)
        torch.manual_seed(5)
        with warnings.catch_warnings():
            warnings.simplefilter("error", BatchCoupledWarning)
            pipe.step(x, loss_fn=noisy)
        states.append((torch.get_rng_state(), [p.grad.clone() for p in pipe.parameters()]))
    assert torch.equal(states[0][0], states[1][0])
    for a, b in zip(states[0][1], states[1][1], strict=True):
        assert torch.equal(a, b)


def test_a_loss_in_half_precision_is_judged_at_its_precision() -> None:
    """A cross-entropy taken in bfloat16 rounds to 0.3%: that is no coupling."""
    x, y = torch.randn(12, 6), torch.arange(12) % 4
    pipe = Pipeline(_model(), 2, balance=[2, 1], devices=["cpu"] * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BatchCoupledWarning)
        pipe.step(x, y, loss_fn=lambda o, t: nn.functional.cross_entropy(o.bfloat16(), t).float())


def test_a_loss_fn_reading_a_model_outputs_attributes_is_checked() -> None:
    """The check once gave loss_fn a plain dict, so `out.logits` raised and nothing was told."""
    transformers = pytest.importorskip("transformers")
    from dataclasses import dataclass

    @dataclass
    class Output(transformers.utils.ModelOutput):
        logits: torch.Tensor | None = None

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 4)

        def forward(self, x):
            return Output(logits=self.b(self.a(x).tanh()))

    torch.manual_seed(0)
    pipe = Pipeline(Classifier(), 2, devices=["cpu"] * 2)
    x = torch.randn(12, 6)
    with pytest.warns(BatchCoupledWarning, match="does not add up"):
        pipe.step(x, loss_fn=lambda out: _contrastive(out.logits))


def test_num_items_in_batch_without_num_items_is_told() -> None:
    """The model's loss is a sum over num_items_in_batch; averaged by rows it was m times small."""
    from pipesched.errors import PipeschedWarning

    class Summing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 4)

        def forward(self, x, num_items_in_batch=None):
            per = self.b(self.a(x).tanh()).square().sum(-1)
            return {"loss": per.sum() / num_items_in_batch}

    torch.manual_seed(0)
    pipe = Pipeline(Summing(), 3, devices=["cpu"] * 2)
    x = torch.randn(12, 6)
    with pytest.warns(PipeschedWarning, match="no num_items=.*num_items_in_batch=1"):
        pipe.step({"x": x, "num_items_in_batch": 12}, loss_fn=lambda out: out["loss"])
    fresh = Pipeline(Summing(), 3, devices=["cpu"] * 2)
    with warnings.catch_warnings():  # the recipe it names: nothing to tell
        warnings.simplefilter("error", PipeschedWarning)
        fresh.step({"x": x, "num_items_in_batch": 1}, loss_fn=lambda o: o["loss"], num_items=12)
