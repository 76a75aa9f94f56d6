"""Runtimes execute a Schedule over stage modules: they consume schedules, never build them.

``__all__`` is what the layers above may use without reaching into the runtime's modules
(``train/`` imports public paths only); each name loads on first use, so that importing
one part of the runtime does not import the rest.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipesched.runtime.compat.internals import foreach_mul_, scaler_device
    from pipesched.runtime.grad_backup import copies_for, in_place, read_back
    from pipesched.runtime.placement import replaced_parameters, replacement
    from pipesched.runtime.stage.microbatch import batch_size
    from pipesched.runtime.transaction import deferred_interrupts

__all__ = [
    "batch_size",
    "copies_for",
    "deferred_interrupts",
    "foreach_mul_",
    "in_place",
    "read_back",
    "replaced_parameters",
    "replacement",
    "scaler_device",
]

_LAZY = {
    "batch_size": "pipesched.runtime.stage.microbatch",
    "copies_for": "pipesched.runtime.grad_backup",
    "in_place": "pipesched.runtime.grad_backup",
    "read_back": "pipesched.runtime.grad_backup",
    "deferred_interrupts": "pipesched.runtime.transaction",
    "foreach_mul_": "pipesched.runtime.compat.internals",
    "replaced_parameters": "pipesched.runtime.placement",
    "replacement": "pipesched.runtime.placement",
    "scaler_device": "pipesched.runtime.compat.internals",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pipesched.runtime' has no attribute {name!r}")
