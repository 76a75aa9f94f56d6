"""Accumulation windows against full-batch training (INVARIANTS 5-11)."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from torch import nn

from pipesched import ConfigError, GradientAccumulator, Pipeline
from pipesched.errors import PipeschedWarning

RTOL, ATOL = 1e-12, 1e-14


pytestmark = pytest.mark.usefixtures("fp64")


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def _pipe(model: nn.Module, schedule: str = "1f1b", chunks: int = 3) -> Pipeline:
    return Pipeline(model, chunks, balance=[2, 3], devices=["cpu", "cpu"], schedule=schedule)


def _batches(sizes: list[int], seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g)) for n in sizes]


def _close(a: nn.Module, b: nn.Module, rtol: float = RTOL, atol: float = ATOL) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("sizes", [[4, 4, 4], [7, 2, 9], [1, 10, 3]])
def test_a_window_equals_one_big_batch(schedule, sizes):
    # INVARIANTS 5 and 8 (SGD): S steps x k chunks == one S*k batch, uneven sizes included.
    plain, piped = _model(), _model()
    pipe = _pipe(piped, schedule)
    acc = GradientAccumulator(
        pipe, torch.optim.SGD(pipe.parameters(), lr=0.1), accumulation_steps=len(sizes)
    )
    reference = torch.optim.SGD(plain.parameters(), lr=0.1)
    for window in range(2):
        batches = _batches(sizes, seed=window)
        for x, y in batches:
            result = acc.step(x, y, loss_fn=nn.functional.mse_loss)
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        loss = nn.functional.mse_loss(plain(x), y)
        loss.backward()
        reference.step()
        reference.zero_grad()
        assert result.stepped and result.window == window + 1
        assert result.window_loss == pytest.approx(float(loss.detach()), rel=1e-12)
        assert result.effective_batch == sum(sizes)
        _close(pipe, plain)


def test_grad_is_never_rescaled_mid_window():
    # INVARIANT 5: mid-window .grad holds the gradient of the plain SUM of losses so far.
    plain, piped = _model(), _model()
    pipe = _pipe(piped)
    acc = GradientAccumulator(
        pipe, torch.optim.SGD(pipe.parameters(), lr=0.1), accumulation_steps=3
    )
    for x, y in _batches([4, 6]):
        acc.step(x, y, loss_fn=nn.functional.mse_loss)
        nn.functional.mse_loss(plain(x), y, reduction="sum").div(3).backward()  # mse: mean over 3
    for (name, p), q in zip(pipe.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=name)


def test_incomplete_last_window_is_normalized_by_its_own_content():
    # INVARIANT 6.
    plain, piped = _model(), _model()
    pipe = _pipe(piped)
    acc = GradientAccumulator(
        pipe, torch.optim.SGD(pipe.parameters(), lr=0.1), accumulation_steps=4
    )
    batches = _batches([5, 3])
    for x, y in batches:
        assert not acc.step(x, y, loss_fn=nn.functional.mse_loss).stepped
    result = acc.flush()
    assert result is not None and result.stepped and result.effective_batch == 8
    assert acc.flush() is None
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    nn.functional.mse_loss(plain(x), y).backward()
    torch.optim.SGD(plain.parameters(), lr=0.1).step()
    _close(pipe, plain)


def test_token_weighted_windows_equal_one_token_mean():
    # INVARIANT 3 across a window, and the common recipe shown to differ.
    torch.manual_seed(0)
    vocab = 7
    plain = nn.Sequential(nn.Embedding(vocab, 6), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, vocab))
    piped = copy.deepcopy(plain)
    pipe = Pipeline(piped, 2, balance=[2, 2], devices=["cpu", "cpu"], schedule="zb-h1")
    acc = GradientAccumulator(
        pipe, torch.optim.SGD(pipe.parameters(), lr=1.0), accumulation_steps=2
    )

    def token_sum(logits, labels):
        return nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        )

    g = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, vocab, (4, 6), generator=g) for _ in range(2)]
    labels = [torch.randint(0, vocab, (4, 6), generator=g) for _ in range(2)]
    labels[0][:, 2:] = -100  # 8 tokens in the first step, 24 in the second
    counts = [int((lab != -100).sum()) for lab in labels]
    for t, lab, n in zip(tokens, labels, counts, strict=True):
        acc.step(t, lab, loss_fn=token_sum, num_items=n)
    logits = plain(torch.cat(tokens))
    loss = nn.functional.cross_entropy(
        logits.flatten(0, 1), torch.cat(labels).flatten(), ignore_index=-100
    )
    loss.backward()
    grads = {n: p.grad.clone() for n, p in plain.named_parameters()}
    torch.optim.SGD(plain.parameters(), lr=1.0).step()
    _close(pipe, plain)

    # The recipe (mean of each step's token mean) / steps gives other gradients.
    recipe = copy.deepcopy(plain)
    recipe.load_state_dict(copy.deepcopy(_model_state_before(plain, grads)))
    for t, lab in zip(tokens, labels, strict=True):
        out = recipe(t)
        (
            nn.functional.cross_entropy(out.flatten(0, 1), lab.flatten(), ignore_index=-100) / 2
        ).backward()
    difference = max(float((p.grad - grads[n]).abs().max()) for n, p in recipe.named_parameters())
    assert difference > 1e-3


def _model_state_before(model: nn.Module, grads: dict[str, torch.Tensor]) -> dict:
    # Undo the SGD step (lr 1) to get the weights the gradients were taken at.
    return {n: p.detach() + grads[n] for n, p in model.named_parameters()}


def test_each_window_steps_optimizer_scheduler_and_scaler_once():
    # INVARIANT 7.
    pipe = _pipe(_model())
    optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    acc = GradientAccumulator(
        pipe, optimizer, accumulation_steps=3, lr_scheduler=scheduler, scaler=scaler
    )
    with (
        mock.patch.object(optimizer, "step", wraps=optimizer.step) as opt_step,
        mock.patch.object(scheduler, "step", wraps=scheduler.step) as sched_step,
        mock.patch.object(scaler, "update", wraps=scaler.update) as scaler_update,
    ):
        for x, y in _batches([4] * 7):
            acc.step(x, y, loss_fn=nn.functional.mse_loss)
        acc.flush()
    assert opt_step.call_count == sched_step.call_count == scaler_update.call_count == 3
    state = optimizer.state[next(iter(pipe.parameters()))]
    assert int(state["step"]) == 3 == acc.windows
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 / 8)


def test_adamw_after_windows_equals_full_batch_adamw():
    # INVARIANT 8 (AdamW).
    plain, piped = _model(), _model()
    pipe = _pipe(piped)
    acc = GradientAccumulator(
        pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-2), accumulation_steps=2
    )
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for window in range(3):
        batches = _batches([3, 8], seed=window)
        for x, y in batches:
            acc.step(x, y, loss_fn=nn.functional.mse_loss)
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        nn.functional.mse_loss(plain(x), y).backward()
        reference.step()
        reference.zero_grad()
    _close(pipe, plain, rtol=1e-10, atol=1e-12)


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(8, 8)
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.used(x)


def test_unused_parameter_keeps_grad_none_and_is_untouched_by_adamw():
    # INVARIANT 9.
    model = nn.Sequential(nn.Linear(5, 8), WithUnused(), nn.Linear(8, 3))
    pipe = Pipeline(model, 2, balance=[1, 2], devices=["cpu", "cpu"])
    acc = GradientAccumulator(
        pipe, torch.optim.AdamW(pipe.parameters(), lr=0.1, weight_decay=0.5), accumulation_steps=2
    )
    for x, y in _batches([4, 4]):
        acc.step(x, y, loss_fn=nn.functional.mse_loss)
    unused = pipe.get_parameter("1.unused")
    assert unused.grad is None
    assert torch.equal(unused, torch.ones(3))
    assert all(p.grad is None for p in pipe.parameters())  # zeroed (to None) after the window


@pytest.mark.parametrize("per_stage", [False, True])
def test_clipping_uses_one_global_norm(per_stage):
    # INVARIANT 10.
    plain, piped = _model(), _model()
    pipe = _pipe(piped)
    optimizers = (
        [torch.optim.SGD(stage.parameters(), lr=0.1) for stage in pipe.stages]
        if per_stage
        else torch.optim.SGD(pipe.parameters(), lr=0.1)
    )
    acc = GradientAccumulator(pipe, optimizers, accumulation_steps=2, max_grad_norm=0.05)
    batches = _batches([6, 5])
    for x, y in batches:
        result = acc.step(x, y, loss_fn=nn.functional.mse_loss)
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    nn.functional.mse_loss(plain(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
    torch.optim.SGD(plain.parameters(), lr=0.1).step()
    assert result.grad_norm == pytest.approx(float(norm), rel=1e-12)
    assert result.grad_norm > 0.05  # the clip did something
    _close(pipe, plain)


class Explode(nn.Module):
    """Turns rows whose first feature is huge into inf."""

    def forward(self, x):
        return torch.where(x[:, :1] > 1e6, torch.full_like(x, float("inf")), x)


@pytest.mark.parametrize("per_stage", [False, True])
def test_an_inf_in_one_micro_batch_of_one_stage_skips_every_stage(per_stage):
    # INVARIANT 11: stage 0 passes inputs through; stage 1 turns one row of the last
    # micro-batch into inf.
    model = nn.Sequential(nn.Linear(5, 5), Explode(), nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(5))
        model[0].bias.zero_()
    pipe = Pipeline(model, 3, balance=[1, 4], devices=["cpu", "cpu"], schedule="zb-h1")
    optimizers = (
        [torch.optim.AdamW(stage.parameters(), lr=0.1) for stage in pipe.stages]
        if per_stage
        else [torch.optim.AdamW(pipe.parameters(), lr=0.1)]
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizers[0], step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    acc = GradientAccumulator(
        pipe, optimizers, accumulation_steps=2, scaler=scaler, lr_scheduler=scheduler
    )
    x, y = _batches([6, 6])[0]
    for _ in range(2):  # one clean window first, so the optimizers have state
        assert not acc.step(x, y, loss_fn=nn.functional.mse_loss).skipped
    params = copy.deepcopy(pipe.state_dict())
    states = [copy.deepcopy(o.state_dict()) for o in optimizers]
    lr, scale = optimizers[0].param_groups[0]["lr"], scaler.get_scale()

    bad = x.clone()
    bad[5, 0] = 1e12  # row 5 is in the last of 3 micro-batches
    acc.step(x, y, loss_fn=nn.functional.mse_loss)
    result = acc.step(bad, y, loss_fn=nn.functional.mse_loss)
    assert result.skipped and not result.stepped
    for key, value in pipe.state_dict().items():
        assert torch.equal(value, params[key]), key
    for optimizer, saved in zip(optimizers, states, strict=True):
        for key, value in optimizer.state_dict()["state"].items():
            for name, tensor in value.items():
                assert torch.equal(tensor, saved["state"][key][name])
    assert scaler.get_scale() == scale / 2
    assert optimizers[0].param_groups[0]["lr"] == lr
    assert all(p.grad is None for p in pipe.parameters())
    # The next clean window steps again, at the halved scale.
    acc.step(x, y, loss_fn=nn.functional.mse_loss)
    assert acc.step(x, y, loss_fn=nn.functional.mse_loss).stepped


def test_nan_loss_skips_the_window_without_a_scaler():
    pipe = _pipe(_model())
    before = copy.deepcopy(pipe.state_dict())
    acc = GradientAccumulator(
        pipe, torch.optim.SGD(pipe.parameters(), lr=0.1), accumulation_steps=1
    )
    x, y = _batches([4])[0]
    # Told, not only in result.skipped: without a scaler it is no overflow to back off from.
    with pytest.warns(PipeschedWarning, match="window 1 was skipped: its loss"):
        result = acc.step(x, y, loss_fn=lambda o, t: nn.functional.mse_loss(o, t) * float("nan"))
    assert result.skipped
    assert all(torch.equal(v, before[k]) for k, v in pipe.state_dict().items())
    assert "skipped" in acc.log_line(result)


def test_zero_items_in_a_window_is_an_error_and_touches_nothing():
    pipe = _pipe(_model())
    before = copy.deepcopy(pipe.state_dict())
    acc = GradientAccumulator(
        pipe, torch.optim.SGD(pipe.parameters(), lr=0.1), accumulation_steps=2
    )
    x, y = _batches([4])[0]

    def loss_sum(o, t):
        return nn.functional.mse_loss(o, t, reduction="sum") * 0

    acc.step(x, y, loss_fn=loss_sum, num_items=0)
    with pytest.raises(ConfigError, match="num_items add up to 0"):
        acc.step(x, y, loss_fn=loss_sum, num_items=0)
    assert all(torch.equal(v, before[k]) for k, v in pipe.state_dict().items())


def test_scaler_for_another_device_is_rejected():
    pipe = _pipe(_model())
    if torch.cuda.is_available():
        scaler = torch.amp.GradScaler("cuda")
    else:  # torch disables a CUDA scaler without CUDA: make a CPU one that claims CUDA
        scaler = torch.amp.GradScaler("cpu")
        scaler._device = "cuda"
    with pytest.raises(ConfigError, match="GradScaler for device 'cuda'.*cpu"):
        GradientAccumulator(
            pipe, torch.optim.SGD(pipe.parameters(), lr=0.1), accumulation_steps=2, scaler=scaler
        )


def test_log_line():
    pipe = _pipe(_model(), chunks=4)
    acc = GradientAccumulator(
        pipe, torch.optim.SGD(pipe.parameters(), lr=1e-3), accumulation_steps=2
    )
    for x, y in _batches([16, 16]):
        result = acc.step(x, y, loss_fn=nn.functional.mse_loss)
    line = acc.log_line(result)
    assert line.startswith("step 2 | loss ")
    assert line.endswith("| lr 0.001 | eff. batch 32 (4 x 4 chunks x 2 steps)")


def test_log_line_tells_a_flushed_window_and_uneven_steps_as_they_were():
    # Issue 25 item 13: 2 leftover steps of 8 rows were shown as "16 (1 x 4 chunks x 4 steps)".
    pipe = _pipe(_model(), chunks=4)
    acc = GradientAccumulator(
        pipe, torch.optim.SGD(pipe.parameters(), lr=1e-3), accumulation_steps=4
    )
    for x, y in _batches([8, 8]):
        acc.step(x, y, loss_fn=nn.functional.mse_loss)
    result = acc.flush()
    assert result.effective_batch == 16 and result.step_rows == (8, 8)
    assert acc.log_line(result).endswith("eff. batch 16 (2 x 4 chunks x 2 steps)")
    for x, y in _batches([7, 2, 9, 4]):
        result = acc.step(x, y, loss_fn=nn.functional.mse_loss)
    assert result.effective_batch == 22
    assert acc.log_line(result).endswith("eff. batch 22 (7 + 2 + 9 + 4 rows in 4 steps)")
    result = acc.step(*_batches([12])[0], loss_fn=nn.functional.mse_loss)  # mid-window
    assert acc.log_line(result).endswith("eff. batch 12 (3 x 4 chunks x 1 step)")


def test_log_line_with_replicas_adds_up_to_the_effective_batch():
    from pipesched.train.result import StepResult, log_line

    def result(total: int, rows: tuple[int, ...], ended: bool = True) -> StepResult:
        return StepResult(1.0, 1.0 if ended else None, ended, False, None, total, 4, 1, 0.1, rows)

    assert log_line(result(64, (8, 8)), 4, 4, None).endswith(
        "eff. batch 64 (2 x 4 chunks x 2 steps x 4 replicas)"
    )  # 2 rows x 4 chunks x 2 steps x 4 replicas = 64
    # Replicas of other sizes: no product that does not add up.
    assert log_line(result(40, (8, 8)), 4, 2, None).endswith(
        "eff. batch 40 (2 x 4 chunks x 2 steps on this replica; 40 rows over 2 replicas)"
    )
    assert log_line(result(16, (8, 8), ended=False), 4, 2, None).endswith(
        "eff. batch 16 (2 x 4 chunks x 2 steps so far on this replica, of 2 replicas)"
    )


@pytest.mark.parametrize("fails", ["loss_fn", "forward"])
def test_a_failed_first_step_of_a_window_leaves_the_callers_gradients_and_scale(fails):
    """Before, the window's start set .grad to None and read the scaler's scale before the
    step ran: a first step that failed lost the caller's own gradients and showed the scale."""
    model = _model()
    pipe = _pipe(model, chunks=2)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    acc = GradientAccumulator(pipe, optimizer, accumulation_steps=2, scaler=scaler)
    ((x, y),) = _batches([8])
    pipe(x).sum().backward()  # the caller's own gradients, for a diagnostic
    before = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    sums = acc.window_sums

    def raising(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("injected")

    bad = x[:, :3] if fails == "forward" else x  # a wrong width: the first layer raises
    with pytest.raises(RuntimeError):
        acc.step(bad, y, loss_fn=raising if fails == "loss_fn" else nn.functional.mse_loss)
    assert acc.window_sums == sums and acc.position == 0
    for name, p in pipe.named_parameters():
        assert torch.equal(p.grad, before[name]), name
    acc.step(x, y, loss_fn=nn.functional.mse_loss)  # the window starts afresh
    assert acc.window_sums.scale == 512.0 and acc.position == 1
