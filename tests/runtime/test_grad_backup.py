"""``grad_backup``: a failed mid-window step changes nothing, holding one gradient buffer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipesched import (
    ConfigError,
    GradientAccumulator,
    GradientBackupError,
    Pipeline,
)
from pipesched.errors import PipeschedWarning
from pipesched.runtime.grad_backup import DiskCopies, HostCopies, read_back
from pipesched.schedule import stages_per_worker
from tests.malloc_peak import AVAILABLE, MallocPeak

# The models hold a BatchNorm on purpose: their micro-batch warning is expected here.
pytestmark = [
    pytest.mark.usefixtures("fp64"),
    pytest.mark.filterwarnings("ignore::pipesched.MicroBatchNormWarning"),
]

SCHEDULES = ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"]


class FailOn(nn.Module):
    """Raises on its ``at``-th call (counting from 0) while armed."""

    def __init__(self, at: int = 2) -> None:
        super().__init__()
        self.at, self.calls, self.armed = at, 0, False

    def forward(self, x):
        self.calls += 1
        if self.armed and self.calls - 1 == self.at:
            raise ValueError("boom")
        return x


def _model(fail: nn.Module, width: int = 8, layers: int = 4, norm=nn.BatchNorm1d) -> nn.Sequential:
    torch.manual_seed(0)
    body = [nn.Linear(width, width) for _ in range(layers)]
    return nn.Sequential(
        nn.Linear(4, width), norm(width), nn.Tanh(), *body[:2], fail, *body[2:],
        nn.Linear(width, 2),
    )  # fmt: skip


def _pipe(model, schedule, backup, **kwargs):
    n = len(model)
    balance = [n // 2, n - n // 2] if stages_per_worker(schedule) == 1 else [2, 2, 2, n - 6]
    return Pipeline(
        model, 4, balance=balance, devices=["cpu"] * 2, schedule=schedule,
        grad_backup=backup, **kwargs,
    )  # fmt: skip


def _data(seed, rows=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4, generator=g), torch.randn(rows, 2, generator=g)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("backup", ["disk", "host"])  # host on CPU workers: set aside
@pytest.mark.filterwarnings("ignore:grad_backup='host':pipesched.errors.PipeschedWarning")
def test_a_failed_mid_window_step_changes_nothing_and_keeps_the_tensors(
    backup, schedule, checkpoint
):
    fail = FailOn()
    pipe = _pipe(_model(fail), schedule, backup, checkpoint=checkpoint)
    pipe.step(*_data(1), loss_fn=F.mse_loss)
    grads = {n: p.grad for n, p in pipe.named_parameters()}
    before = {n: g.clone() for n, g in grads.items()}
    statistics = {n: b.clone() for n, b in pipe.named_buffers()}
    fail.armed, fail.calls = True, 0
    with pytest.raises(ValueError, match="boom"):
        pipe.step(*_data(2), loss_fn=F.mse_loss)
    for name, p in pipe.named_parameters():
        assert p.grad is grads[name], name  # the same tensor: an optimizer's view of it holds
        assert torch.equal(p.grad, before[name]), name
    for name, b in pipe.named_buffers():
        assert torch.equal(b, statistics[name]), name


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_windows_with_a_retried_step_equal_the_plain_model(schedule):
    def train(backup, fail_once):
        fail = FailOn()
        pipe = _pipe(_model(fail, norm=nn.LayerNorm), schedule, backup)
        opt = torch.optim.AdamW(pipe.parameters(), lr=0.05)
        acc = GradientAccumulator(pipe, opt, accumulation_steps=3, max_grad_norm=0.5)
        for window in range(2):
            for k in range(3):
                fail.calls, fail.armed = 0, fail_once and k > 0
                x, y = _data(10 * window + k)
                try:
                    acc.step(x, y, loss_fn=F.mse_loss)
                except ValueError:
                    fail.armed = False
                    acc.step(x, y, loss_fn=F.mse_loss)
        return {n: p.detach().clone() for n, p in pipe.named_parameters()}

    disk, device = train("disk", True), train("device", False)
    plain = _model(FailOn(), norm=nn.LayerNorm)  # per sample: the batch's split cannot matter
    opt = torch.optim.AdamW(plain.parameters(), lr=0.05)
    for window in range(2):
        xs, ys = zip(*(_data(10 * window + k) for k in range(3)), strict=True)
        opt.zero_grad()
        F.mse_loss(plain(torch.cat(xs)), torch.cat(ys)).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        opt.step()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(disk[name], p.detach(), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(disk[name], device[name], rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(not AVAILABLE, reason="measures memory with glibc's mallinfo2")
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("backup", ["device", "disk"])
def test_a_mid_window_steps_peak_gradient_memory(backup, schedule):
    # Wide layers and a small batch: the step's other allocations are a few percent.
    pipe = _pipe(_model(FailOn(), width=256, layers=40), schedule, backup)
    x, y = _data(1, rows=8)
    pipe.step(x, y, loss_fn=F.mse_loss)  # the window's first step: its gradients
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in pipe.parameters())
    pipe.step(x, y, loss_fn=F.mse_loss)  # warm: the allocator's caches, the schedules
    extras = []
    for _ in range(3):
        with MallocPeak() as peak:
            pipe.step(x, y, loss_fn=F.mse_loss)
        extras.append(peak.extra)
    ratio = (grad_bytes + min(extras)) / grad_bytes
    if backup == "disk":
        assert ratio <= 1.1, (ratio, extras, grad_bytes)
    else:  # set aside on the device: the step's new gradients are a second buffer
        assert ratio >= 1.8, (ratio, extras, grad_bytes)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 5, dtype=torch.float64),
        torch.randn(7).to(torch.bfloat16),
        torch.randn(4, 6, dtype=torch.float32).t(),
        torch.zeros(0),
        torch.arange(12, dtype=torch.int64).view(3, 4)[:, ::2],
    ],
    ids=["fp64", "bf16", "transposed", "empty", "strided"],
)
def test_disk_copies_put_back_every_bit(tensor):
    grads = [tensor, torch.randn(2, 2, dtype=torch.float64)]
    before = [g.clone() for g in grads]
    copies = DiskCopies(grads)
    for g in grads:
        g.zero_() if g.dtype == torch.int64 else g.add_(1.0)
    copies.put_back(grads)
    copies.close()
    for got, want in zip(grads, before, strict=True):
        assert torch.equal(got, want)


def test_a_truncated_disk_copy_is_an_error():
    grads = [torch.randn(64, dtype=torch.float64)]
    copies = DiskCopies(grads)
    copies.file.truncate(100)
    with pytest.raises(RuntimeError, match="cut short"):
        copies.put_back(grads)
    copies.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_copies_of_cuda_gradients_hold_one_device_buffer():
    grads = [torch.randn(1 << 20, device="cuda"), torch.randn(64, 3, device="cuda").t()]
    before = [g.clone() for g in grads]
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    copies = HostCopies(grads)
    assert torch.cuda.memory_allocated() == allocated  # nothing more on the device
    for g in grads:
        g.mul_(3.0)
    copies.put_back(grads)
    copies.close()
    for got, want in zip(grads, before, strict=True):
        assert torch.equal(got, want)


def test_host_on_cpu_workers_warns_that_it_saves_nothing():
    with pytest.warns(PipeschedWarning, match="every worker of this Pipeline is a CPU.*'disk'"):
        Pipeline(nn.Sequential(nn.Linear(2, 2)), 1, devices=["cpu"], grad_backup="host")


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [(3, TypeError, "must be a string"), ("gpu", ConfigError, "'device'.*'host'.*'disk'")],
)
def test_grad_backup_is_checked(value, error, match):
    with pytest.raises(error, match=match):
        Pipeline(nn.Sequential(nn.Linear(2, 2)), 1, grad_backup=value)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backup", ["device", "host"])
def test_a_mid_window_step_on_cuda_under_host_holds_one_gradient_buffer(backup):
    fail = FailOn()
    model = _model(fail, width=256, layers=40, norm=nn.LayerNorm)
    pipe = Pipeline(
        model, 4, balance=[22, 23], devices=["cuda:0", "cuda:0"], schedule="1f1b",
        grad_backup=backup,
    )  # fmt: skip
    x, y = (t.cuda() for t in _data(1))
    pipe.step(x, y, loss_fn=F.mse_loss)
    grads = {n: p.grad for n, p in pipe.named_parameters()}
    grad_bytes = sum(g.numel() * g.element_size() for g in grads.values())
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    pipe.step(x, y, loss_fn=F.mse_loss)
    ratio = (grad_bytes + torch.cuda.max_memory_allocated() - allocated) / grad_bytes
    assert ratio <= 1.1 if backup == "host" else ratio >= 1.8, ratio
    before = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    fail.armed, fail.calls = True, 0
    with pytest.raises(ValueError, match="boom"):
        pipe.step(x, y, loss_fn=F.mse_loss)
    for name, p in pipe.named_parameters():
        assert torch.equal(p.grad, before[name]), name


def test_a_copy_that_cannot_be_made_stops_the_step_before_it_changes_anything(monkeypatch):
    fail = FailOn()
    pipe = _pipe(_model(fail), "1f1b", "disk")
    pipe.step(*_data(1), loss_fn=F.mse_loss)
    grads = {n: (p.grad, p.grad.clone()) for n, p in pipe.named_parameters()}

    def full(self, grads):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(DiskCopies, "__init__", full)
    calls = fail.calls
    with pytest.raises(GradientBackupError, match="free space in TMPDIR") as caught:
        pipe.step(*_data(2), loss_fn=F.mse_loss)
    assert isinstance(caught.value, RuntimeError)
    assert isinstance(caught.value.__cause__, OSError)
    for name, p in pipe.named_parameters():
        assert p.grad is grads[name][0] and torch.equal(p.grad, grads[name][1]), name
    assert fail.calls == calls  # the failed step ran no forward


def test_a_copy_that_cannot_be_read_back_says_the_window_is_lost(monkeypatch):
    fail = FailOn()
    pipe = _pipe(_model(fail), "1f1b", "disk")
    pipe.step(*_data(1), loss_fn=F.mse_loss)
    statistics = {n: b.clone() for n, b in pipe.named_buffers()}

    def unreadable(self, grads):
        raise RuntimeError("the gradient backup was cut short")

    monkeypatch.setattr(DiskCopies, "put_back", unreadable)
    fail.armed, fail.calls = True, 0
    with pytest.raises(GradientBackupError, match="lost; zero them") as caught:
        pipe.step(*_data(2), loss_fn=F.mse_loss)
    assert isinstance(caught.value.__context__, RuntimeError)  # the copy's own error
    for name, b in pipe.named_buffers():  # all else is back
        assert torch.equal(b, statistics[name]), name


def test_a_closed_disk_backup_cannot_be_read_back_and_says_so():
    grads = [torch.ones(3)]
    copies = DiskCopies(grads)
    copies.close()
    with pytest.raises(GradientBackupError, match="put back after it was closed"):
        read_back(copies, grads, "the window's gradients are lost")
