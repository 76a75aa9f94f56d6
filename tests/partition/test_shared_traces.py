"""Shared traces: schedule="auto" exports the model once; elsewhere each Pipeline traces anew."""

from __future__ import annotations

import copy

import torch

from pipesched import Pipeline
from pipesched.partition import shared_traces
from pipesched.partition.shared_traces import traces_shared
from pipesched.partition.trace import trace_model
from tests.planning.test_auto import Branchy, _gradients_equal


def _count_exports(monkeypatch) -> list[int]:
    calls = [0]
    export = torch.export.export

    def counted(*args, **kwargs):
        calls[0] += 1
        return export(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counted)
    return calls


def test_auto_exports_the_model_once_and_its_pick_trains_like_the_model(monkeypatch):
    calls = _count_exports(monkeypatch)
    model = Branchy().double()
    reference = copy.deepcopy(model)
    x = torch.randn(24, 8, dtype=torch.float64)
    y = torch.randint(0, 64, (24,))
    pipe = Pipeline(model, 6, schedule="auto", devices=["cpu", "cpu"], example_inputs=(x[:4],))
    assert calls[0] == 1  # the profile, two timing pipelines and the pick: one trace
    _gradients_equal(pipe, reference, x, y)
    assert shared_traces._shared.get() is None  # the scope closed with the construction


def test_outside_the_scope_each_pipeline_traces_anew(monkeypatch):
    calls = _count_exports(monkeypatch)
    model = Branchy().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    for _ in range(2):
        Pipeline(model, 2, num_stages=2, example_inputs=(x,))
    assert calls[0] == 2  # the user may have changed the model in between


def test_within_the_scope_another_shape_dtype_mode_or_model_is_traced_again(monkeypatch):
    calls = _count_exports(monkeypatch)
    model, other = Branchy().double(), Branchy().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    with traces_shared():
        first = trace_model(model, (x,))
        assert trace_model(model, (x.clone(),)) is first  # same kind of call: reused
        assert calls[0] == 1
        trace_model(model, (torch.randn(4, 3, 8, dtype=torch.float64),))
        trace_model(model, (x.float(),))
        model.eval()
        trace_model(model, (x,))
        trace_model(other, (x,))
    assert calls[0] == 5
