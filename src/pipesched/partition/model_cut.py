"""From a model to stage modules: trace or list the layers, profile them, choose the cuts, split.

What ``Pipeline(...)`` runs at construction: an ``nn.Sequential`` is cut between its
children, any other model traced with torch.export and cut between the layers of
its stage graph. Cuts come from ``balance`` (a list, ``"params"``, ``"time"``,
``"memory"``, ``"schedule"``; docs/partitioning.md) or ``split_points``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import networkx as nx
import torch
from torch import nn

from pipesched.errors import ConfigError, ConfigTypeError, PartitionError
from pipesched.partition.balance import bounds_of, simulate_counts
from pipesched.partition.call import Call
from pipesched.partition.cuts import (
    BALANCE_MODES,
    LayerCosts,
    balance_mode,
    fixed_counts,
    prefix_sums,
    searched_counts,
    split_positions,
    start_units,
)
from pipesched.partition.materialize import on_meta
from pipesched.partition.profile import device_kind, measure_sequential, measure_traced
from pipesched.partition.report import Partition, StagePlan
from pipesched.partition.sequential import SequentialStage, split_sequential
from pipesched.partition.split import split_traced
from pipesched.partition.stage_graph import Layer, layers, sequential_graph, traced_graph
from pipesched.partition.trace import TracedModel, trace_model
from pipesched.partition.traced_stage import TracedStage
from pipesched.runtime.stage.tree import tensors
from pipesched.schedule import Schedule, Timeline
from pipesched.schedule.spec import ScheduleSpec, schedule_for

__all__ = ["BALANCE_MODES", "ModelCut", "draw_places", "plan_partition", "simulate_partition"]


def draw_places(stages: Sequence[nn.Module]) -> list[nn.Module]:
    """What names places of random draws besides the model's modules, for the engine's
    ``extra_names``: a traced stage's random operations, a sequential stage's sites."""
    places: list[nn.Module] = []
    for stage in stages:
        if isinstance(stage, TracedStage) and stage.random_ops is not None:
            places.append(stage.random_ops)
        elif isinstance(stage, SequentialStage):
            places.append(stage.draw_places)
    return places


@dataclass(frozen=True, eq=False)
class ModelCut:
    """The stage graph, the cuts chosen in it, and their explanation.

    Args:
        graph: the stage graph (``pipe.stage_graph``).
        layers: its layers, the units cuts fall between.
        counts: layers per stage (``pipe.balance``).
        partition: the per-stage table (``pipe.partition``).
        traced: the trace, for a model that is not an ``nn.Sequential``.
    """

    graph: nx.DiGraph
    layers: tuple[Layer, ...]
    counts: tuple[int, ...]
    partition: Partition
    traced: TracedModel | None

    def build(self, module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
        """The stage modules, sharing ``module``'s parameters and buffers.

        Raises:
            PartitionError: tied weights would have to live on two devices.
        """
        if self.traced is None:
            if not isinstance(module, nn.Sequential):
                raise ConfigTypeError("an untraced plan needs the nn.Sequential it was made for")
            return list(split_sequential(module, self.counts))
        orders = self.graph.nodes
        starts = [orders[layer.nodes[0]]["order"] for layer in self.layers]
        bounds = [starts[b] for b in bounds_of(self.counts)[:-1]] + [len(self.traced.ops)]
        return list(split_traced(self.traced, bounds, devices))


def plan_partition(
    module: nn.Module,
    *,
    num_stages: int,
    devices: Sequence[torch.device],
    schedule: ScheduleSpec,
    num_microbatches: int,
    balance: Sequence[int] | str | None = None,
    example_inputs: tuple[Any, ...] | None = None,
    split_points: Sequence[str] | None = None,
    memory_budget: float | None = None,
    num_threads: int | None = None,
    repeats: int = 3,
    traced: TracedModel | None = None,
) -> ModelCut:
    """Chooses where to cut ``module`` into ``num_stages`` stages.

    Args:
        module: an ``nn.Sequential`` (cut between children, never traced) or
            any model (traced with ``example_inputs``).
        num_stages: stages to cut.
        devices: the device of each stage; profiling runs on one device of
            each kind among them.
        schedule, num_microbatches: what the pipeline will run (for the
            held micro-batches and the simulation).
        balance: see the module docstring; None: ``"params"`` for an
            ``nn.Sequential``, ``"time"`` otherwise.
        example_inputs: the positional arguments of one call, best of one
            micro-batch's size (costs are measured on it).
        split_points: names of the modules stages 1, 2, ... begin with.
        memory_budget: bytes per worker.
        num_threads: intra-op threads while profiling on the CPU (a pipeline
            worker's share).
        repeats: timed runs per node.
        traced: the model's trace on ``example_inputs``, if one was made
            already (the planner's): it is not traced again.

    Raises:
        ConfigError: arguments that do not fit together.
        PartitionError: the model cannot be traced or cut as asked.
    """
    mode = balance_mode(module, balance, split_points, example_inputs, memory_budget)
    if isinstance(module, nn.Sequential):
        traced = None
    elif traced is None:
        if example_inputs is None:
            raise ConfigError(
                f"module is a {type(module).__name__}, not an nn.Sequential; pass "
                "example_inputs=(x,) (one micro-batch) and num_stages= to have it traced and "
                "split, or wrap its layers in an nn.Sequential"
            )
        traced = trace_model(module, example_inputs)
    boundaries = split_positions(module, traced, split_points) if split_points else []
    estimated = on_meta(module)  # nothing can run: costs are estimated from FLOPs on meta
    costs = _profile(module, traced, example_inputs, devices, mode, num_threads, repeats, estimated)
    first = costs[devices[0]] if costs else None
    if traced is not None:
        graph = traced_graph(traced, first, boundaries)
    else:
        graph = sequential_graph(cast(nn.Sequential, module), first, _input_bytes(example_inputs))
    units = tuple(layers(graph))
    plan_schedule = schedule_for(schedule, num_stages, num_microbatches)
    held = plan_schedule.simulate().peak_activations
    layer_costs = LayerCosts(units, devices, costs, graph, held)
    starts = start_units(traced, graph, boundaries)
    counts = fixed_counts(mode, module, units, num_stages, balance, starts, layer_costs)
    counts = searched_counts(
        mode, counts, layer_costs, plan_schedule, memory_budget, num_stages, module
    )
    partition = _partition(
        mode, module, units, counts, devices, plan_schedule, layer_costs, memory_budget
    )
    if estimated and layer_costs.timed:
        partition = dataclasses.replace(partition, estimated=True)
    return ModelCut(graph, units, tuple(counts), partition, traced)


def simulate_partition(
    graph: nx.DiGraph, counts: Sequence[int], schedule: ScheduleSpec, num_microbatches: int
) -> Timeline:
    """The step ``schedule`` would take with ``graph``'s layers cut into ``counts``.

    What-if for any cut points, with the costs measured into the stage graph
    (``pipe.stage_graph``): per stage, the sums of its layers' forward and
    backward times (backward split evenly into B and W where the schedule
    splits it). One micro-batch costs what the example input cost.

    Raises:
        ConfigError: the graph was built without profiling (no example input).
        PartitionError: ``counts`` does not cover the graph's layers.
    """
    units = layers(graph)
    if any(u.forward_time is None for u in units):
        raise ConfigError(
            "the stage graph has no measured times; build the pipeline with "
            "example_inputs=(x,) and a balance that profiles ('time' or 'schedule')"
        )
    if sum(counts) != len(units) or min(counts, default=0) < 1:
        raise PartitionError(
            f"counts {list(counts)} must be positive and add up to the {len(units)} layers"
        )
    forward = prefix_sums(u.forward_time for u in units)
    backward = prefix_sums(u.backward_time for u in units)
    activation = prefix_sums(u.activation_bytes or 0 for u in units)

    def passes(k: int, i: int, j: int) -> tuple[float, float, float]:
        return forward[j] - forward[i], backward[j] - backward[i], activation[j] - activation[i]

    plan = schedule_for(schedule, len(counts), num_microbatches)
    return simulate_counts(plan, counts, passes, lambda k, i, j: 0.0).timeline


def _profile(
    module: nn.Module,
    traced: TracedModel | None,
    example_inputs: tuple[Any, ...] | None,
    devices: Sequence[torch.device],
    mode: str,
    num_threads: int | None,
    repeats: int,
    estimated: bool = False,
) -> dict[torch.device, Any]:
    """Per stage device, the measured cost of each node (empty without an example).

    ``estimated``: the model is on the meta device; each node runs there
    and its times are estimated for the stage's device type.
    """
    if example_inputs is None:
        return {}
    timing = mode in ("time", "schedule")
    measured: dict[Any, Any] = {}
    for stage_device in devices:
        if device_kind(stage_device) in measured:
            continue
        device = torch.device("meta") if estimated else stage_device
        estimate = stage_device.type if estimated else None
        with _threads(num_threads if device.type == "cpu" else None):
            if traced is not None:
                measured[device_kind(stage_device)] = measure_traced(
                    traced,
                    example_inputs,
                    device,
                    timing=timing,
                    repeats=repeats,
                    estimate=estimate,
                )
            else:
                module = cast(nn.Sequential, module)  # only a Sequential goes untraced
                example_inputs = Call.of(example_inputs).args  # refuses a bare tensor
                if len(example_inputs) != 1:
                    raise ConfigTypeError(
                        f"an nn.Sequential takes one input, but example_inputs has "
                        f"{len(example_inputs)}; pass example_inputs=(x,)"
                    )
                measured[device_kind(stage_device)] = measure_sequential(
                    module,
                    example_inputs[0],
                    device,
                    timing=timing,
                    repeats=repeats,
                    estimate=estimate,
                )
    return {d: measured[device_kind(d)] for d in devices}


def _partition(
    mode: str,
    module: nn.Module,
    units: Sequence[Layer],
    counts: Sequence[int],
    devices: Sequence[torch.device],
    schedule: Schedule,
    costs: LayerCosts,
    memory_budget: float | None,
) -> Partition:
    numel = {n: p.numel() for n, p in module.named_parameters(remove_duplicate=False)}
    bounds = bounds_of(counts)
    rows = []
    for k in range(len(counts)):
        i, j = bounds[k], bounds[k + 1]
        names = frozenset(p for u in units[i:j] for p in u.params)
        forward, backward, activation = costs.passes(k, i, j)
        rows.append(
            StagePlan(
                index=k,
                device=str(devices[k]),
                layers=tuple(u.name for u in units[i:j]),
                params=sum(numel.get(p, 0) for p in names),
                param_bytes=costs.param_bytes[j] - costs.param_bytes[i],
                forward_time=forward if costs.timed else None,
                backward_time=backward if costs.timed else None,
                activation_bytes=int(activation) if costs.sized else None,
                held_microbatches=costs.held[k],
            )
        )
    simulated = None
    if costs.timed:
        simulated = simulate_counts(schedule, counts, costs.passes, costs.fixed_memory).timeline
    return Partition(
        mode, schedule.name, schedule.num_microbatches, tuple(rows), simulated, memory_budget
    )


def _input_bytes(example_inputs: tuple[Any, ...] | None) -> int | None:
    if example_inputs is None:
        return None
    return sum(t.numel() * t.element_size() for t in tensors(example_inputs))


@contextlib.contextmanager
def _threads(count: int | None) -> Iterator[None]:
    previous = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
