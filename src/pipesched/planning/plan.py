"""Where a pipeline's stages run, and how the model is to be cut: the arguments, resolved."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipesched.errors import ConfigError
from pipesched.partition.materialize import InitWeights
from pipesched.planning.devices import Device, resolve_devices, resolve_workers, threads_per_worker
from pipesched.runtime.mesh import MeshInfo
from pipesched.schedule import Schedule, stages_per_worker
from pipesched.schedule.spec import ScheduleSpec, spec_name, spec_placement

__all__ = ["Cut", "Layout", "resolve_layout"]


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
        init_weights: how the stages of a model on the meta device are
            initialized once cut (:mod:`pipesched.partition.materialize`).
    """

    chunks: int
    balance: Sequence[int] | str | None
    split_points: Sequence[str] | None
    memory_budget: float | None
    deferred_batch_norm: bool
    fuse_weight_grads: bool
    init_weights: InitWeights = None


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
