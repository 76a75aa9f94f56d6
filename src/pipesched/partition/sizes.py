"""The sizes a torch.export trace holds for, and whether a call's tensors are within them.

Why check: export turns a Python branch on a size into a guard and a size of
1 it sees into a constant; a call of other sizes would run the traced branch,
or broadcast, silently. A trace records, per input dimension, either the size
export fixed or the bounds its guards derived (``range_constraints``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import fx
from torch.export import ExportedProgram

from pipesched.runtime.compat.internals import size_expressions, size_hints

__all__ = ["Dims", "grows_with", "input_dims", "refusal"]

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


_PROBES = (1, 2, 3, 4, 5, 8, 13, 64)
"""Batch sizes a size is evaluated at to learn whether it grows with the batch."""


def grows_with(size: torch.SymInt, symbols: set[Any]) -> bool:
    """Whether a traced size changes with ``symbols`` (the batch's), the other sizes as traced.

    Why not its symbols alone: sympy does not always simplify what a model computes
    of its sizes (Swin's window merge views ``B * windows`` rows as ``(B, H / w, W /
    w, ...)``, whose dim 2 holds B over B), so the size is evaluated at a few batch
    sizes. True where that cannot be done (a size without a traced value).
    """
    found = [e for e in size_expressions(size) if e.free_symbols & symbols]
    if not found:
        return False
    expr = found[0]
    free = frozenset(expr.free_symbols)
    if expr in symbols or (expr.is_Mul and all(a.is_Symbol or a.is_Integer for a in expr.args)):
        return True  # the batch, or a product of sizes with it: no need to probe
    hints = size_hints(size)
    others = tuple((s, int(hints[s])) for s in free - symbols if s in hints)
    if len(others) != len(free - symbols):
        return True
    return _grows(expr, free & symbols, others)


@functools.lru_cache(maxsize=4096)
def _grows(expr: Any, batch: frozenset[Any], others: tuple[tuple[Any, int], ...]) -> bool:
    import sympy

    seen = set()
    for probe in _PROBES:
        values = {s: sympy.Integer(v) for s, v in others} | {s: sympy.Integer(probe) for s in batch}
        try:
            value = expr.xreplace(values)
        except (TypeError, ValueError, ZeroDivisionError):
            return True
        if not value.is_number:
            return True
        seen.add(value)
        if len(seen) > 1:
            return True
    return False
