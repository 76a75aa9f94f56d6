"""The CUDA path: streams, events, copies between devices. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipesched import Pipeline

pytestmark = pytest.mark.cuda  # skipped without CUDA (tests/conftest.py)


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


def _dropout_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.Dropout(0.5),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.Dropout(0.3),
        nn.Tanh(),
        nn.Linear(32, 8),
    ).double()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_checkpoint_modes_are_bitwise_equal_with_dropout_on_two_streams_of_one_device(schedule):
    # INVARIANT 12 on CUDA: both stages on cuda:0, each on its own stream; the CUDA
    # generator's draws are seeded per stage and micro-batch as on CPU.
    results = []
    for mode in ("always", "except_last", "never"):
        pipe = Pipeline(
            _dropout_model(),
            4,
            balance=[4, 3],
            devices=["cuda:0", "cuda:0"],
            schedule=schedule,
            checkpoint=mode,
        )
        torch.manual_seed(7)
        x = torch.randn(10, 16, dtype=torch.float64, device="cuda:0")
        y = torch.randn(10, 8, dtype=torch.float64, device="cuda:0")
        loss = pipe.step(x, y, loss_fn=nn.functional.mse_loss)
        results.append((loss, {n: p.grad.clone() for n, p in pipe.named_parameters()}))
    (loss0, grads0), *rest = results
    for loss, grads in rest:
        assert torch.equal(loss, loss0)
        for name, grad in grads0.items():
            assert torch.equal(grads[name], grad), name


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_fused_linear_on_cuda_equals_the_plain_model(schedule, monkeypatch):
    # Weight gradients accumulated in the GEMM (on by default from MIN_FUSED_BYTES),
    # on CUDA streams: the big layer is fused once per micro-batch and equals autograd.
    from pipesched.runtime.deferred_ops import _Linear as _DeferredLinear
    from pipesched.runtime.fused_linear import MIN_FUSED_BYTES, _FusedLinear

    wide = MIN_FUSED_BYTES // 8 // 16  # a (wide, 16) fp64 weight of MIN_FUSED_BYTES

    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, wide), nn.Linear(wide, 8)
        ).double()

    x = torch.randn(8, 16, dtype=torch.float64, device="cuda")
    y = torch.randn(8, 8, dtype=torch.float64, device="cuda")
    plain = model().cuda()
    nn.functional.mse_loss(plain(x), y).backward()
    fused: list[torch.Tensor] = []
    original = _FusedLinear.forward
    original_deferred = _DeferredLinear.forward

    def recording(ctx, x, weight, *args):
        fused.append(weight)
        return original(ctx, x, weight, *args)

    def recording_deferred(ctx, x, weight, *args):
        if id(weight) in args[2].fused:  # zb-h1: W accumulates it inside the GEMM
            fused.append(weight)
        return original_deferred(ctx, x, weight, *args)

    monkeypatch.setattr(_FusedLinear, "forward", staticmethod(recording))
    monkeypatch.setattr(_DeferredLinear, "forward", staticmethod(recording_deferred))
    cut = model()
    pipe = Pipeline(
        cut, 4, balance=[2, 2], devices=_devices(2), schedule=schedule, checkpoint="never"
    )
    pipe.step(x, y, loss_fn=nn.functional.mse_loss)
    # Only cut[2] has a weight of MIN_FUSED_BYTES (cut[3]'s is half that): fused once per
    # micro-batch, the small layers not at all.
    assert [w is cut[2].weight for w in fused] == [True] * 4
    for (name, p), q in zip(pipe.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad.to("cuda"), q.grad, rtol=1e-10, atol=1e-12, msg=name)
