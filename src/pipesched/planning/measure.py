"""From a model to a plan: its layers profiled on one micro-batch, then searched; ``"auto"``."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pipesched.errors import ConfigError, PipeschedWarning, warn_user
from pipesched.partition import ModelCut, plan_partition
from pipesched.partition.call import Call, with_cache_off
from pipesched.partition.materialize import InitWeights, on_meta
from pipesched.partition.stage_graph import layers
from pipesched.partition.trace import TracedModel
from pipesched.planning.candidate import LayerCost, Planning
from pipesched.planning.devices import Device
from pipesched.planning.plan import Plan, resolve_plan
from pipesched.planning.search import plan_layers
from pipesched.planning.timing import run_layer_times
from pipesched.runtime.mesh import MeshInfo, rank0_value
from pipesched.runtime.stage.recompute import CHECKPOINT_MODES

__all__ = ["layer_costs", "plan_auto", "plan_model"]


def layer_costs(
    module: nn.Module,
    example_inputs: tuple[Any, ...],
    *,
    device: Device = "cpu",
    num_threads: int | None = None,
    repeats: int = 3,
) -> tuple[list[LayerCost], str]:
    """Each cut unit's costs on one micro-batch ``example_inputs``, and where its times come from.

    The stage graph comes from the profile ``Pipeline`` makes (an
    ``nn.Sequential`` layer by layer; any other model traced first): bytes
    held, parameters, what crosses each cut. The times are each layer's F
    and B in pipesched's own runtime (:mod:`pipesched.planning.timing`), or
    the per-operation profile's where that cannot run; a model on the meta
    device gets estimated times (:mod:`pipesched.partition.estimate`).
    """
    costs, source, _ = _layer_costs(module, example_inputs, device, num_threads, repeats)
    return costs, source


def _layer_costs(
    module: nn.Module,
    example_inputs: Any,
    device: Device,
    num_threads: int | None,
    repeats: int,
) -> tuple[list[LayerCost], str, TracedModel | None]:
    """:func:`layer_costs`, and the model's trace they were measured on (None: a Sequential)."""
    if not isinstance(module, nn.Sequential):  # traced as Pipeline traces it: caching off
        example_inputs = with_cache_off(module, Call.of(example_inputs))

    def profiled(balance: str) -> ModelCut:  # "memory": bytes only; "time": timed too
        return plan_partition(
            module,
            num_stages=1,
            devices=[torch.device(device)],
            schedule="gpipe",
            num_microbatches=1,
            balance=balance,
            example_inputs=example_inputs,
            num_threads=num_threads,
            repeats=repeats,
            traced=traced,
        )

    traced: TracedModel | None = None  # one trace: the profile's, reused by every run after it
    # The runtime times the layers; the per-operation timings are needed only without it.
    plan = profiled("time" if on_meta(module) else "memory")
    traced = plan.traced
    graph = plan.graph
    units = layers(graph)
    crossing = [0.0] * (len(units) + 1)  # a difference array over cut positions
    for node, data in graph.nodes(data=True):
        if data.get("kind") == "output":
            continue
        unit = -1 if data.get("kind") == "input" else data.get("unit")
        if unit is None:
            continue
        ends = [graph.nodes[b].get("unit", len(units)) for b in graph.successors(node)]
        last = min(
            max((len(units) if e is None else e for e in ends), default=unit), len(units) - 1
        )
        if last > unit:  # this tensor is in every stage input from unit + 1 up to its last use
            crossing[unit + 1] += float(data.get("output_bytes") or 0)
            crossing[last + 1] -= float(data.get("output_bytes") or 0)
    backward_input: list[float | None] = [None] * len(units)
    backward_weight: list[float | None] = [None] * len(units)
    where = torch.device(device)
    source = "estimated from FLOPs (meta-device model)"
    if not plan.partition.estimated:
        try:
            timed = run_layer_times(module, example_inputs, len(units), where, num_threads, traced)
            units = [
                dataclasses.replace(u, forward_time=f, backward_time=b)
                for u, f, b in zip(units, timed.forward, timed.backward, strict=True)
            ]
            backward_input = list(timed.backward_input)
            backward_weight = list(timed.backward_weight)
            source = f"measured per layer in pipesched's runtime on {where}"
        except Exception as error:  # the per-operation profile stands in: say so, go on
            units = layers(profiled("time").graph)
            source = f"profiled per operation on {where} (a run per layer failed: "
            source += f"{type(error).__name__})"
            warn_user(
                f"the planner could not time each layer in pipesched's runtime ({error}); it "
                "plans with the per-operation profile, which can miss per-layer costs",
                PipeschedWarning,
            )
    users = Counter(p for u in units for p in u.params)
    sizes = graph.graph["param_bytes"]
    result, running = [], 0.0
    for k, u in enumerate(units):
        running += crossing[k]
        shared = tuple((p, float(sizes.get(p, 0))) for p in sorted(u.params) if users[p] > 1)
        result.append(
            LayerCost(
                u.name,
                float(u.forward_time or 0.0),
                float(u.backward_time or 0.0),
                float(u.activation_bytes or 0),
                float(u.param_bytes),
                running,
                backward_input[k],
                backward_weight[k],
                shared,
                None if u.split_bytes is None else float(u.split_bytes),
            )
        )
    return result, source, traced


def plan_model(
    module: nn.Module,
    example_inputs: tuple[Any, ...],
    num_workers: int,
    chunks: int,
    *,
    device: Device = "cpu",
    num_threads: int | None = None,
    memory_budget: float | None = None,
    schedules: Sequence[str] | None = None,
    checkpoints: Sequence[str] = CHECKPOINT_MODES,
    counts: Sequence[int] | None = None,
    synthesized: bool = True,
) -> Planning:
    """Profiles ``module`` on one micro-batch and plans it for ``num_workers`` and ``chunks``.

    See :func:`~pipesched.planning.search.plan_layers` for the arguments
    after ``chunks`` and what is compared.
    """
    costs, source, _ = _layer_costs(module, example_inputs, device, num_threads, 3)
    return plan_layers(
        costs,
        num_workers,
        chunks,
        memory_budget=memory_budget,
        schedules=schedules,
        checkpoints=checkpoints,
        counts=counts,
        synthesized=synthesized,
        source=f"{len(costs)} layers, {source}",
    )


def plan_auto(
    module: nn.Module,
    chunks: int,
    *,
    balance: Sequence[int] | str | None,
    devices: Sequence[Device] | None,
    checkpoint: str | None,
    example_inputs: Any,
    mesh: MeshInfo | None,
    memory_budget: float | None,
    num_stages: int | None,
    split_points: Sequence[str] | None = None,
    deferred_batch_norm: bool = False,
    fuse_weight_grads: bool = True,
    init_weights: InitWeights = None,
) -> tuple[Plan, TracedModel | None]:
    """Resolves ``schedule="auto"``: profile, plan, and (on a mesh) take rank 0's pick.

    Returns:
        The plan of the pick (its ``report``: every candidate compared), and
        the model's trace the costs were measured on (None: an ``nn.Sequential``),
        for the Pipeline to cut with rather than trace again.

    Raises:
        ConfigError: no example to measure, a balance mode other than the
            searched ones, or nothing fits ``memory_budget``.
    """
    if example_inputs is None:
        raise ConfigError(
            "schedule='auto' measures the model to choose its schedule and cut: pass "
            "example_inputs=(x,) with x one micro-batch of input"
        )
    if isinstance(balance, str) and balance not in ("time", "schedule"):
        raise ConfigError(
            f"schedule='auto' searches the cut itself; balance={balance!r} does not apply "
            "(leave it out, or give layers per stage)"
        )
    counts = None if balance is None or isinstance(balance, str) else list(balance)
    workers = num_stages  # devices not given: one worker per stage of a given balance
    if counts is not None:
        workers = len(counts) if devices is None and mesh is None else None
    where = resolve_plan("1f1b", chunks, devices=devices, num_stages=workers, mesh=mesh)
    costs, source, traced = _layer_costs(
        module, example_inputs, where.devices[0], where.cpu_threads, 3
    )
    planning = plan_layers(
        costs,
        len(where.devices),
        chunks,
        memory_budget=memory_budget,
        checkpoints=CHECKPOINT_MODES if checkpoint is None else (checkpoint,),
        counts=counts,
        source=f"{len(costs)} layers, {source}",
    )
    if mesh is not None:  # measured costs can differ between ranks: rank 0's plan wins
        planning = rank0_value(planning)
    pick = planning.pick
    plan = resolve_plan(
        pick.spec,
        chunks,
        devices=devices if mesh is not None else where.devices,
        balance=list(pick.counts),
        split_points=split_points,
        checkpoint=pick.checkpoint,
        mesh=mesh,
        deferred_batch_norm=deferred_batch_norm,
        fuse_weight_grads=fuse_weight_grads,
        init_weights=init_weights,
        report=planning,
    )
    return plan, traced
