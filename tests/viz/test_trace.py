"""Chrome traces: the fields Perfetto and chrome://tracing need, one event per action."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipesched.schedule import get_schedule
from pipesched.viz import chrome_trace


def test_trace_has_one_complete_event_per_action(tmp_path, measured):
    data = json.loads(chrome_trace(measured, tmp_path / "run.json").read_text())
    complete = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(measured.events)
    for e in complete:
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"} <= set(e)
        assert set(e["args"]) == {"stage", "kind", "microbatch"}
        assert e["name"] == f"{e['args']['stage']}{e['args']['kind']}{e['args']['microbatch']}"
    by_name = {e["name"]: e for e in complete}
    for event in measured.events:  # seconds -> microseconds from the first action's start
        e = by_name[str(event.action)]
        assert e["pid"] == event.worker
        assert e["ts"] == pytest.approx((event.start - measured.start) * 1e6, abs=1e-3)
        assert e["dur"] == pytest.approx(event.duration * 1e6, abs=1e-3)
    names = {
        e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e["name"] == "process_name"
    }
    assert names == {0: "worker 0 (stage 0)", 1: "worker 1 (stage 1)"}


def test_plans_are_drawn_one_millisecond_per_unit(tmp_path):
    timeline = get_schedule("zb-v", 4, 2).simulate()
    data = json.loads(chrome_trace(timeline, tmp_path / "plan.json").read_text())
    durations = {e["dur"] for e in data["traceEvents"] if e["ph"] == "X"}
    assert durations == {1000.0}
    counters = [e for e in data["traceEvents"] if e["ph"] == "C"]
    assert {e["name"] for e in counters} == {f"held activations, stage {s}" for s in range(4)}


def test_viz_imports_neither_torch_nor_matplotlib_until_drawing(tmp_path):
    pytest.importorskip("matplotlib")
    trace, picture = str(tmp_path / "t.json"), str(tmp_path / "t.png")
    code = (
        "import sys, pipesched.viz, pipesched.cli.main\n"
        "from pipesched.schedule import get_schedule\n"
        f"pipesched.viz.chrome_trace(get_schedule('1f1b', 2, 2).simulate(), {trace!r})\n"
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported before a picture'\n"
        f"pipesched.viz.gantt(get_schedule('1f1b', 2, 2), {picture!r})\n"
        "assert 'matplotlib.pyplot' not in sys.modules, 'pyplot changes global state'\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", ["gpipe", "zb-v", "interleaved-1f1b"])
def test_one_flow_pair_per_transfer_between_workers(name):
    from pipesched.schedule import data_predecessor
    from pipesched.viz.chrome import trace_events

    timeline = get_schedule(name, 4, 4).simulate()
    placement = timeline.placement
    crossing = [
        e
        for e in timeline.events
        if (need := data_predecessor(e.action, timeline.num_stages)) is not None
        and placement[need[0]] != e.worker
    ]
    events = trace_events(timeline)["traceEvents"]
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    finishes = {e["id"]: e for e in events if e["ph"] == "f"}
    assert len(starts) == len(finishes) == len(crossing) > 0
    assert set(starts) == set(finishes)
    complete = {(e["pid"], e["ts"]) for e in events if e["ph"] == "X"}
    ends = {(e["pid"], round(e["ts"] + e["dur"], 3)) for e in events if e["ph"] == "X"}
    for n, finish in finishes.items():
        start = starts[n]
        assert start["pid"] != finish["pid"] and start["ts"] <= finish["ts"]
        assert (finish["pid"], finish["ts"]) in complete  # the consumer's start
        assert (start["pid"], start["ts"]) in ends  # the producer's end
