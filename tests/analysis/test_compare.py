"""Comparing the built-in schedules on one set of workers."""

from __future__ import annotations

import pytest

from pipesched.analysis import compare
from pipesched.analysis.compare import format_comparison
from pipesched.schedule import Costs


def test_same_model_same_work_per_worker():
    rows = {r.name: r for r in compare(4, 8, Costs(1, 1, 1))}
    assert set(rows) == {
        *("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"),
        *("zb-h2", "dualpipev", "v-half", "v-min"),
    }
    for r in rows.values():
        # Every schedule does the same work per worker: 8 micro-batches x (F+B+W).
        assert r.timeline.busy == pytest.approx((24.0,) * 4)
    assert rows["interleaved-1f1b"].schedule.num_stages == 8
    assert rows["gpipe"].timeline.bubble_fraction == pytest.approx(3 / 11)
    assert rows["interleaved-1f1b"].timeline.bubble_fraction == pytest.approx(3 / 19)
    assert rows["zb-h1"].timeline.bubble_fraction == pytest.approx(3 / 27)


def test_peak_memory_in_worker_shares():
    rows = {r.name: r for r in compare(4, 8)}
    assert rows["gpipe"].peak_memory == (8, 8, 8, 8)
    assert rows["1f1b"].peak_memory == (4, 3, 2, 1)
    # ZB-V keeps 1F1B's peak (p micro-batches of a worker's share) on every worker.
    assert rows["zb-v"].peak_memory == (4, 4, 4, 4)


def test_format():
    text = format_comparison(compare(2, 4))
    assert text.splitlines()[0].startswith("schedule")
    assert "zb-v" in text
