"""Cutting an nn.Sequential into contiguous stages, by a balance or by parameter counts."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

from torch import nn

from pipesched.errors import PartitionError
from pipesched.partition.balance import min_max_counts

__all__ = ["balance_by_params", "check_balance", "sequential_layers", "split_sequential"]


def sequential_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``module``'s children by name, a layer listed twice kept twice (not so named_children)."""
    return [(name, layer) for name, layer in module._modules.items() if layer is not None]


def check_balance(module: nn.Sequential, balance: Sequence[int]) -> list[int]:
    """Checks ``balance`` (layers per stage, torchgpipe's meaning) fits ``module``.

    Raises:
        PartitionError: a count is not a positive integer, or the counts do not
            add up to the number of layers.
    """
    counts = list(balance)
    if not counts:
        raise PartitionError("balance is empty; give the number of layers of each stage")
    bad = [b for b in counts if isinstance(b, bool) or not isinstance(b, int) or b < 1]
    if bad:
        raise PartitionError(
            f"balance {counts} has entries {bad}; every stage needs a positive whole "
            "number of layers"
        )
    if sum(counts) != len(module):
        raise PartitionError(
            f"module and sum of balance have different length (module: {len(module)}, "
            f"sum of balance: {sum(counts)}); balance {counts} must add up to the "
            f"{len(module)} layers of the module"
        )
    return counts


def split_sequential(module: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """The stages: consecutive slices of ``module``, keeping each layer's name.

    The layers are shared, not copied: the stages and ``module`` hold the same
    parameters, so ``module.state_dict()`` keeps the original names.
    """
    counts = check_balance(module, balance)
    layers = sequential_layers(module)
    stages, start = [], 0
    for count in counts:
        stages.append(nn.Sequential(OrderedDict(layers[start : start + count])))
        start += count
    return stages


def balance_by_params(module: nn.Sequential, num_stages: int) -> list[int]:
    """Contiguous layer counts that minimize the largest stage's parameter count.

    Exact, by dynamic programming over cut points
    (:func:`~pipesched.partition.balance.min_max_counts`; ties go to the earliest
    cut). Layers without parameters count as one parameter so that stages of
    parameter-free layers still split.

    Raises:
        PartitionError: more stages than layers.

    Example:
        >>> balance_by_params(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)), 2)
        [2, 1]
    """
    sizes = [max(1, sum(p.numel() for p in layer.parameters())) for layer in module]
    prefix = list(itertools.accumulate(sizes, initial=0))
    return min_max_counts(len(sizes), num_stages, lambda k, i, j: prefix[j] - prefix[i])
