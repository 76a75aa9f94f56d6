"""Putting a Pipeline together: where its stages run, where the model is cut, what runs them.

A :class:`~pipesched.Pipeline` is built in named steps: :func:`resolve_layout`
(the schedule, the workers' devices and each stage's worker; no model needed),
then :func:`assemble` (the cut, the stage modules, the runtime and the stepper
for one kind of call). An ``nn.Sequential`` is assembled at construction; any
other model on its first call, traced from that call's first micro-batch, and
again only when the arguments' structure changes (:func:`pipesched.call.call_key`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipesched.batchnorm import DeferredBatchNorm
from pipesched.call import Call
from pipesched.devices import Device, resolve_devices, resolve_workers, threads_per_worker
from pipesched.distributed.mesh import MeshInfo, rank0_value
from pipesched.errors import ConfigError
from pipesched.partition import Partition, Plan, TracedStage, check_balance, plan_partition
from pipesched.runtime.distributed import DistributedRuntime
from pipesched.runtime.fused_linear import unshared_parameters
from pipesched.runtime.local import LocalRuntime
from pipesched.runtime.tree import map_tensors
from pipesched.schedule import Schedule, stages_per_worker
from pipesched.schedule.spec import ScheduleSpec, spec_name, spec_placement
from pipesched.stepper import Stepper

__all__ = ["Assembly", "Cut", "Layout", "assemble", "resolve_layout"]


@dataclass(frozen=True)
class Layout:
    """Where a pipeline's stages run.

    Args:
        schedule: the schedule's name, or the one Schedule given.
        devices: each worker's device (pp rank's, on a mesh).
        placement: each stage's worker.
        mesh: this rank's place in the mesh, or None (one process).
    """

    schedule: ScheduleSpec
    devices: tuple[torch.device, ...]
    placement: tuple[int, ...]
    mesh: MeshInfo | None

    @property
    def stage_devices(self) -> list[torch.device]:
        """The device of each stage."""
        return [self.devices[w] for w in self.placement]

    @property
    def cpu_threads(self) -> int:
        """Intra-op threads per CPU worker."""
        return threads_per_worker(sum(d.type == "cpu" for d in self.devices))


@dataclass(frozen=True)
class Cut:
    """How to cut the model: the Pipeline's arguments that choose the stages.

    Args:
        chunks: micro-batches per batch (what ``balance="schedule"`` simulates).
        balance: layers per stage, or a balancing mode's name, or None.
        split_points: names of the modules stages 1, 2, ... begin with.
        memory_budget: bytes per worker.
        deferred_batch_norm: replace BatchNorm layers by DeferredBatchNorm.
        fuse_weight_grads: fused weight-gradient accumulation in steps.
    """

    chunks: int
    balance: Sequence[int] | str | None
    split_points: Sequence[str] | None
    memory_budget: float | None
    deferred_batch_norm: bool
    fuse_weight_grads: bool


@dataclass(frozen=True, eq=False)
class Assembly:
    """One cut of the model and what runs it.

    Args:
        key: the :func:`~pipesched.call.call_key` of the call it was traced
            from (None: an ``nn.Sequential``, or traced ahead of time).
        plan: the cut (counts, stage graph, partition table).
        stages: every stage module (other ranks' ones freed, on a mesh).
        own: the indices of this process's stages.
        runtime: runs the stages' actions.
        tied: on a mesh, for each of this rank's parameters that stages on
            other pp ranks use too, the sorted pp ranks that use it.
        stepper: runs steps as transactions, seeded.
    """

    key: tuple[Any, ...] | None
    plan: Plan
    stages: list[nn.Module]
    own: list[int]
    runtime: LocalRuntime
    tied: dict[int, tuple[int, ...]]
    stepper: Stepper

    @property
    def partition(self) -> Partition:
        """The per-stage table of the cut."""
        return self.plan.partition

    def fits(self, key: tuple[Any, ...]) -> bool:
        """Whether this cut runs calls of ``key`` in the modules' present training modes."""
        if self.key is not None and self.key != key:
            return False
        return all(s.modes_hold() for s in self.stages if isinstance(s, TracedStage))


def resolve_layout(
    schedule: ScheduleSpec,
    devices: Sequence[Device] | None,
    balance: Sequence[int] | str | None,
    num_stages: int | None,
    split_points: Sequence[str] | None,
    mesh: MeshInfo | None,
) -> Layout:
    """The schedule, the workers' devices and each stage's worker, from the arguments.

    Raises:
        ConfigError: the stages asked for (``num_stages``, ``balance``,
            ``split_points``, a given Schedule) do not fit the workers.
    """
    counts = None if balance is None or isinstance(balance, str) else list(balance)
    requested = num_stages
    if counts is not None or split_points is not None:
        requested = len(counts) if counts is not None else len(list(split_points or ())) + 1
    if isinstance(schedule, Schedule):
        workers, chosen = _given_schedule_workers(schedule, devices, requested, mesh)
    else:
        v = stages_per_worker(schedule)
        workers, chosen = resolve_workers(schedule, v, devices, counts, requested, mesh)
    return Layout(
        schedule, tuple(torch.device(d) for d in chosen), spec_placement(schedule, workers), mesh
    )


def _given_schedule_workers(
    schedule: Schedule,
    devices: Sequence[Device] | None,
    requested: int | None,
    mesh: MeshInfo | None,
) -> tuple[int, list[Device]]:
    name = f"the schedule {schedule.name!r}"
    if requested is not None and requested != schedule.num_stages:
        raise ConfigError(
            f"{name} has {schedule.num_stages} stages, but {requested} were asked for "
            "(num_stages, balance or split_points); ask for as many as the schedule has"
        )
    if mesh is not None:
        workers, chosen = resolve_workers(spec_name(schedule), 1, devices, None, None, mesh)
    else:
        workers, chosen = resolve_devices(devices, None, schedule.num_workers, 1, schedule.name)
    if workers != schedule.num_workers:
        where = "pipeline ranks (pp)" if mesh is not None else "devices"
        raise ConfigError(
            f"{name} runs on {schedule.num_workers} workers, but there are {workers} {where}; "
            f"give {schedule.num_workers} {where}"
        )
    return workers, chosen


def assemble(
    pipe: nn.Module,
    module: nn.Module,
    layout: Layout,
    cut: Cut,
    example: Call | tuple[Any, ...] | None,
    *,
    key: tuple[Any, ...] | None,
    register: Callable[[Sequence[nn.Module], list[int]], None],
    on_stage_done: Callable[[int], None],
    finish: Callable[[], None],
) -> Assembly:
    """Cuts ``module`` into stages and builds what runs them.

    Args:
        pipe: the Pipeline (its modules name the places of random draws).
        module: the model.
        layout, cut: where stages run and how to cut.
        example: one micro-batch's call (a traced model), or None.
        key: the call key the cut is for.
        register: called with the stages and this process's own ones before
            the stepper names the places of random draws by the pipeline's modules.
        on_stage_done: on a mesh, called with a stage once its gradients are final.
        finish: called at the end of each successful step (committing BatchNorm).
    """
    sequential = isinstance(module, nn.Sequential)
    balance = cut.balance
    if isinstance(module, nn.Sequential) and balance is not None and not isinstance(balance, str):
        check_balance(module, list(balance))
    num_stages = len(layout.placement)
    stage_devices = layout.stage_devices

    def plan_with(balance: Sequence[int] | str | None, split: Sequence[str] | None) -> Plan:
        return plan_partition(
            module,
            num_stages=num_stages,
            devices=stage_devices,
            schedule=layout.schedule,
            num_microbatches=cut.chunks,
            example_inputs=example,
            balance=balance,
            split_points=split,
            memory_budget=cut.memory_budget,
            num_threads=layout.cpu_threads,
        )

    # The first call may come under torch.no_grad() or inference_mode (an evaluation): tracing
    # and profiling measure backward too, on a copy of the example made outside of them.
    with torch.inference_mode(False), torch.enable_grad():
        example = map_tensors(example, torch.clone) if example is not None else None
        plan = plan_with(cut.balance, cut.split_points)
    info = layout.mesh
    if info is not None and list(plan.counts) != (agreed := rank0_value(list(plan.counts))):
        # Measured balances (time, schedule) can differ between ranks: rank 0's cut wins.
        with torch.inference_mode(False), torch.enable_grad():
            plan = plan_with(agreed, None)
    if cut.deferred_batch_norm and not sequential:
        DeferredBatchNorm.convert(module)  # after tracing: the stages call the new layers
    stages = plan.build(module, stage_devices)
    runtime: LocalRuntime
    tied: dict[int, tuple[int, ...]] = {}
    if info is None:
        own = list(range(num_stages))
        for s, stage in enumerate(stages):
            stage.to(stage_devices[s])
        fused = unshared_parameters(stages) if cut.fuse_weight_grads else None
        runtime = LocalRuntime(stages, list(layout.devices), layout.cpu_threads, fused)
    else:
        runtime, own, tied = DistributedRuntime.on_rank(
            stages, layout.placement, info, fuse=cut.fuse_weight_grads, on_stage_done=on_stage_done
        )
    register(stages, own)
    random_ops = [t.random_ops for t in stages if isinstance(t, TracedStage)]
    stepper = Stepper(  # a traced model's random operations are places of draws too
        runtime,
        pipe,
        stages,
        stage_devices,
        [r for r in random_ops if r is not None],
        adaptive=info is None,  # on a mesh a rerun would need every rank
        finish=finish,
    )
    return Assembly(key, plan, stages, own, runtime, tied, stepper)
