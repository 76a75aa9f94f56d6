"""Gantt pictures: valid files, a band per worker, true widths, the overlay, argument errors."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from pipesched.analysis import compare
from pipesched.errors import ConfigError
from pipesched.schedule import Costs, Timeline, get_schedule
from pipesched.viz import gantt, gantt_comparison
from tests.viz.pictures import bands

pytest.importorskip("matplotlib")
from PIL import Image  # comes with matplotlib


def test_png_parses_and_has_a_band_per_worker(tmp_path):
    path = gantt(get_schedule("1f1b", 3, 4), tmp_path / "1f1b.png")
    with Image.open(path) as image:
        image.verify()
        assert image.format == "PNG"
    assert len(bands(path)) == 3


def test_svg_parses(tmp_path):
    schedule = get_schedule("zb-v", 4, 3)
    path = gantt(schedule, tmp_path / "zb-v.svg", costs=Costs(1, 1, 1), activations=False)
    root = ET.parse(path).getroot()
    assert root.tag.endswith("svg")
    text = path.read_text()
    assert "makespan" in text and "worker 1" in text  # text kept as text, not paths


def test_box_widths_are_durations(measured):
    import matplotlib

    from pipesched.viz._figure import STYLE
    from pipesched.viz._units import time_unit
    from pipesched.viz.gantt import _gantt_figure

    with matplotlib.rc_context(STYLE):
        figure = _gantt_figure(measured, None, "t", time_unit([measured], None), False)
    ax = figure.axes[0]
    widths = sorted(
        round(p.vertices[:, 0].max() - p.vertices[:, 0].min(), 9)
        for c in ax.collections
        for p in c.get_paths()
    )
    assert widths == sorted(round(1000 * e.duration, 9) for e in measured.events)  # in ms
    assert ax.get_xlabel() == "time (ms)"


def test_overlay_draws_both_timelines(tmp_path, measured):
    plan = get_schedule("1f1b", 2, 4).simulate(measured.measured_costs())
    path = gantt(measured, tmp_path / "run.png", overlay=plan)
    assert len(bands(path)) == 4  # per worker, the run and the plan under it
    with Image.open(path) as image:
        assert image.width > 800


def test_comparison_stacks_every_schedule(tmp_path):
    rows = compare(2, 3)
    path = gantt_comparison(rows, tmp_path / "all.png")
    assert len(bands(path)) == 2 * len(rows)
    root = ET.parse(gantt_comparison(rows, tmp_path / "all.svg")).getroot()
    assert all(r.name in ET.tostring(root, encoding="unicode") for r in rows)


def test_argument_errors(tmp_path, measured):
    schedule = get_schedule("gpipe", 2, 2)
    with pytest.raises(ConfigError, match=r"must end in \.png or \.svg"):
        gantt(schedule, tmp_path / "x.jpg")
    with pytest.raises(ConfigError, match="costs= only applies"):
        gantt(measured, tmp_path / "x.png", costs=Costs())
    with pytest.raises(ConfigError, match="overlay has 4 workers"):
        gantt(measured, tmp_path / "x.png", overlay=get_schedule("gpipe", 4, 2).simulate())
    with pytest.raises(ConfigError, match="unit must be one of"):
        gantt(measured, tmp_path / "x.png", unit="ms")
    with pytest.raises(ConfigError, match="must be a Timeline or a Schedule"):
        gantt("1f1b", tmp_path / "x.png")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="no schedule to draw"):
        gantt_comparison([], tmp_path / "x.png")
    assert not list(tmp_path.iterdir())


def test_empty_timeline_draws(tmp_path):
    assert gantt(Timeline((), (0, 1)), tmp_path / "empty.png").stat().st_size > 0


def test_a_prediction_shows_its_step_and_bubble_by_cause(tmp_path, measured):
    from pipesched.analysis.prediction import StepModel, predict
    from pipesched.schedule.breakdown import PARTS

    model = StepModel.measure(measured, checkpoint_stop=3, outside=0.001)
    predicted = predict(get_schedule("1f1b", 2, 4), model, checkpoint_stop=3)
    text = gantt(predicted, tmp_path / "predicted.svg", activations=False).read_text()
    assert "predicted step" in text
    assert all(part in text for part in PARTS)
