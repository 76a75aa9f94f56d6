"""The oldest torch pipesched runs with, checked when pipesched is imported.

The floor is the oldest torch the suite runs against (``pyproject.toml`` agrees; a
test holds them equal). The version is read from ``torch/version.py`` without
importing torch, so the schedule layer stays torch-free.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

__all__ = ["TORCH_FLOOR", "check_torch_version", "installed_torch_version"]

TORCH_FLOOR = (2, 13)
"""The oldest torch (major, minor) the test suite runs against: 2.13.0 (CPU build)."""


def installed_torch_version() -> str | None:
    """The installed torch's version string (``"2.13.0+cpu"``), or None where unknown."""
    module = sys.modules.get("torch")
    if module is not None:
        return str(getattr(module, "__version__", "")) or None
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        try:
            text = (Path(location) / "version.py").read_text()
        except OSError:
            continue
        found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
        if found:
            return found.group(1)
    return None


def check_torch_version(version: str | None) -> None:
    """Raises ImportError naming the fix when ``version`` is below :data:`TORCH_FLOOR`.

    Example:
        >>> check_torch_version("2.13.0+cpu")
        >>> check_torch_version("2.6.0")
        Traceback (most recent call last):
        ...
        ImportError: pipesched needs torch 2.13 or newer, but torch 2.6.0 is installed; ...
    """
    if version is None:
        return
    release = re.match(r"(\d+)\.(\d+)", version)
    if release is None or (int(release[1]), int(release[2])) >= TORCH_FLOOR:
        return
    floor = ".".join(map(str, TORCH_FLOOR))
    raise ImportError(
        f"pipesched needs torch {floor} or newer, but torch {version} is installed; "
        f"{floor} is the oldest torch its test suite runs against (older ones are untested). "
        f"Upgrade with `pip install 'torch>={floor}'` (on a GPU machine, the CUDA build "
        "your driver supports)"
    )
