"""The CUDA path: streams, events, copies between devices. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipesched import Pipeline

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8)
    ).double()


def _devices(n: int) -> list[str]:
    count = torch.cuda.device_count()
    return [f"cuda:{i % count}" for i in range(n)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zb-v"])
@pytest.mark.parametrize("checkpoint", ["except_last", "never"])
def test_gradients_on_cuda_equal_the_plain_model(schedule, checkpoint):
    plain = _model().cuda()
    workers = 2
    stages = workers * (2 if schedule in ("interleaved-1f1b", "zb-v") else 1)
    balance = [5 // stages + (s < 5 % stages) for s in range(stages)]
    if 0 in balance:
        pytest.skip("more stages than layers")
    pipe = Pipeline(
        _model(),
        4,
        balance=balance,
        devices=_devices(workers),
        schedule=schedule,
        checkpoint=checkpoint,
    )
    x = torch.randn(10, 16, dtype=torch.float64, device="cuda")
    y = torch.randn(10, 8, dtype=torch.float64, device="cuda")
    loss = pipe.step(x, y, loss_fn=nn.functional.mse_loss)
    expected = nn.functional.mse_loss(plain(x), y)
    expected.backward()
    torch.testing.assert_close(loss.to("cuda"), expected.detach(), rtol=1e-10, atol=1e-12)
    for (name, p), q in zip(pipe.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad.to("cuda"), q.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_stages_live_on_their_devices_and_forward_is_transparent():
    devices = _devices(2)
    pipe = Pipeline(_model(), 2, balance=[3, 2], devices=devices)
    assert {p.device for p in pipe.stages[0].parameters()} == {torch.device(devices[0])}
    assert {p.device for p in pipe.stages[1].parameters()} == {torch.device(devices[1])}
    x = torch.randn(6, 16, dtype=torch.float64, device=devices[0])
    out = pipe(x)
    assert out.device == torch.device(devices[1])
    out.sum().backward()
    assert all(p.grad is not None for p in pipe.parameters())


def test_autocast_bf16_on_cuda():
    pipe = Pipeline(_model().float(), 2, balance=[3, 2], devices=_devices(2))
    x = torch.randn(6, 16, device=_devices(2)[0])
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = pipe(x)
    assert out.dtype == torch.bfloat16
