"""Pipeline.predict: from the partition before any step, from the measured step after one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipesched import ConfigError, Pipeline
from pipesched.errors import ConfigTypeError
from pipesched.schedule import FORWARD


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
    )


def _step(pipe: Pipeline) -> None:
    pipe.step(torch.randn(12, 8), torch.randn(12, 4), loss_fn=nn.functional.mse_loss)


def test_before_any_step_predicts_from_the_partition_and_says_so():
    pipe = Pipeline(
        _model(),
        4,
        devices=["cpu", "cpu"],
        balance="time",
        example_inputs=(torch.randn(3, 8),),
        schedule="1f1b",
    )
    t = pipe.predict()
    assert t.breakdown is not None and "partition's profiled" in t.breakdown.source
    assert "no overhead" in t.summary()
    assert len(t.events) == 2 * 2 * 4 and t.placement == (0, 1)
    assert (t.breakdown.overhead, t.breakdown.communication, t.breakdown.outside) == (0, 0, 0)
    assert t.breakdown.idle == pytest.approx(sum(t.idle))
    assert len(pipe.predict(3).events) == 2 * 2 * 3


def test_before_any_step_without_times_says_how_to_get_them():
    pipe = Pipeline(_model(), 2, devices=["cpu", "cpu"], balance=[3, 2])
    with pytest.raises(ConfigError, match="run one pipe.step"):
        pipe.predict()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "zb-v"])
def test_after_a_step_predicts_from_its_measured_actions(schedule):
    stages = 4 if schedule == "zb-v" else 2
    pipe = Pipeline(
        _model(),
        3,
        devices=["cpu", "cpu"],
        balance=[2, 1, 1, 1] if stages == 4 else [3, 2],
        schedule=schedule,
    )
    _step(pipe)
    assert pipe.last_step_seconds is not None and pipe.last_step_seconds > 0
    t = pipe.predict()
    b = t.breakdown
    assert b is not None and "measured actions" in b.source
    assert b.outside >= 0 and t.step_time == pytest.approx(t.makespan + b.outside)
    assert b.idle == pytest.approx(sum(t.idle))
    assert {e.action for e in t.events} == {e.action for e in pipe.last_timeline.events}
    five = pipe.predict(num_microbatches=5)
    assert {e.action.microbatch for e in five.events} == set(range(5))
    assert five.makespan > t.makespan


def test_a_forward_only_call_is_not_a_step_to_predict_from():
    pipe = Pipeline(_model(), 2, devices=["cpu", "cpu"], balance=[3, 2])
    with torch.no_grad():
        pipe(torch.randn(4, 8))
    assert all(e.action.kind == FORWARD for e in pipe.last_timeline.events)
    with pytest.raises(ConfigError, match="run one pipe.step"):
        pipe.predict()


def test_bad_num_microbatches():
    pipe = Pipeline(_model(), 2, devices=["cpu", "cpu"], balance=[3, 2])
    _step(pipe)
    with pytest.raises(ConfigTypeError, match="num_microbatches"):
        pipe.predict(2.0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="at least 1"):
        pipe.predict(0)


def test_a_schedule_given_as_a_table_predicts_its_own_count_and_says_why_not_another():
    from pipesched.schedule import get_schedule

    table = get_schedule("1f1b", 2, 3)
    pipe = Pipeline(_model(), 3, devices=["cpu", "cpu"], balance=[3, 2], schedule=table)
    _step(pipe)
    assert len(pipe.predict(3).events) == sum(map(len, table.actions))
    with pytest.raises(ConfigError, match=r"predict\(num_microbatches=6\).* table of 3.* name"):
        pipe.predict(6)
