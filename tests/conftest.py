"""Shared test fixtures."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def fp64():
    """float64 as torch's default dtype for the test, for exactness checks (rtol 1e-12)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)
