"""Fixtures of the picture tests."""

from __future__ import annotations

import pytest

from pipesched.schedule import Costs, Event, Timeline, get_schedule


@pytest.fixture
def measured() -> Timeline:
    """A 1F1B step on 2 workers as a runtime would record it: seconds, irregular, offset."""
    plan = get_schedule("1f1b", 2, 4).simulate(Costs(0.0011, 0.0023, 0.0, send=0.0001))
    events = [
        Event(e.action, e.worker, 0.0003 + e.start * 1.07, 0.0003 + e.end * 1.07 + 0.00001)
        for e in plan.events
    ]
    return Timeline(tuple(events), plan.placement)
