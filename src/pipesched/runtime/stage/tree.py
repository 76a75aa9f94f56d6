"""The tensors inside nested tuples, lists and dicts: flatten them, rebuild with new leaves.

A leaf of the package (it imports only torch): partition/, the runtimes and the
pipeline all walk values with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["map_tensors", "tensors"]


def tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``value``, depth first, in a stable order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, tuple | list):
        for item in value:
            yield from tensors(item)
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from tensors(item)


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with each tensor replaced by ``fn(tensor)``, same nesting and types."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(map_tensors(v, fn) for v in value))
    if isinstance(value, tuple | list):
        return type(value)(map_tensors(v, fn) for v in value)
    if isinstance(value, Mapping):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    return value
