"""Every error message that suggests a fix: the call fails, says the fix, and the fix works."""

from __future__ import annotations

import importlib.util
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipesched import ConfigError, Costs, GradientAccumulator, Pipeline, get_schedule
from pipesched.runtime.backward import backward_full
from pipesched.runtime.stage.microbatch import batch_size
from pipesched.runtime.stage.recompute import checkpoint, checkpoint_stop
from pipesched.viz.chrome import trace_events
from pipesched.viz.gantt import gantt
from tests.test_errors import _batch, _model, _pipe

mse = nn.functional.mse_loss


class _Add(nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return pair[0] + pair[1]


class _Net(nn.Module):
    """A model that is not an nn.Sequential."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _trains(pipe: Pipeline) -> None:
    loss = pipe.step(*_batch(), loss_fn=mse)
    assert torch.isfinite(loss)


def _moved_then_wrapped() -> None:
    model = _model().to("cpu")  # move the model before wrapping it
    _trains(Pipeline(model, 2, balance=[2, 1], devices=["cpu", "cpu"]))


def _backward_of(x: torch.Tensor) -> None:
    layer = nn.Linear(4, 2)
    backward_full([layer(x).sum()], None, [x])


@dataclass(frozen=True)
class Fix:
    """A failing call, the fix its error message suggests (verbatim), and that fix applied."""

    fails: Callable[[], Any]
    suggests: str
    fixed: Callable[[], Any]
    error: type[Exception] = ConfigError


_x_grad = torch.randn(6, 4, requires_grad=True)
_x_nonleaf = torch.randn(6, 4, requires_grad=True) * 2
_t_teacher = torch.randn(6, 2, requires_grad=True) * 2  # a target with autograd history
_opt = torch.optim.SGD
FIXES: dict[str, Fix] = {
    "pipe(x, x)": Fix(
        lambda: Pipeline(nn.Sequential(_Add()), balance=[1], devices=["cpu"])(
            torch.ones(2), torch.ones(2)
        ),
        "pass a tuple or dict as one argument",
        lambda: Pipeline(nn.Sequential(_Add()), balance=[1], devices=["cpu"])(
            (torch.ones(2), torch.ones(2))
        ),
        TypeError,
    ),
    "chunks='4'": Fix(
        lambda: Pipeline(_model(), "4", balance=[2, 1], devices=["cpu", "cpu"]),
        "pass chunks=4",
        lambda: _trains(Pipeline(_model(), 4, balance=[2, 1], devices=["cpu", "cpu"])),
        TypeError,
    ),
    "non-Sequential cut before its first call": Fix(
        lambda: Pipeline(_Net(), 2, devices=["cpu", "cpu"]).partition,
        "or pass example_inputs= (one micro-batch) to cut it at construction",
        lambda: _trains(
            Pipeline(
                _Net(), 2, devices=["cpu", "cpu"], example_inputs=(torch.randn(3, 4),), num_stages=2
            )
        ),
    ),
    "pipe.to(device)": Fix(
        lambda: _pipe().to("cpu"), "Move the model before wrapping it", _moved_then_wrapped
    ),
    "stages != devices": Fix(
        lambda: _pipe(balance=[1, 1, 1]),
        "give a balance of 2 stages",
        lambda: _trains(_pipe(balance=[2, 1])),
    ),
    "devices=[]": Fix(
        lambda: _pipe(balance=[3], devices=[]),
        "e.g. ['cpu']",
        lambda: _trains(_pipe(balance=[3], devices=["cpu"])),
    ),
    "checkpoint mode": Fix(
        lambda: _pipe(checkpoint="sometimes"),
        "use one of 'always'",
        lambda: _trains(_pipe(checkpoint="always")),
    ),
    "schedule name": Fix(
        lambda: _pipe(schedule="1f2b"), "'1f1b'", lambda: _trains(_pipe(schedule="1f1b"))
    ),
    "balance mode": Fix(
        lambda: _pipe(balance="fast"),
        "use one of 'params'",
        lambda: _trains(_pipe(balance="params")),
    ),
    "balance='time' without example": Fix(
        lambda: _pipe(balance="time"),
        "pass example_inputs=(x,)",
        lambda: _trains(_pipe(balance="time", example_inputs=(torch.randn(3, 4),))),
    ),
    "balance and split_points": Fix(
        lambda: _pipe(split_points=["2"]),
        "give balance or split_points, not both",
        lambda: _trains(Pipeline(_model(), 2, split_points=["2"], devices=["cpu", "cpu"])),
    ),
    "split_points a string": Fix(
        lambda: Pipeline(_model(), 2, split_points="2", devices=["cpu", "cpu"]),
        "e.g. split_points=['transformer.h.2']",
        lambda: _trains(Pipeline(_model(), 2, split_points=["2"], devices=["cpu", "cpu"])),
        TypeError,
    ),
    "loss_fn=None": Fix(
        lambda: _pipe().step(*_batch(), loss_fn=None),
        "e.g. loss_fn=torch.nn.functional.mse_loss",
        lambda: _pipe().step(*_batch(), loss_fn=torch.nn.functional.mse_loss),
        TypeError,
    ),
    "loss not a scalar": Fix(
        lambda: _pipe().step(*_batch(), loss_fn=lambda o, t: mse(o, t, reduction="none")),
        "reduce it with .mean() or .sum()",
        lambda: _pipe().step(*_batch(), loss_fn=lambda o, t: mse(o, t, reduction="none").mean()),
    ),
    "input requires grad": Fix(
        lambda: _pipe().step(_x_grad, torch.randn(6, 2), loss_fn=mse),
        "pass x.detach() instead",
        lambda: _pipe().step(_x_grad.detach(), torch.randn(6, 2), loss_fn=mse),
    ),
    "input requires grad, not a leaf": Fix(
        lambda: _pipe().step(_x_nonleaf, torch.randn(6, 2), loss_fn=mse),
        "pass x.detach() instead",
        lambda: _pipe().step(_x_nonleaf.detach(), torch.randn(6, 2), loss_fn=mse),
    ),
    "target requires grad": Fix(
        lambda: _pipe().step(torch.randn(6, 4), _t_teacher, loss_fn=mse),
        "pass its .detach()",
        lambda: _pipe().step(torch.randn(6, 4), _t_teacher.detach(), loss_fn=mse),
    ),
    "targets[1] requires grad": Fix(
        lambda: _pipe().step(
            microbatches=[torch.randn(3, 4)] * 2,
            targets=[torch.randn(3, 2), _t_teacher[:3]],
            loss_fn=mse,
        ),
        "pass its .detach()",
        lambda: _pipe().step(
            microbatches=[torch.randn(3, 4)] * 2,
            targets=[torch.randn(3, 2), _t_teacher[:3].detach()],
            loss_fn=mse,
        ),
    ),
    "input on the meta device": Fix(
        lambda: _pipe().step(torch.randn(6, 4, device="meta"), torch.randn(6, 2), loss_fn=mse),
        "pass the batch itself",
        lambda: _pipe().step(torch.randn(6, 4), torch.randn(6, 2), loss_fn=mse),
    ),
    "complex loss": Fix(
        lambda: _pipe().step(*_batch(), loss_fn=lambda o, t: mse(o, t) * (1 + 2j)),
        "return its .real",
        lambda: _pipe().step(*_batch(), loss_fn=lambda o, t: (mse(o, t) * (1 + 2j)).real),
    ),
    "optimizer over a copy of the model": Fix(
        lambda: GradientAccumulator(
            _pipe(), _opt(_model().parameters(), lr=0.1), accumulation_steps=2
        ),
        "Build it over pipe.parameters()",
        lambda: GradientAccumulator(
            (p := _pipe()), _opt(p.parameters(), lr=0.1), accumulation_steps=2
        ),
    ),
    "max_grad_norm=0": Fix(
        lambda: GradientAccumulator(
            (p := _pipe()), _opt(p.parameters(), lr=0.1), accumulation_steps=2, max_grad_norm=0
        ),
        "use None to not clip",
        lambda: GradientAccumulator(
            (p := _pipe()), _opt(p.parameters(), lr=0.1), accumulation_steps=2, max_grad_norm=None
        ),
    ),
    "optimizer=[]": Fix(
        lambda: GradientAccumulator(_pipe(), [], accumulation_steps=2),
        "give one optimizer or one per stage",
        lambda: GradientAccumulator(
            (p := _pipe()), [_opt(p.parameters(), lr=0.1)], accumulation_steps=2
        ),
    ),
    "get_schedule options": Fix(
        lambda: get_schedule("interleaved-1f1b", 4, 4, stages_per_worker=2),
        "the only option is virtual_stages",
        lambda: get_schedule("interleaved-1f1b", 4, 4, virtual_stages=2).validate(),
        TypeError,
    ),
    "checkpoint(function)": Fix(
        lambda: checkpoint(torch.relu, torch.ones(2, requires_grad=True)),
        "wrap a plain function in an nn.Module",
        lambda: checkpoint(nn.ReLU(), torch.ones(2, requires_grad=True)).sum().backward(),
        TypeError,
    ),
    "backward_full non-leaf input": Fix(
        lambda: _backward_of(torch.randn(3, 4, requires_grad=True) * 2),
        "pass x.detach().requires_grad_() to the forward",
        lambda: _backward_of((torch.randn(3, 4, requires_grad=True) * 2).detach().requires_grad_()),
    ),
    "backward_full, no grad_outputs": Fix(
        lambda: backward_full([nn.Linear(4, 2)(torch.randn(3, 4))], None, []),
        "pass grad_outputs",
        lambda: backward_full(
            [(y := nn.Linear(4, 2)(torch.randn(3, 4)))], [torch.ones_like(y)], []
        ),
    ),
    "zb-v with odd stages": Fix(
        lambda: get_schedule("zb-v", 3, 4),
        "use num_stages=2 or 4",
        lambda: get_schedule("zb-v", 4, 4).validate(),
    ),
    "virtual_stages not dividing": Fix(
        lambda: get_schedule("interleaved-1f1b", 3, 4, virtual_stages=2),
        "use num_stages=2 or 4",
        lambda: get_schedule("interleaved-1f1b", 4, 4, virtual_stages=2).validate(),
    ),
    "fixed virtual_stages": Fix(
        lambda: get_schedule("1f1b", 4, 4, virtual_stages=2),
        "leave virtual_stages out",
        lambda: get_schedule("1f1b", 4, 4).validate(),
    ),
    "Costs per stage": Fix(
        lambda: get_schedule("1f1b", 2, 2).simulate(Costs(forward=[1, 1, 1])),
        "give one value per stage or a single number",
        lambda: get_schedule("1f1b", 2, 2).simulate(Costs(forward=1)),
    ),
    "batch sizes differ": Fix(
        lambda: batch_size((torch.ones(6, 4), torch.ones(3))),
        "pass a value meant for every micro-batch as a 0-dim tensor",
        lambda: batch_size((torch.ones(6, 4), torch.tensor(3.0))),
    ),
    "no batch dimension": Fix(
        lambda: _pipe().step("tokens", torch.randn(6, 2), loss_fn=mse),
        "pass at least one tensor with ndim >= 1",
        lambda: _pipe().step(torch.randn(6, 4), torch.randn(6, 2), loss_fn=mse),
    ),
    "checkpoint_stop count": Fix(
        lambda: checkpoint_stop("always", 2.0),
        "pass the number of micro-batches",
        lambda: checkpoint_stop("always", 2),
        TypeError,
    ),
    "memory_budget with a list": Fix(
        lambda: _pipe(memory_budget=1e9),
        "balance='time' or 'schedule' (which measure the layers on example_inputs=(x,))",
        lambda: _trains(
            _pipe(balance="time", example_inputs=(torch.randn(3, 4),), memory_budget=1e9)
        ),
    ),
    "trace_events of a Schedule": Fix(
        lambda: trace_events(get_schedule("1f1b", 2, 2)),
        "simulate a Schedule first (schedule.simulate(costs))",
        lambda: trace_events(get_schedule("1f1b", 2, 2).simulate(Costs(1, 1, 0))),
        TypeError,
    ),
}
if importlib.util.find_spec("matplotlib") is not None:
    _png = Path(tempfile.mkdtemp()) / "gantt.png"
    FIXES["gantt of a Timeline with costs"] = Fix(
        lambda: gantt(get_schedule("1f1b", 2, 2).simulate(), _png, costs=Costs(1, 2, 0)),
        "Pass the schedule instead, or leave costs out",
        lambda: gantt(get_schedule("1f1b", 2, 2), _png, costs=Costs(1, 2, 0)),
    )
if not torch.cuda.is_available():
    FIXES["stages not a multiple of v"] = Fix(
        lambda: Pipeline(
            nn.Sequential(*(nn.Linear(4, 4) for _ in range(4))),
            2,
            num_stages=3,
            schedule="interleaved-1f1b",
        ),
        "use a multiple of 2",
        lambda: Pipeline(
            nn.Sequential(*(nn.Linear(4, 4) for _ in range(4))),
            2,
            num_stages=4,
            schedule="interleaved-1f1b",
        ),
    )
    FIXES["cuda on a CPU build"] = Fix(
        lambda: _pipe(devices=["cuda:0", "cuda:0"]),
        "devices=['cpu', 'cpu']",
        lambda: _trains(_pipe(devices=["cpu", "cpu"])),
    )


def test_every_suggested_fix_works_when_applied():
    """For each message that suggests a fix: the call fails, says the fix, and the fix works.

    One test over the whole table, so that a report lists every broken suggestion at once.
    """
    broken: list[str] = []
    for name, fix in FIXES.items():
        try:
            fix.fails()
        except fix.error as error:
            if fix.suggests not in str(error):
                broken.append(f"{name}: the message does not say {fix.suggests!r}: {error}")
                continue
        except Exception as error:  # the wrong kind of error
            broken.append(
                f"{name}: {type(error).__name__} instead of {fix.error.__name__}: {error}"
            )
            continue
        else:
            broken.append(f"{name}: did not fail")
            continue
        try:
            fix.fixed()
        except Exception as error:
            broken.append(f"{name}: the suggested fix fails: {type(error).__name__}: {error}")
    assert not broken, "\n".join(broken)


def test_step_input_that_requires_grad_fails_before_running_and_the_fix_trains_alike():
    pipe, x, y = _pipe(), *_batch()
    x.requires_grad_()
    with pytest.raises(ConfigError, match="inputs requires grad") as caught:
        pipe.step(x, y, loss_fn=mse)
    assert "pipe(x)" in str(caught.value)  # names the way to get x's gradient
    assert all(p.grad is None for p in pipe.parameters())  # nothing ran
    loss = pipe.step(x.detach(), y, loss_fn=mse)
    plain = _model()
    expected = mse(plain(x.detach()), y)
    expected.backward()
    assert torch.allclose(loss, expected.detach())
    for got, want in zip(pipe.parameters(), plain.parameters(), strict=True):
        assert got.grad is not None and torch.allclose(got.grad, want.grad)
