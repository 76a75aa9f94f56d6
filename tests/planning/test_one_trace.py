"""schedule="auto" builds one Pipeline and exports the model once; elsewhere each one traces."""

from __future__ import annotations

import copy

import torch

from pipesched import Pipeline
from pipesched.pipeline import facade
from tests.planning.test_auto import Branchy, _gradients_equal


def _count_exports(monkeypatch) -> list[int]:
    calls = [0]
    export = torch.export.export

    def counted(*args, **kwargs):
        calls[0] += 1
        return export(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counted)
    return calls


def _count_pipelines(monkeypatch) -> list[int]:
    built = [0]
    init = facade.Pipeline.__init__

    def counted(self, *args, **kwargs):
        built[0] += 1
        init(self, *args, **kwargs)

    monkeypatch.setattr(facade.Pipeline, "__init__", counted)
    return built


def test_auto_builds_one_pipeline_exports_once_and_its_pick_trains_like_the_model(monkeypatch):
    calls, built = _count_exports(monkeypatch), _count_pipelines(monkeypatch)
    model = Branchy().double()
    reference = copy.deepcopy(model)
    x = torch.randn(24, 8, dtype=torch.float64)
    y = torch.randint(0, 64, (24,))
    pipe = Pipeline(model, 6, schedule="auto", devices=["cpu", "cpu"], example_inputs=(x[:4],))
    assert built[0] == 1  # the planner times layers on an engine, not on Pipelines
    assert calls[0] == 1  # the profile, both timing runs and the pick: the planner's trace
    _gradients_equal(pipe, reference, x, y)


def test_an_nn_sequential_under_auto_is_never_exported(monkeypatch):
    calls, built = _count_exports(monkeypatch), _count_pipelines(monkeypatch)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4))).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    Pipeline(model, 2, schedule="auto", devices=["cpu", "cpu"], example_inputs=(x,))
    assert (calls[0], built[0]) == (0, 1)


def test_each_pipeline_outside_the_planner_traces_anew(monkeypatch):
    calls = _count_exports(monkeypatch)
    model = Branchy().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    for _ in range(2):
        Pipeline(model, 2, num_stages=2, example_inputs=(x,))
    assert calls[0] == 2  # the user may have changed the model in between
