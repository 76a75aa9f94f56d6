"""Cutting an nn.Sequential into contiguous stages, by a balance or by parameter counts."""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, cast

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from pipesched.errors import PartitionError
from pipesched.partition.balance import min_max_counts

__all__ = [
    "SequentialStage",
    "balance_by_params",
    "check_balance",
    "check_statistics_in_one_stage",
    "sequential_layers",
    "shared_norms",
    "split_sequential",
]


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
    # Layers the model holds under more than one name: listed twice, or also inside another.
    held = Counter(id(m) for _, m in module.named_modules(remove_duplicate=False))
    repeated = frozenset(id(layer) for _, layer in layers if held[id(layer)] > 1)
    stages: list[nn.Sequential] = []
    start = 0
    for count in counts:
        part = layers[start : start + count]
        if repeated:
            stages.append(SequentialStage(part, repeated))
        else:
            stages.append(nn.Sequential(OrderedDict(part)))
        start += count
    return stages


SharedNorm = tuple[str, _BatchNorm, tuple[int, ...]]
"""A BatchNorm with running statistics that two stages or more hold: name, layer, stages."""


def shared_norms(stages: Sequence[nn.Module]) -> list[SharedNorm]:
    """The BatchNorms with running statistics that more than one stage holds (once per cut)."""
    held: dict[int, set[int]] = {}
    for s, stage in enumerate(stages):
        for module in stage.modules():
            if isinstance(module, _BatchNorm) and module.track_running_stats:
                held.setdefault(id(module), set()).add(s)
    shared: dict[int, SharedNorm] = {}
    for stage in stages:
        for name, module in stage.named_modules():
            where = held.get(id(module), set())
            if len(where) > 1 and id(module) not in shared:
                shared[id(module)] = (name, cast(_BatchNorm, module), tuple(sorted(where)))
    return list(shared.values())


def check_statistics_in_one_stage(shared: Sequence[SharedNorm]) -> None:
    """Raises PartitionError if one of ``shared`` (:func:`shared_norms`) is in training mode,
    moving its running statistics; in eval mode it only reads them, and may be shared.

    Why: stages run in threads of their own (or processes on a mesh), so its
    statistics' updates would race, or be split between the ranks' copies.
    Checked at every call, as a model may be built in eval mode and trained later.
    """
    for name, module, where in shared:
        if module.training:
            raise PartitionError(
                f"BatchNorm {name!r} is used by stages {list(where)} in training mode: "
                "the model holds one BatchNorm at more than one place, and stages run in "
                "threads or processes of their own, so the updates of its running "
                "statistics would race or be split between copies. Choose a balance that "
                "keeps its places in one stage, or give each place a BatchNorm of its own "
                "(in eval mode, which only reads them, it may be in both)"
            )


class _Site(nn.Module):
    """One position of a layer the model holds under two names: calls the layer there."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self._layer = (layer,)  # a tuple: not a child, so it owns no parameters

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The layer on its input."""
        return self._layer[0](*args, **kwargs)


class SequentialStage(nn.Sequential):
    """A slice of a model holding a layer under two names (``nn.Sequential(drop, lin, drop)``).

    Why not a plain ``nn.Sequential``: a random draw is keyed by the innermost of
    the model's named modules running it (:mod:`pipesched.runtime.stage.draw_keys`),
    and a layer at two positions is one module, so its draws were counted in
    whichever stage ran it and moved with the cut. Here each such position runs
    through a module of its own, named as the position (:attr:`sites`), and a
    draw's place is its position, as for any layer.

    Args:
        layers: the slice's ``(name, layer)`` pairs, under the model's names (or a
            mapping: ``nn.Sequential`` slices itself so).
        repeated: ids of the layers the model holds under more than one name.
    """

    def __init__(
        self,
        layers: Sequence[tuple[str, nn.Module]] | Mapping[str, nn.Module],
        repeated: frozenset[int] = frozenset(),
    ) -> None:
        pairs = list(layers.items()) if isinstance(layers, Mapping) else list(layers)
        super().__init__(OrderedDict(pairs))
        sites = nn.Module()
        calls: list[nn.Module] = []
        for name, layer in pairs:
            if id(layer) in repeated:
                site = _Site(layer)
                sites.add_module(name, site)
                calls.append(site)
            else:
                calls.append(layer)
        self._calls = tuple(calls)
        self.__dict__["sites"] = sites  # not a child: no state of its own

    @property
    def draw_places(self) -> nn.Module:
        """The positions' sites, named as the positions: places of random draws."""
        sites: nn.Module = self.__dict__["sites"]
        return sites

    def forward(self, input: Any) -> Any:
        """The layers in order, each repeated layer through its site."""
        for call in self._calls:
            input = call(input)
        return input


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
