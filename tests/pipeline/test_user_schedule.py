"""`Pipeline(schedule=Schedule)`: a user's schedule (from CSV, or built action by action) runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipesched import ConfigError, Pipeline, Schedule, ScheduleError, get_schedule
from pipesched.schedule import SCHEDULES, stages_per_worker

pytestmark = pytest.mark.usefixtures("fp64")

CHUNKS, BATCH = 4, 8


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(8)))


def _run(schedule: str | Schedule, num_stages: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = _model()
    pipe = Pipeline(
        model, CHUNKS, balance=[8 // num_stages] * num_stages, devices=["cpu", "cpu"],
        schedule=schedule,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 6, generator=g)
    loss = pipe.step(x, y, loss_fn=nn.functional.mse_loss)
    return loss, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_a_schedule_read_from_csv_runs_bitwise_as_the_named_one(name):
    num_stages = 2 * stages_per_worker(name)
    text = get_schedule(name, num_stages, CHUNKS).to_csv()
    given = Schedule.from_csv(text, name="mine")
    named_loss, named_grads = _run(name, num_stages)
    loss, grads = _run(given, num_stages)
    assert torch.equal(loss, named_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, named_grads, strict=True))


def test_a_schedule_built_action_by_action_gives_the_plain_models_gradients():
    # Worker 1 runs every forward, then the backwards newest first: no built-in's order.
    rows = [
        ["0F0", "0F1", "0F2", "0F3", "0B3", "0B2", "0B1", "0B0"],
        ["1F0", "1F1", "1F2", "1F3", "1B3", "1B2", "1B1", "1B0"],
    ]
    mine = Schedule.from_lists(rows, name="lifo")
    plain = _model()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 6, generator=g)
    nn.functional.mse_loss(plain(x), y).backward()
    _, grads = _run(mine, 2)
    for got, expected in zip(grads, [p.grad for p in plain.parameters()], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)


def test_a_schedule_that_cannot_run_is_refused_before_anything_runs():
    deadlock = Schedule.from_lists([["0F0", "0B0"], ["1B0", "1F0"]])  # B before its F
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ScheduleError, match="1B0"):
        Pipeline(model, 1, balance=[4, 4], devices=["cpu", "cpu"], schedule=deadlock)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_a_schedule_fixes_the_micro_batch_count_and_the_workers():
    one_f_one_b = Schedule.from_csv(get_schedule("1f1b", 2, CHUNKS).to_csv())
    with pytest.raises(ConfigError, match=f"pass chunks={CHUNKS}"):
        Pipeline(_model(), 2, balance=[4, 4], devices=["cpu", "cpu"], schedule=one_f_one_b)
    with pytest.raises(ConfigError, match="runs on 2 workers, but there are 3 devices"):
        Pipeline(_model(), CHUNKS, devices=["cpu"] * 3, schedule=one_f_one_b)
    with pytest.raises(ConfigError, match="has 2 stages, but 4 were asked for"):
        Pipeline(_model(), CHUNKS, balance=[2] * 4, devices=["cpu"] * 2, schedule=one_f_one_b)
    pipe = Pipeline(_model(), CHUNKS, balance=[4, 4], devices=["cpu", "cpu"], schedule=one_f_one_b)
    assert pipe.schedule is one_f_one_b and pipe.schedule_for(CHUNKS) is one_f_one_b
    with pytest.raises(ConfigError, match="runs 4 micro-batches but this step has 2"):
        pipe.step(torch.randn(2, 6), torch.randn(2, 6), loss_fn=nn.functional.mse_loss)


def test_schedule_must_be_a_name_or_a_schedule():
    with pytest.raises(TypeError, match="Schedule.from_csv"):
        Pipeline(_model(), 2, devices=["cpu", "cpu"], schedule=["1f1b"])  # type: ignore[arg-type]
