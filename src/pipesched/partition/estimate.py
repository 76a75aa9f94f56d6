"""Estimated times of layers that cannot run: FLOPs and bytes counted on the meta device.

Why estimates: a model built on the meta device holds no data, so nothing can
be timed (and must not be allocated to be timed: a rank may hold one stage of
a model that fits no single device). Each layer or operation runs on meta
tensors under ``torch.utils.flop_counter.FlopCounterMode``, forward and then
backward, which counts the floating-point operations of matrix products and
convolutions; a simple roofline turns them into seconds on a nominal device:
``max(flops / FLOPS, bytes / BANDWIDTH)``, where bytes are what the layer
reads and writes (inputs, parameters, outputs; the backward twice that). The
rates are nominal, not measured: the seconds only rank the layers against
each other, which is all balancing needs, and the partition table says they
are estimates.
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
