"""The plan of a Pipeline: what it runs, decided before its model is cut; frozen."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipesched.errors import ConfigError
from pipesched.partition.materialize import InitWeights
from pipesched.planning.candidate import Planning
from pipesched.planning.devices import (
    Device,
    resolve_devices,
    resolve_workers,
    threads_per_worker,
)
from pipesched.runtime.engine import Workers
from pipesched.runtime.mesh import MeshInfo
from pipesched.runtime.stage.recompute import stage_stops
from pipesched.schedule import Schedule, stages_per_worker
from pipesched.schedule.spec import (
    ScheduleSpec,
    check_spec,
    schedule_for,
    spec_name,
    spec_placement,
)

__all__ = ["Plan", "resolve_plan"]


@dataclass(frozen=True)
class Plan:
    """What a Pipeline runs: the schedule family, its workers, how to cut, what to recompute.

    Args:
        schedule: a built-in schedule's name, or the one Schedule given.
        chunks: micro-batches per mini-batch.
        devices: each worker's device (this rank's, on a mesh).
        placement: each stage's worker.
        checkpoint: the recomputation mode, or one per stage.
        mesh: this rank's place in the mesh, or None (one process).
        balance: layers per stage, a balancing mode's name, or None.
        split_points: names of the modules stages 1, 2, ... begin with.
        memory_budget: bytes per worker the cut must fit.
        deferred_batch_norm: BatchNorm layers become DeferredBatchNorm.
        fuse_weight_grads: fused weight-gradient accumulation in steps.
        init_weights: how the stages of a model on the meta device are
            initialized once cut (:mod:`pipesched.partition.materialize`).
        report: under ``schedule="auto"``, every candidate the planner
            compared and its pick; else None.
    """

    schedule: ScheduleSpec
    chunks: int
    devices: tuple[torch.device, ...]
    placement: tuple[int, ...]
    checkpoint: str | tuple[str, ...]
    mesh: MeshInfo | None = None
    balance: Sequence[int] | str | None = None
    split_points: Sequence[str] | None = None
    memory_budget: float | None = None
    deferred_batch_norm: bool = False
    fuse_weight_grads: bool = True
    init_weights: InitWeights = None
    report: Planning | None = None

    @property
    def num_stages(self) -> int:
        """Model stages."""
        return len(self.placement)

    @property
    def stage_devices(self) -> list[torch.device]:
        """The device of each stage."""
        return [self.devices[w] for w in self.placement]

    @property
    def cpu_threads(self) -> int:
        """Intra-op threads per CPU worker."""
        return threads_per_worker(sum(d.type == "cpu" for d in self.devices))

    @property
    def workers(self) -> Workers:
        """Where the stages run, as the engine takes it."""
        return Workers(self.devices, self.placement, self.cpu_threads, self.mesh)

    def schedule_for(self, num_microbatches: int) -> Schedule:
        """The validated schedule for ``num_microbatches`` micro-batches."""
        return schedule_for(self.schedule, self.num_stages, num_microbatches)

    def stage_stops(self, num_microbatches: int) -> tuple[int, ...]:
        """Per stage, how many leading micro-batches recompute their forward."""
        return stage_stops(self.checkpoint, self.num_stages, num_microbatches)

    def __str__(self) -> str:
        if self.report is not None:
            return str(self.report)
        modes = self.checkpoint if isinstance(self.checkpoint, str) else list(self.checkpoint)
        return (
            f"{spec_name(self.schedule)}: {self.num_stages} stages on "
            f"{len(self.devices)} workers {[str(d) for d in self.devices]}, "
            f"{self.chunks} micro-batches, checkpoint {modes}"
        )


def resolve_plan(
    schedule: ScheduleSpec,
    chunks: int,
    *,
    devices: Sequence[Device] | None = None,
    balance: Sequence[int] | str | None = None,
    num_stages: int | None = None,
    split_points: Sequence[str] | None = None,
    checkpoint: str | tuple[str, ...] = "except_last",
    mesh: MeshInfo | None = None,
    memory_budget: float | None = None,
    deferred_batch_norm: bool = False,
    fuse_weight_grads: bool = True,
    init_weights: InitWeights = None,
    report: Planning | None = None,
) -> Plan:
    """The plan a Pipeline's arguments (checked) ask for.

    Raises:
        ConfigError: an unknown schedule, or a given Schedule for another
            ``chunks``; the stages asked for (``num_stages``, ``balance``,
            ``split_points``, a given Schedule) do not fit the workers; or
            ``checkpoint`` gives modes for another number of stages.
    """
    schedule = check_spec(schedule, chunks)
    layout_devices, placement = _workers(schedule, devices, balance, num_stages, split_points, mesh)
    stage_stops(checkpoint, len(placement), 1)  # one mode per stage?
    return Plan(
        schedule,
        chunks,
        layout_devices,
        placement,
        checkpoint,
        mesh,
        tuple(balance) if isinstance(balance, list) else balance,
        tuple(split_points) if isinstance(split_points, list) else split_points,
        memory_budget,
        deferred_batch_norm,
        fuse_weight_grads,
        init_weights,
        report,
    )


def _workers(
    schedule: ScheduleSpec,
    devices: Sequence[Device] | None,
    balance: Sequence[int] | str | None,
    num_stages: int | None,
    split_points: Sequence[str] | None,
    mesh: MeshInfo | None,
) -> tuple[tuple[torch.device, ...], tuple[int, ...]]:
    """The workers' devices and each stage's worker, from the arguments."""
    counts = None if balance is None or isinstance(balance, str) else list(balance)
    requested = num_stages
    if counts is not None or split_points is not None:
        requested = len(counts) if counts is not None else len(list(split_points or ())) + 1
    if isinstance(schedule, Schedule):
        workers, chosen = _given_schedule_workers(schedule, devices, requested, mesh)
    else:
        v = stages_per_worker(schedule)
        workers, chosen = resolve_workers(schedule, v, devices, counts, requested, mesh)
    return tuple(torch.device(d) for d in chosen), spec_placement(schedule, workers)


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
