"""Choosing a pipeline's workers and devices, and sharing the CPU's threads among them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipesched.errors import ConfigError, ConfigTypeError
from pipesched.runtime.mesh import MeshInfo

__all__ = ["Device", "check_device", "resolve_devices", "resolve_workers", "threads_per_worker"]

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
        need = (
            f"need {num_stages // v} devices" if num_stages % v == 0
            else f"do not fill its workers (not a multiple of {v})"
        )  # fmt: skip
        raise ConfigError(
            f"schedule {schedule!r} runs {per} per worker, so {num_stages} stages {need}, "
            f"but devices has {workers} ({[str(d) for d in chosen]}); give "
            + "; or ".join(_fixes(num_stages, workers, v))
        )
    return workers, chosen


def _fixes(num_stages: int, workers: int, v: int) -> list[str]:
    """What makes ``num_stages`` stages fit ``workers`` workers of a schedule of ``v`` each."""
    fixes = [f"a balance of {workers * v} stages for these {workers} devices"]
    if num_stages % v == 0:
        fixes.append(f"{num_stages // v} devices for {num_stages} stages")
    per_worker, rest = divmod(num_stages, workers)
    if not rest and per_worker != v:
        if per_worker == 1:
            fixes.append("a schedule of one stage per worker ('1f1b', 'zb-h1', 'gpipe')")
        elif per_worker == 2:
            fixes.append("a schedule of two stages per worker ('interleaved-1f1b', 'zb-v')")
        else:
            fixes.append(
                f"an interleaved schedule of {per_worker} stages per worker: schedule="
                f"get_schedule('interleaved-1f1b', {num_stages}, chunks, "
                f"virtual_stages={per_worker}) (with that chunks=)"
            )
    return fixes


def resolve_devices(
    devices: Sequence[Device] | None,
    balance: Sequence[int] | None,
    num_stages: int | None,
    v: int,
    schedule: str,
) -> tuple[int, list[Device]]:
    """The number of workers and their devices.

    Raises:
        ConfigTypeError: ``devices`` is not a list, or holds something not a device.
        ConfigError: ``devices`` is empty, names a device this torch build or
            machine does not have, or more workers are needed than CUDA devices.
    """
    if devices is not None:
        if isinstance(devices, str | int | torch.device) or not isinstance(devices, Sequence):
            raise ConfigTypeError(
                f"devices must be a list with the device of each worker, got "
                f"{type(devices).__name__} {devices!r}; e.g. devices=['cpu', 'cpu']"
            )
        chosen = list(devices)
        if not chosen:
            raise ConfigError("devices is empty; give at least one device, e.g. ['cpu']")
        for k, device in enumerate(chosen):
            check_device(device, f"devices[{k}]", len(chosen))
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


def check_device(device: object, name: str, workers: int = 1) -> torch.device:
    """``device`` as a ``torch.device`` this process can use.

    Args:
        device: a device as the user wrote it (``"cuda:1"``, ``torch.device("cpu")``, ``0``).
        name: what to call it in messages (``"devices[1]"``).
        workers: how many devices were given; the fix suggests that many CPUs.

    Raises:
        ConfigTypeError: ``device`` is not a str, int or torch.device.
        ConfigError: no such device type, or a CUDA device this torch build
            (no CUDA) or this machine (too few GPUs) does not have.

    Example:
        >>> check_device("cpu", "devices[0]")
        device(type='cpu')
    """
    if isinstance(device, bool) or not isinstance(device, str | int | torch.device):
        raise ConfigTypeError(
            f"{name} must be a device name, index or torch.device, got "
            f"{type(device).__name__} {device!r}; e.g. 'cpu' or 'cuda:0'"
        )
    try:
        parsed = torch.device(device)
    except RuntimeError as error:
        raise ConfigError(f"{name} is {device!r}, not a device torch knows: {error}") from None
    if parsed.type != "cuda":
        return parsed
    cpus = ", ".join(["'cpu'"] * workers)
    if not torch.cuda.is_available():
        has = (
            "is built without CUDA"
            if torch.version.cuda is None
            else f"is built for CUDA {torch.version.cuda} but sees no CUDA device"
        )
        raise ConfigError(
            f"{name} is {device!r}, but this torch build ({torch.__version__}) {has}; "
            f"run on CPU with devices=[{cpus}], or install a CUDA build of torch on a "
            "machine with a GPU"
        )
    count = torch.cuda.device_count()
    if parsed.index is not None and parsed.index >= count:
        raise ConfigError(
            f"{name} is {device!r}, but this machine has {count} CUDA device"
            f"{'s' if count != 1 else ''} (cuda:0 to cuda:{count - 1}); use one of those, "
            "or set CUDA_VISIBLE_DEVICES to show more"
        )
    return parsed
