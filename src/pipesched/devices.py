"""Choosing a local pipeline's workers and devices, and sharing the CPU's threads among them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipesched.errors import ConfigError

__all__ = ["Device", "resolve_devices", "threads_per_worker"]

Device = torch.device | str | int


def threads_per_worker(cpu_workers: int) -> int:
    """Intra-op threads per CPU worker: the process's threads shared out, at least one."""
    return max(1, torch.get_num_threads() // max(1, cpu_workers))


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
