"""Choosing the cut points of a stage graph: by a list, split points, or a balancing mode.

The modes and what they minimize are described in :mod:`pipesched.partition.model_cut`;
the searches themselves are in :mod:`pipesched.partition.balance`. Here the
layers' measured costs become stage costs (prefix sums, on each stage's
device) and the user's ``balance`` / ``split_points`` become layer counts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import networkx as nx
import torch
from torch import nn

from pipesched.errors import ConfigError, ConfigTypeError, PartitionError
from pipesched.partition.balance import check_cuttable, min_max_counts, search_schedule
from pipesched.partition.profile import NodeCost
from pipesched.partition.sequential import balance_by_params, check_balance, sequential_layers
from pipesched.partition.stage_graph import Layer
from pipesched.partition.trace import TracedModel
from pipesched.schedule import Schedule

__all__ = [
    "BALANCE_MODES",
    "LayerCosts",
    "balance_mode",
    "fixed_counts",
    "prefix_sums",
    "searched_counts",
    "split_positions",
    "start_units",
]

BALANCE_MODES = ("params", "time", "memory", "schedule")
"""The names ``balance=`` accepts besides a list of layer counts."""


def balance_mode(
    module: nn.Module,
    balance: Sequence[int] | str | None,
    split_points: Sequence[str] | None,
    example_inputs: tuple[Any, ...] | None,
    memory_budget: float | None,
) -> str:
    if split_points is not None:
        if balance is not None:
            raise ConfigError(
                f"give balance or split_points, not both (got balance={balance!r} and "
                f"split_points={list(split_points)!r})"
            )
        return "split_points"
    if balance is None:
        return "params" if isinstance(module, nn.Sequential) else "time"
    if isinstance(balance, str):
        if balance not in BALANCE_MODES:
            raise ConfigError(
                f"balance={balance!r} is not a balancing mode; use one of "
                f"{', '.join(map(repr, BALANCE_MODES))} or a list of layers per stage"
            )
        if balance != "params" and example_inputs is None:
            raise ConfigError(
                f"balance={balance!r} measures the layers on an example: pass "
                "example_inputs=(x,) with x one micro-batch of input"
            )
        if memory_budget is not None and balance not in ("time", "schedule"):
            raise ConfigError(
                f"memory_budget applies to balance='time' or 'schedule', not {balance!r}"
            )
        return balance
    if memory_budget is not None:
        raise ConfigError(
            "memory_budget applies to balance='time' or 'schedule' (which measure the "
            "layers on example_inputs=(x,)), not to a list of layer counts"
        )
    return "explicit"


class LayerCosts:
    """Prefix sums of the layers' costs, for O(1) stage costs on the stage's device."""

    def __init__(
        self,
        units: Sequence[Layer],
        devices: Sequence[torch.device],
        costs: dict[torch.device, Any],
        graph: nx.DiGraph,
        held: Sequence[int],
    ) -> None:
        self.timed = bool(costs) and all(u.forward_time is not None for u in units)
        self.sized = bool(costs)
        self.held = list(held)
        self.param_bytes = prefix_sums(u.param_bytes for u in units)
        self.activation = prefix_sums(u.activation_bytes or 0 for u in units)
        self.time: list[tuple[list[float], list[float]]] = []
        for device in devices:
            per_node = costs.get(device)
            if not self.timed or per_node is None:
                self.time.append(([0.0] * (len(units) + 1), [0.0] * (len(units) + 1)))
                continue
            cost = _lookup(graph, per_node)
            forward = prefix_sums(sum(cost(n).forward or 0.0 for n in u.nodes) for u in units)
            backward = prefix_sums(sum(cost(n).backward or 0.0 for n in u.nodes) for u in units)
            self.time.append((forward, backward))

    def passes(self, k: int, i: int, j: int) -> tuple[float, float, float]:
        """(forward, backward, activation bytes per micro-batch) of stage k = layers [i, j)."""
        forward, backward = self.time[k]
        return (
            forward[j] - forward[i],
            backward[j] - backward[i],
            float(self.activation[j] - self.activation[i]),
        )

    def fixed_memory(self, k: int, i: int, j: int) -> float:
        """Parameters and their gradients of stage k."""
        return 2.0 * float(self.param_bytes[j] - self.param_bytes[i])

    def memory(self, k: int, i: int, j: int) -> float:
        """Estimated peak bytes of stage k (one stage per worker)."""
        held = self.held[k] * float(self.activation[j] - self.activation[i])
        return self.fixed_memory(k, i, j) + held

    def step_time(self, k: int, i: int, j: int) -> float:
        forward, backward, _ = self.passes(k, i, j)
        return forward + backward


def fixed_counts(
    mode: str,
    module: nn.Module,
    units: Sequence[Layer],
    num_stages: int,
    balance: Sequence[int] | str | None,
    starts: Sequence[int],
    costs: LayerCosts,
) -> list[int]:
    """Layers per stage for the modes that need no search."""
    n = len(units)
    if mode == "explicit":
        balance = cast(Sequence[int], balance)  # explicit mode: a list of counts
        if isinstance(module, nn.Sequential):
            return check_balance(module, balance)
        counts = list(balance)
        bad = [b for b in counts if isinstance(b, bool) or not isinstance(b, int) or b < 1]
        if bad or sum(counts) != n:
            raise PartitionError(
                f"balance {counts} must be positive whole numbers adding up to the {n} layers "
                f"of the stage graph (got sum {sum(c for c in counts if isinstance(c, int))}); "
                "see pipe.stage_graph or use balance='time'"
            )
        return counts
    if mode == "split_points":
        return [b - a for a, b in itertools.pairwise([0, *starts, n])]
    if mode == "params" and isinstance(module, nn.Sequential):
        return balance_by_params(module, num_stages)
    if mode == "params":
        sizes = prefix_sums(max(1, u.param_bytes) for u in units)
        return min_max_counts(n, num_stages, lambda k, i, j: sizes[j] - sizes[i])
    if mode == "memory":
        return min_max_counts(n, num_stages, costs.memory)
    check_cuttable(n, num_stages)
    return []  # "time" and "schedule": see searched_counts


def searched_counts(
    mode: str,
    counts: list[int],
    costs: LayerCosts,
    schedule: Schedule,
    memory_budget: float | None,
    num_stages: int,
    module: nn.Module,
) -> list[int]:
    """Layers per stage for ``"time"`` and ``"schedule"``."""
    if mode not in ("time", "schedule"):
        return counts
    n = len(costs.param_bytes) - 1
    budget = math.inf if memory_budget is None else memory_budget

    def limited(k: int, i: int, j: int) -> float:
        return costs.step_time(k, i, j) if costs.memory(k, i, j) <= budget else math.inf

    by_time = min_max_counts(n, num_stages, limited)
    if mode == "time":
        return by_time
    best = search_schedule(
        schedule,
        n,
        costs.passes,
        costs.fixed_memory,
        start=by_time,
        memory_budget=memory_budget,
    )
    return list(best.counts)


def split_positions(
    module: nn.Module, traced: TracedModel | None, split_points: Sequence[str]
) -> list[int]:
    """Where each split point's stage begins: a child index (Sequential) or an op position."""
    names = list(split_points)
    if isinstance(split_points, str) or not all(isinstance(n, str) for n in names):
        raise ConfigTypeError(
            f"split_points must be a list of module names, got {split_points!r}; "
            "e.g. split_points=['transformer.h.2']"
        )
    if traced is None:
        children = [n for n, _ in sequential_layers(module)]
        positions = []
        for name in names:
            if name not in children:
                raise PartitionError(
                    f"split point {name!r} is not a layer of the nn.Sequential; its layers "
                    f"are {children}"
                )
            positions.append(children.index(name))
    else:
        positions = [_first_op(traced, name) for name in names]
    if positions[0] == 0 or positions != sorted(set(positions)):
        raise PartitionError(
            f"split points {names} must name modules in the order they run, after the "
            f"first (they begin at positions {positions}); stage 0 begins with the model"
        )
    return positions


def start_units(
    traced: TracedModel | None, graph: nx.DiGraph, positions: Sequence[int]
) -> list[int]:
    """The layer each split point's stage begins with."""
    if traced is None:
        return list(positions)
    return [graph.nodes[traced.ops[p].name]["unit"] for p in positions]


def _first_op(traced: TracedModel, name: str) -> int:
    for order, node in enumerate(traced.ops):
        stack = node.meta.get("nn_module_stack") or {}
        if any(p == name or p.startswith(f"{name}.") for p, _ in stack.values()):
            return order
    known = sorted(
        {p for n in traced.ops for p, _ in (n.meta.get("nn_module_stack") or {}).values() if p}
    )
    raise PartitionError(
        f"split point {name!r} names no module that runs in the traced "
        f"{type(traced.model).__name__}; modules that run include {known[:12]}"
    )


def prefix_sums(values: Any) -> list[Any]:
    return list(itertools.accumulate(values, initial=0))


def _lookup(graph: nx.DiGraph, per_node: Any) -> Callable[[Any], NodeCost]:
    """Cost of a graph node: by name (traced) or by layer order (Sequential)."""
    if isinstance(per_node, dict):
        return lambda n: per_node[n]
    return lambda n: per_node[graph.nodes[n]["order"]]
