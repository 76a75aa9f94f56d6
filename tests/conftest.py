"""Shared test fixtures, and the ``cuda`` marker's skip."""

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` skip, with the reason, where torch sees no CUDA device.

    Every CUDA-only test carries the marker, so ``pytest -m cuda`` runs them all
    (``make gpu-check`` does).
    """
    if torch.cuda.is_available():
        return
    has = (
        "is built without CUDA"
        if torch.version.cuda is None
        else f"is built for CUDA {torch.version.cuda} but sees no device"
    )
    skip = pytest.mark.skip(reason=f"needs a CUDA device: torch {torch.__version__} {has}")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
