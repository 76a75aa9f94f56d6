"""The window end as a transaction (INVARIANT 33): any failure in it is put back, bit for bit.

The reference is a clean run of the same training. A run whose window end
fails once (the optimizer before or after touching anything, or after
updating some parameters only; the scheduler; Ctrl-C inside
``optimizer.step``) is, right after the failure, as before the window end,
and once retried with ``flush()`` ends bitwise equal to the clean run (fp64):
parameters, optimizer state, scheduler, GradScaler, counters and generators.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from torch import nn

from pipesched import CheckpointError, ConfigError, GradientAccumulator, Pipeline
from tests import malloc_peak

pytestmark = pytest.mark.usefixtures("fp64")

STEPS = 2  # per window
TOTAL = 8  # four windows; the second window's end fails
FAIL_AT = 4  # the step (1-based) whose window end fails


class Fault:
    """What fails next, once."""

    def __init__(self) -> None:
        self.kind: str | None = None

    def take(self, kind: str) -> bool:
        if self.kind == kind:
            self.kind = None
            return True
        return False


class FaultyAdam(torch.optim.Adam):
    """Adam that fails, when told, before touching anything, after, or half-way."""

    def __init__(self, params, fault: Fault, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.fault = fault

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        if self.fault.take("before"):
            raise RuntimeError("optimizer failed before touching anything")
        if self.fault.take("partial"):  # the first half of the parameters stepped, then a failure
            params = self.param_groups[0]["params"]
            self.param_groups[0]["params"] = params[: len(params) // 2]
            try:
                super().step()
            finally:
                self.param_groups[0]["params"] = params
            raise RuntimeError("optimizer failed after updating some parameters")
        result = super().step(closure)
        torch.rand(1)  # an optimizer that draws: the generators are put back too
        if self.fault.take("after"):
            raise RuntimeError("optimizer failed after updating every parameter")
        if self.fault.take("interrupt"):
            raise KeyboardInterrupt
        if self.fault.take("sigint"):
            signal.raise_signal(signal.SIGINT)  # a real Ctrl-C, as from the terminal
        return result


class FaultyStepLR(torch.optim.lr_scheduler.StepLR):
    def __init__(self, optimizer, fault: Fault) -> None:
        self.fault = fault
        super().__init__(optimizer, step_size=1, gamma=0.5)

    def step(self, epoch=None):  # type: ignore[override]
        super().step()
        if self.fault.take("scheduler"):  # after changing the learning rates
            raise RuntimeError("scheduler failed")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)
    )


def _acc(fault: Fault, backup: str = "device") -> GradientAccumulator:
    pipe = Pipeline(_model(), 2, balance=[3, 3], devices=["cpu", "cpu"], grad_backup=backup)
    params = list(pipe.parameters())
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 0.02}]
    optimizer = FaultyAdam(groups, fault, lr=0.01, weight_decay=0.1)
    return GradientAccumulator(
        pipe,
        optimizer,
        accumulation_steps=STEPS,
        max_grad_norm=0.5,
        scaler=torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=1),
        lr_scheduler=FaultyStepLR(optimizer, fault),
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4 + step % 3, 5, generator=g), torch.randn(4 + step % 3, 3, generator=g)


def _step(acc: GradientAccumulator, step: int):
    return acc.step(*_batch(step), loss_fn=nn.functional.mse_loss)


def _everything(acc: GradientAccumulator) -> dict:
    """Every bit of state, as plain values and clones."""
    opt = acc.optimizers[0]
    return {
        "params": [p.detach().clone() for p in acc.pipe.parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in acc.pipe.parameters()],
        "state": [
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
            for g in opt.param_groups
            for p in g["params"]
            if p in opt.state
        ],
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "scheduler": {k: v for k, v in acc.schedulers[0].state_dict().items() if k != "fault"},
        "scaler": acc.loss_scale.state_dict(),
        "counters": (acc.steps, acc.windows, acc.position, acc.window_sums),
        "rng": torch.get_rng_state(),
    }


def _assert_bitwise(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_bitwise(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _clean(backup: str = "device") -> dict:
    torch.manual_seed(7)
    acc = _acc(Fault(), backup)
    for step in range(TOTAL):
        _step(acc, step)
    return _everything(acc)


@pytest.mark.parametrize("kind", ["before", "after", "partial", "scheduler", "interrupt"])
@pytest.mark.parametrize("backup", ["device", "disk"])  # disk: written back from its copies
def test_a_failed_window_end_is_put_back_and_its_retry_equals_a_clean_run(backup, kind):
    fault = Fault()
    torch.manual_seed(7)
    acc = _acc(fault, backup)
    for step in range(FAIL_AT - 1):
        _step(acc, step)
    fault.kind = kind
    x, y = _batch(FAIL_AT - 1)
    params = [p.detach().clone() for p in acc.pipe.parameters()]
    before = _everything(acc)
    with pytest.raises(KeyboardInterrupt if kind == "interrupt" else RuntimeError) as caught:
        acc.step(x, y, loss_fn=nn.functional.mse_loss)
    assert fault.kind is None  # the fault did fire
    after = _everything(acc)
    # As just before the window end: nothing stepped, the step's gradients in.
    _assert_bitwise(params, after["params"], "params")
    for key in ("state", "groups", "scheduler", "scaler"):
        _assert_bitwise(before[key], after[key], key)
    assert acc.window_end_pending and acc.windows == before["counters"][1]
    assert acc.position == STEPS and acc.steps == FAIL_AT
    assert "acc.flush()" in "".join(getattr(caught.value, "__notes__", []))
    result = acc.flush()  # the retry
    assert result is not None and result.stepped and result.window == 2
    assert not acc.window_end_pending
    for step in range(FAIL_AT, TOTAL):
        _step(acc, step)
    _assert_bitwise(_clean(backup), _everything(acc))


def test_steps_after_an_interrupted_window_end_are_refused_until_it_is_retried_then_train(
    tmp_path,
):
    # The issue: after one Ctrl-C inside the window end's optimizer.step, every later step
    # trained nothing, silently, and a save replaced the good checkpoint with one load refuses.
    fault = Fault()
    acc = _acc(fault)
    _step(acc, 0)
    path = str(tmp_path / "ckpt.pt")
    acc.save(path)
    good = Path(path).read_bytes()
    fault.kind = "interrupt"
    with pytest.raises(KeyboardInterrupt):
        _step(acc, 1)
    with pytest.raises(ConfigError, match=r"acc\.flush\(\)"):
        _step(acc, 2)
    with pytest.raises(CheckpointError, match=r"acc\.flush\(\)"):
        acc.save(path)
    with pytest.raises(CheckpointError, match=r"state_dict\(\).*acc\.flush\(\)"):
        acc.state_dict()  # (before, it returned a state load_state_dict refuses)
    assert Path(path).read_bytes() == good and os.listdir(tmp_path) == ["ckpt.pt"]
    acc.flush()
    frozen = [p.detach().clone() for p in acc.pipe.parameters()]
    for step in range(2, 2 + 2 * STEPS):
        result = _step(acc, step)
    assert result.stepped and acc.windows == 3
    assert all(not torch.equal(a, b) for a, b in zip(frozen, acc.pipe.parameters(), strict=True))
    acc.save(path)
    _acc(Fault()).load(path)  # what is saved after the retry loads


def test_a_real_ctrl_c_inside_optimizer_step_is_put_back(ctrl_c):
    fault = Fault()
    torch.manual_seed(7)
    acc = _acc(fault)
    for step in range(FAIL_AT - 1):
        _step(acc, step)
    fault.kind = "sigint"
    with pytest.raises(KeyboardInterrupt):
        _step(acc, FAIL_AT - 1)
    assert acc.window_end_pending
    acc.flush()
    for step in range(FAIL_AT, TOTAL):
        _step(acc, step)
    _assert_bitwise(_clean(), _everything(acc))


def test_a_failed_flush_of_a_partial_window_is_as_before_it():
    fault = Fault()
    torch.manual_seed(7)
    acc = _acc(fault)
    _step(acc, 0)
    before = _everything(acc)
    fault.kind = "after"
    with pytest.raises(RuntimeError):
        acc.flush()
    assert not acc.window_end_pending  # a window not yet full: it goes on as before
    _assert_bitwise(before, _everything(acc))
    assert acc.flush().stepped


@pytest.mark.skipif(not malloc_peak.AVAILABLE, reason="measures memory with glibc's mallinfo2")
@pytest.mark.parametrize("backup", ["device", "disk"])
def test_the_window_ends_copies_go_where_grad_backup_says(backup):
    # Wide layers, a small batch, a per-parameter AdamW (foreach's temporaries are torch's):
    # what the window end adds is its copies of the gradients, parameters and optimizer state.
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(40)])
    pipe = Pipeline(model, 2, balance=[20, 20], devices=["cpu", "cpu"], grad_backup=backup)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3, foreach=False)
    acc = GradientAccumulator(pipe, optimizer, accumulation_steps=2, max_grad_norm=1.0)
    x, y = torch.randn(4, 256), torch.randn(4, 256)
    for _ in range(5):  # two windows (the optimizer's state exists), and a window's first step
        acc.step(x, y, loss_fn=nn.functional.mse_loss)
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in pipe.parameters())
    with malloc_peak.MallocPeak() as peak:
        result = acc.step(x, y, loss_fn=nn.functional.mse_loss)
    assert result.stepped
    ratio = (grad_bytes + peak.extra) / grad_bytes
    if backup == "disk":
        assert ratio <= 1.1, ratio
    else:  # the gradients scaled out of place, a copy of the parameters and of Adam's two
        assert ratio >= 4.5, ratio


class _RebindingSGD(torch.optim.Optimizer):
    """An old-style optimizer: it rebinds ``p.data`` instead of writing into it, then fails."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.1})
        self.fail = False

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = p.data - group["lr"] * p.grad
        if self.fail:
            raise RuntimeError("optimizer failed after stepping")


@pytest.mark.parametrize("backup", ["device", "disk"])
def test_a_window_end_failing_after_rebinding_parameters_puts_them_back(backup):
    pipe = Pipeline(_model(), 2, balance=[3, 3], devices=["cpu", "cpu"], grad_backup=backup)
    optimizer = _RebindingSGD(pipe.parameters())
    acc = GradientAccumulator(pipe, optimizer, accumulation_steps=2)
    _step(acc, 0)
    before = [p.detach().clone() for p in pipe.parameters()]
    optimizer.fail = True
    with pytest.raises(RuntimeError, match="after stepping"):
        _step(acc, 1)
    for got, want in zip(pipe.parameters(), before, strict=True):
        assert torch.equal(got, want)
