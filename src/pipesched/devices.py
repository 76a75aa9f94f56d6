"""Choosing a pipeline's workers and devices, and sharing the CPU's threads among them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipesched.distributed.mesh import MeshInfo
from pipesched.errors import ConfigError

__all__ = ["Device", "resolve_devices", "resolve_workers", "threads_per_worker"]

Device = torch.device | str | int


def threads_per_worker(cpu_workers: int) -> int:
    """Intra-op threads per CPU worker: the process's threads shared out, at least one."""
    return max(1, torch.get_num_threads() // max(1, cpu_workers))


def resolve_workers(
    schedule: str,
    v: int,
    devices: Sequence[Device] | None,
    balance: Sequence[int] | None,
    num_stages: int | None,
    mesh: MeshInfo | None,
) -> tuple[int, list[Device]]:
    """The number of workers (devices, or pp ranks of ``mesh``) and the device of each.

    Args:
        schedule: the schedule's name, ``v`` its stages per worker.
        devices, mesh: the Pipeline's arguments (at most one of them).
        balance: layers per stage, if given as a list.
        num_stages: the stages asked for (by ``num_stages``, ``balance`` or
            ``split_points``), or None.

    Raises:
        ConfigError: both ``devices`` and ``mesh``, or stages that do not fill
            the workers ``v`` to one.
    """
    chosen: list[Device]
    if mesh is not None:
        if devices is not None:
            raise ConfigError(
                "pass either mesh= or devices=, not both: with a mesh each rank runs its "
                "stages on its own device"
            )
        workers, chosen = mesh.pp_size, [mesh.device] * mesh.pp_size
    else:
        workers, chosen = resolve_devices(devices, balance, num_stages, v, schedule)
    if num_stages is not None and num_stages != workers * v:
        per = f"{v} stages" if v > 1 else "1 stage"
        raise ConfigError(
            f"schedule {schedule!r} runs {per} per worker, so {num_stages} stages need "
            f"{num_stages / v:g} devices, but devices has {workers} "
            f"({[str(d) for d in chosen]}); give a balance of {workers * v} stages, "
            f"{num_stages / v:g} devices, or a schedule with more stages per worker "
            "('interleaved-1f1b')"
        )
    return workers, chosen


def resolve_devices(
    devices: Sequence[Device] | None,
    balance: Sequence[int] | None,
    num_stages: int | None,
    v: int,
    schedule: str,
) -> tuple[int, list[Device]]:
    """The number of workers and their devices."""
    if devices is not None:
        chosen = list(devices)
        if not chosen:
            raise ConfigError("devices is empty; give at least one device, e.g. ['cpu']")
        return len(chosen), chosen
    stages = len(balance) if balance is not None else num_stages
    if stages is None:
        workers = torch.cuda.device_count() or 1
    else:
        if stages % v:
            raise ConfigError(
                f"schedule {schedule!r} runs {v} stages per worker, but {stages} stages were "
                f"asked for; use a multiple of {v}"
            )
        workers = stages // v
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if workers > count:
            raise ConfigError(
                f"{workers} workers need {workers} CUDA devices, {count} are visible; "
                "pass devices= explicitly"
            )
        return workers, [f"cuda:{i}" for i in range(workers)]
    return workers, ["cpu"] * workers
