"""Draws from a user's own torch.Generator, and draws in backward (INVARIANTS 37; issue 25)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from pipesched import Pipeline, is_recomputing
from pipesched.runtime.stage.draw_keys import StepSeed
from pipesched.runtime.stage.seeding import StageSeeding, UnseededDraws

pytestmark = pytest.mark.usefixtures("fp64")


class OwnDropout(nn.Module):
    """Dropout drawing its mask from a generator of its own; records the forward's masks."""

    def __init__(self, generator: torch.Generator, kind: str) -> None:
        super().__init__()
        self.g, self.kind = generator, kind
        self.masks: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "rand":
            mask = (torch.rand(x.shape, generator=self.g) > 0.5).to(x.dtype)
        elif self.kind == "bernoulli":
            mask = torch.bernoulli(torch.full_like(x, 0.5), generator=self.g)
        else:
            mask = (torch.randn(x.shape, generator=self.g) > 0).to(x.dtype)
        if not is_recomputing():
            self.masks.append(mask)
        return x * mask * 2


class Replay(nn.Module):
    """The plain model's stand-in for OwnDropout: multiplies by the recorded masks, in order."""

    def __init__(self, masks: list[torch.Tensor]) -> None:
        super().__init__()
        self.masks = list(masks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.masks.pop(0) * 2


def _model(g1: torch.Generator, g2: torch.Generator, kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 6), OwnDropout(g1, kind), nn.Tanh(),
        nn.Linear(6, 6), OwnDropout(g2, kind), nn.Linear(6, 6),
    )  # fmt: skip


X, Y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)


def _grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _step(mode: str, kind: str, *, shared: bool, schedule: str = "gpipe") -> nn.Sequential:
    g1 = torch.Generator().manual_seed(1)
    g2 = g1 if shared else torch.Generator().manual_seed(2)
    model = _model(g1, g2, kind)
    pipe = Pipeline(model, 4, balance=[3, 3], devices=["cpu", "cpu"], checkpoint=mode,
                    schedule=schedule)  # fmt: skip
    pipe.step(X, Y, loss_fn=nn.functional.mse_loss)
    return model


@pytest.mark.parametrize("kind", ["rand", "bernoulli", "randn"])
def test_own_generator_recomputed_exactly(kind: str) -> None:
    never = _grads(_step("never", kind, shared=False))
    for mode in ("always", "except_last"):
        assert torch.equal(_grads(_step(mode, kind, shared=False)), never), mode
    # Against the plain model fed the masks the forward drew, micro-batch by micro-batch.
    model = _step("always", kind, shared=False)
    plain = _model(torch.Generator(), torch.Generator(), kind)
    plain[1], plain[4] = Replay(model[1].masks), Replay(model[4].masks)
    for i in range(4):
        rows = slice(2 * i, 2 * i + 2)
        (nn.functional.mse_loss(plain(X[rows]), Y[rows]) / 4).backward()
    torch.testing.assert_close(_grads(model), _grads(plain), rtol=1e-12, atol=1e-14)


def test_generator_shared_by_two_stages_repeats() -> None:
    first = _grads(_step("except_last", "rand", shared=True))
    for _ in range(4):
        assert torch.equal(_grads(_step("except_last", "rand", shared=True)), first)
    for schedule in ("1f1b", "zb-h1"):  # nor does the schedule change the numbers
        assert torch.equal(_grads(_step("never", "rand", shared=True, schedule=schedule)), first)


def test_generator_moves_and_seeds() -> None:
    g = torch.Generator().manual_seed(3)
    model = _model(g, g, "rand")
    pipe = Pipeline(model, 4, balance=[3, 3], devices=["cpu", "cpu"])
    before = g.get_state()
    pipe.step(X, Y, loss_fn=nn.functional.mse_loss)
    assert not torch.equal(before, g.get_state())  # one draw per step, as a step seed
    cpu = torch.default_generator.get_state()
    pipe.step(X, Y, loss_fn=nn.functional.mse_loss)
    assert torch.equal(cpu, torch.default_generator.get_state())  # the CPU's is not touched


class Noisy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x * 1

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return g + 0.01 * torch.randn_like(g)


class NoisyGrad(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Noisy.apply(x)


def _noisy_grads(mode: str, schedule: str) -> torch.Tensor:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), NoisyGrad(), nn.Linear(4, 4),
                          nn.Linear(4, 4), NoisyGrad(), nn.Linear(4, 4))  # fmt: skip
    pipe = Pipeline(model, 4, balance=[3, 3], devices=["cpu", "cpu"], checkpoint=mode,
                    schedule=schedule)  # fmt: skip
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    for _ in range(2):
        pipe.step(x, y, loss_fn=nn.functional.mse_loss)
    return _grads(model)


def test_draws_in_backward_of_two_stages_are_seeded() -> None:
    """Was: UnseededDraws blaming another thread (the rerun did not seed stage 0's backward)."""
    first = _noisy_grads("never", "gpipe")
    assert torch.equal(_noisy_grads("never", "gpipe"), first)
    assert torch.equal(_noisy_grads("always", "zb-h1"), first)


def _draw_elsewhere() -> None:
    """A draw from the default generator on another thread (as an autograd device thread)."""
    thread = threading.Thread(target=lambda: torch.rand(1))
    thread.start()
    thread.join()


@pytest.mark.parametrize("backward", [False, True])
def test_unseedable_draw_message(backward: bool) -> None:
    """A rerun that trips again says where, in which pass, and what to change."""
    seeding = StageSeeding({}, NoisyGrad(), torch.device("cpu"), adaptive=True,
                           label="stage 1")  # fmt: skip
    seeding.begin()
    seeding.settle()  # learned: nothing draws, tripwires on
    seeding.probe()  # the rerun
    seeding.full = {True: False, False: False}  # (forward: as if the rerun learned nothing)
    pass_ = seeding.backward if backward else seeding.forward
    with pytest.raises(UnseededDraws) as info, pass_(StepSeed(), 3):
        _draw_elsewhere()
    text = str(info.value)
    assert "stage 1" in text and "micro-batch 3" in text and "put back" in text
    if backward:
        assert "autograd.Function" in text and "save_for_backward" in text
    else:
        assert "another thread" in text and "torch.Generator of its own" in text
