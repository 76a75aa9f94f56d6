"""Interrupt mid-window, save, resume in a fresh Pipeline: bit-identical to never stopping."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from pipesched import GradientAccumulator, Pipeline

STEPS, WINDOW = 7, 3


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16),
        nn.Dropout(0.2),
        nn.ReLU(),
        nn.Linear(16, 16),
        nn.Dropout(0.1),
        nn.Tanh(),
        nn.Linear(16, 4),
    )


def _setup():
    pipe = Pipeline(_model(), 4, balance=[3, 4], devices=["cpu", "cpu"], schedule="1f1b")
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1)
    return pipe, GradientAccumulator(
        pipe,
        optimizer,
        accumulation_steps=WINDOW,
        max_grad_norm=1.0,
        scaler=scaler,
        lr_scheduler=scheduler,
    )


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(10, 6, generator=g), torch.randn(10, 4, generator=g)


def _train(acc: GradientAccumulator, steps: range) -> None:
    for step in steps:
        x, y = _data(step)
        acc.step(x, y, loss_fn=nn.functional.mse_loss)


def test_resume_mid_window_is_bit_identical(tmp_path):
    torch.manual_seed(42)
    pipe, acc = _setup()
    _train(acc, range(STEPS))
    acc.flush()
    expected = {k: v.clone() for k, v in pipe.state_dict().items()}

    torch.manual_seed(42)
    pipe, acc = _setup()
    _train(acc, range(4))  # 4 = one window and one step into the next
    assert acc.position == 1
    path = os.path.join(tmp_path, "ckpt.pt")
    acc.save(path)
    del pipe, acc
    torch.manual_seed(12345)  # the resumed run must not depend on the RNG before loading

    pipe, acc = _setup()
    acc.load(path)
    assert acc.position == 1 and acc.steps == 4 and acc.windows == 1
    _train(acc, range(4, STEPS))
    acc.flush()
    for key, value in pipe.state_dict().items():
        assert torch.equal(value, expected[key]), key


@pytest.mark.parametrize("sharded", [False, True])
def test_a_resumed_window_reports_the_rows_of_its_steps_before_the_save(tmp_path, sharded):
    _, acc = _setup()
    _train(acc, range(4))
    path = os.path.join(tmp_path, "ckpt")
    acc.save(path, sharded=sharded)
    x, y = _data(4)
    expected = acc.step(x[:7], y[:7], loss_fn=nn.functional.mse_loss)
    assert expected.step_rows == (10, 7)
    _, acc = _setup()
    acc.load(path)
    assert acc.step(x[:7], y[:7], loss_fn=nn.functional.mse_loss) == expected


def test_save_is_atomic(tmp_path, monkeypatch):
    _, acc = _setup()
    path = tmp_path / "ckpt.pt"
    acc.save(str(path))
    before = path.read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        acc.save(str(path))
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # no temporary file left behind
