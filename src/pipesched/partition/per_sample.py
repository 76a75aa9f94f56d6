"""Which outputs of a traced model follow the batch in dim 0: the others are not concatenated.

``pipe(x)`` concatenates micro-batch outputs along dim 0, right for logits and wrong
for a per-feature mean. The export tells them apart: a per-sample output's dim 0 is
a symbol of the batch size. Where the model pins dim 0 of every input, every output
counts as per sample.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from pipesched.partition.sizes import grows_with
from pipesched.partition.trace import TracedModel
from pipesched.runtime.compat.internals import pytree

__all__ = ["leaf_paths", "per_sample_flags"]


def per_sample_flags(traced: TracedModel) -> tuple[bool, ...]:
    """Per flattened output (``pytree`` order): whether dim 0 follows the batch.

    Non-tensor outputs and 0-dim tensors count as per sample (they are joined
    by their own rules).
    """
    batch: set[Any] = set()  # the symbols of the inputs' dim 0
    known: set[Any] = set()  # the symbols of any input dimension
    for node in traced.inputs:
        value = node.meta.get("val")
        for k, dim in enumerate(value.shape if isinstance(value, torch.Tensor) else ()):
            if isinstance(dim, torch.SymInt):
                known |= dim.node.expr.free_symbols
                batch |= dim.node.expr.free_symbols if k == 0 else set()
    if traced.traced_batch is not None or not batch:  # dim 0 pinned: nothing to tell by
        return (True,) * len(traced.outputs)
    flags = []
    for out in traced.outputs:
        size = _dim0(out) if isinstance(out, fx.Node) else None
        if size is None:
            flags.append(True)
        elif isinstance(size, torch.SymInt):  # the batch's, or data-dependent (unknown)
            free = size.node.expr.free_symbols
            flags.append(bool(free & batch and grows_with(size, batch)) or bool(free - known))
        else:
            flags.append(False)
    return tuple(flags)


def leaf_paths(value: Any) -> list[str]:
    """Each leaf's path in ``value``, in ``pytree`` order, written as the joining names them.

    ``['logits']`` for a mapping's (or a ModelOutput's) entry, ``[0]`` for a
    sequence's, ``.name`` for a namedtuple's.
    """
    paths = []
    for keys, _ in pytree.tree_flatten_with_path(value)[0]:
        text = ""
        for key in keys:
            if isinstance(key, pytree.MappingKey):
                text += f"[{key.key!r}]"
            elif isinstance(key, pytree.SequenceKey):
                text += f"[{key.idx}]"
            elif isinstance(key, pytree.GetAttrKey):
                text += f".{key.name}"
            else:
                text += str(key)
        paths.append(text)
    return paths


def _dim0(node: fx.Node) -> int | torch.SymInt | None:
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor) and value.ndim >= 1:
        return value.shape[0]
    return None
