"""How a step runs: its transaction covers what the model holds now, and Ctrl-C cuts nothing.

Complements tests/runtime/test_transaction.py (what a failed step leaves) with the
edges: parameters replaced after the pipeline was built, a stage's early
commit (a replica's all-reduce) undone by a later failure, an interrupt
while gradients are set aside or put back, an interrupt while a worker is
deep in a backward, and a window finished from inside its own step.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipesched import ConfigError, GradientAccumulator, Pipeline
from pipesched.runtime.transaction import StepSnapshot, deferred_interrupts

pytestmark = pytest.mark.usefixtures("fp64")


def _pipe(model, **kwargs):
    return Pipeline(model, 2, balance=[1, 1], devices=["cpu", "cpu"], **kwargs)


def test_parameters_replaced_after_construction_are_put_back_too():
    # load_state_dict(assign=True) (after a meta-device init) gives new Parameters.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    pipe = _pipe(model, schedule="1f1b")
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    calls = []

    def fails_on_the_second_micro_batch(out, target):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("bad micro-batch")
        return F.mse_loss(out, target)

    with pytest.raises(RuntimeError, match="bad micro-batch"):
        pipe.step(torch.randn(4, 4), torch.randn(4, 4), loss_fn=fails_on_the_second_micro_batch)
    assert all(p.grad is None for p in model.parameters())


def test_an_early_commit_is_undone_when_the_step_fails_later():
    # On a mesh a stage commits its gradients when its last backward is done, for its
    # replicas' all-reduce; a failure after that must still give back the old ones.
    p = nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    snapshot = StepSnapshot.take([p], [])
    p.grad = torch.full((3,), 2.0)  # this step's gradient
    snapshot.commit_early([p])
    assert torch.equal(p.grad, torch.full((3,), 3.0))
    p.grad.mul_(10)  # the all-reduce writes in place
    snapshot.restore()
    assert torch.equal(p.grad, torch.ones(3))
    snapshot = StepSnapshot.take([p], [])
    p.grad = torch.full((3,), 2.0)
    snapshot.commit_early([p])
    snapshot.commit()  # the step succeeds: committed once, not twice
    assert torch.equal(p.grad, torch.full((3,), 3.0))


def test_ctrl_c_is_held_back_until_the_gradients_are_whole(ctrl_c):
    done = []
    with pytest.raises(KeyboardInterrupt), deferred_interrupts():
        signal.raise_signal(signal.SIGINT)
        done.append("the block ran to its end")
    assert done


class SlowBackward(torch.autograd.Function):
    finished = threading.Event()

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while this worker is deep in its backward
        time.sleep(1.0)
        SlowBackward.finished.set()
        return grad


class Slow(nn.Module):
    def forward(self, x):
        return SlowBackward.apply(x)


def test_ctrl_c_during_a_long_backward_returns_only_after_the_workers_stop(ctrl_c):
    # On Python 3.11 a Thread.join cut by Ctrl-C marks the thread stopped while it
    # runs: the caller got the KeyboardInterrupt while a worker still wrote .grad.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Slow(), nn.Linear(4, 4))
    pipe = Pipeline(model, 1, balance=[2, 1], devices=["cpu", "cpu"])
    SlowBackward.finished.clear()
    with pytest.raises(KeyboardInterrupt):
        pipe.step(torch.randn(4, 4), torch.randn(4, 4), loss_fn=F.mse_loss)
    assert SlowBackward.finished.is_set()  # the worker had stopped before we got here
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("call", ["flush", "step"])
def test_a_window_finished_from_inside_its_own_step_is_refused(call):
    torch.manual_seed(0)
    pipe = _pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    acc = GradientAccumulator(
        pipe, torch.optim.SGD(pipe.parameters(), lr=0.1), accumulation_steps=2
    )
    x, y = torch.randn(4, 4), torch.randn(4, 4)

    def nested(out, target):
        if call == "flush":
            acc.flush()
        else:
            acc.step(x, y, loss_fn=F.mse_loss)
        return F.mse_loss(out, target)

    result: list[BaseException] = []

    def run():
        try:
            acc.step(x, y, loss_fn=nested)
        except BaseException as error:
            result.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "deadlocked"
    assert isinstance(result[0], ConfigError) and "inside one of the pipeline" in str(result[0])
