"""Estimated times of layers that cannot run: FLOPs and bytes counted on the meta device.

A meta model holds no data, so nothing can be timed (nor allocated to be timed).
FLOPs come from ``FlopCounterMode``; a roofline, ``max(flops / FLOPS, bytes /
BANDWIDTH)``, turns them into seconds on a nominal device. The rates only rank
layers against each other, which is all balancing needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["RATES", "count_flops", "estimated_seconds", "tensor_bytes"]

RATES = {"cpu": (1e11, 2e10), "cuda": (1e14, 2e12)}
"""Nominal (FLOP/s, bytes/s) per device type: a few cores' AVX, and a data-center GPU."""


def count_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """``fn(*args, **kwargs)`` and the floating-point operations it counted."""
    with FlopCounterMode(display=False) as counter:
        out = fn(*args, **kwargs)
    return out, int(counter.get_total_flops())


def estimated_seconds(flops: float, nbytes: float, device_type: str) -> float:
    """The roofline time of ``flops`` operations touching ``nbytes``, on a nominal device."""
    compute, bandwidth = RATES.get(device_type, RATES["cuda"])
    return max(flops / compute, nbytes / bandwidth)


def tensor_bytes(values: Any) -> int:
    """Bytes of the tensors among ``values`` (a flat iterable)."""
    return sum(t.numel() * t.element_size() for t in values if isinstance(t, torch.Tensor))
