"""Shared test fixtures, and the ``cuda`` marker's skip."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from hypothesis import settings

# The property tests draw the same examples on every run unless asked to explore
# (HYPOTHESIS_PROFILE=explore): a run that passed passes again, so CI's verdict is
# the code's, never the draw's.
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


@pytest.fixture
def fp64():
    """float64 as torch's default dtype for the test, for exactness checks (rtol 1e-12)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


@pytest.fixture
def ctrl_c():
    """Ctrl-C raises KeyboardInterrupt during the test, as in a terminal.

    A shell starts background jobs with SIGINT ignored, and Python then
    leaves it ignored: a suite run in the background (``make test &``) would
    see no KeyboardInterrupt at all.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(autouse=True)
def cpu_only_unless_marked_cuda(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """A test not marked ``cuda`` runs as on a machine without a GPU, as CI's is.

    Why: a Pipeline given no ``devices=`` takes the visible GPUs, and the unmarked
    tests are written for CPU (their tensors are on CPU), as are the processes they
    start (gloo ranks, torchrun, examples). On a GPU machine they would otherwise
    mix devices, or fork ranks from a parent that has initialized CUDA.
    """
    if request.node.get_closest_marker("cuda") is not None or not torch.cuda.is_available():
        return
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # for the processes the test starts
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` skip, with the reason, where torch sees no CUDA device.

    Every CUDA-only test carries the marker, so ``pytest -m cuda`` runs them all
    (``make gpu-check`` does).
    """
    if torch.cuda.is_available():
        # Reads the visible devices now, before a test hides them from the processes
        # it starts (``cpu_only_unless_marked_cuda``) by setting CUDA_VISIBLE_DEVICES.
        # torch caches the count at its first call after that, which must not fall inside
        # such a test (it would cache 0).
        torch.cuda.init()  # type: ignore[no-untyped-call]
        torch.cuda.device_count()
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
