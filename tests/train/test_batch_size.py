"""Effective batch arithmetic."""

from __future__ import annotations

import math

import pytest

from pipesched import ConfigError
from pipesched.train import plan_accumulation


def test_not_whole_offers_the_nearest_choices():
    plan = plan_accumulation(3072, 10, replicas=240, lr=1e-3)
    assert not plan.whole
    assert plan.exact_steps == pytest.approx(1.28)
    assert [(c.accumulation_steps, c.effective_batch) for c in plan.choices] == [
        (1, 2400),
        (2, 4800),
    ]
    low, high = plan.choices
    assert low.lr_linear == pytest.approx(1e-3 * 2400 / 3072)
    assert high.lr_sqrt == pytest.approx(1e-3 * math.sqrt(4800 / 3072))
    text = plan.describe()
    assert "1.28 accumulation steps is not whole" in text
    assert "accumulation_steps=2: effective batch 4800" in text


def test_whole():
    plan = plan_accumulation(256, 16, chunks=4, replicas=2)
    assert plan.whole and plan.exact_steps == 2
    assert "accumulation_steps=2 gives it exactly" in plan.describe()


def test_bad_counts():
    with pytest.raises(ConfigError, match="micro_batch must be a positive integer, got 0"):
        plan_accumulation(64, 0)
