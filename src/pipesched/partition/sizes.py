"""The sizes a torch.export trace holds for, and whether a call's tensors are within them.

Why check: export turns a Python branch on a size into a guard and a size of
1 it sees into a constant; a call of other sizes would run the traced branch,
or broadcast, silently. A trace records, per input dimension, either the size
export fixed or the bounds its guards derived (``range_constraints``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.export import ExportedProgram

__all__ = ["Dims", "input_dims", "refusal"]

Dims = tuple[int | tuple[int, int | None], ...]
"""Per dimension: the size export fixed, or the ``(lowest, highest)`` it allows (None: no bound)."""


def refusal(where: str, value: Any, dims: Dims | None) -> str | None:
    """Why ``value`` falls outside ``dims``, or None when it fits.

    The batch dimension (dim 0) may hold a single row, as micro-batches do,
    even where export's guard says two; its fixed size is checked elsewhere
    (:attr:`~pipesched.partition.trace.TracedModel.traced_batch`).

    Args:
        where: how the message names the input.
        value: the input's value in a call.
        dims: what the trace holds for it (None: not a tensor input).
    """
    if dims is None or not isinstance(value, torch.Tensor):
        return None
    if value.ndim != len(dims):
        return f"{where} has {value.ndim} dimensions, the trace {len(dims)}"
    for k, (size, allowed) in enumerate(zip(value.shape, dims, strict=True)):
        if isinstance(allowed, int):
            if k > 0 and size != allowed:
                return f"dimension {k} of {where} is {size}; the trace fixed it at {allowed}"
            continue
        low, high = (1 if k == 0 else allowed[0]), allowed[1]
        if size < low or (high is not None and size > high):
            span = f"{low} to {high}" if high is not None else f"{low} or more"
            return f"dimension {k} of {where} is {size}; the trace holds for {span}"
    return None


def input_dims(node: fx.Node, program: ExportedProgram) -> Dims | None:
    """An input's dimensions as the trace holds them; None for a non-tensor input."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    dims: list[int | tuple[int, int | None]] = []
    for size in value.shape:
        if not isinstance(size, torch.SymInt):
            dims.append(int(size))
            continue
        bounds = program.range_constraints.get(size.node.expr)
        if bounds is None:  # an expression of other sizes: checked through them
            dims.append((0, None))
            continue
        dims.append((_size(bounds.lower) or 0, _size(bounds.upper)))
    return tuple(dims)


def _size(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, AttributeError, OverflowError, ValueError):
        return None
