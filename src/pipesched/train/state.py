"""Checkpoint files: atomic saves, and the random number generators' states."""

from __future__ import annotations

import os
import random
import sys
import tempfile
from typing import Any

import torch

__all__ = ["load_checkpoint", "rng_state", "save_checkpoint", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """The states of torch's CPU and CUDA generators, Python's, and NumPy's if it is loaded."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restores :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    numpy = sys.modules.get("numpy")
    if "numpy" in state and numpy is not None:
        numpy.random.set_state(state["numpy"])


def save_checkpoint(state: dict[str, Any], path: str) -> None:
    """``torch.save`` to a temporary file beside ``path``, then an atomic rename over it."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".pipesched-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def load_checkpoint(path: str) -> dict[str, Any]:
    """Reads a file written by :func:`save_checkpoint` (CPU tensors are kept on the CPU)."""
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
    return state
