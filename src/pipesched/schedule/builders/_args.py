"""Argument checks shared by the schedule builders."""

from __future__ import annotations

from pipesched.errors import ConfigError, ConfigTypeError
from pipesched.schedule.limits import check_size

__all__ = ["check_count", "check_schedule_size", "check_virtual_stages"]


def check_count(name: str, value: object) -> int:
    """``value`` as a positive int, or a ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigTypeError(f"{name} must be a positive integer, got {value!r}")
    if value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def check_virtual_stages(schedule: str, num_stages: int, virtual_stages: object) -> int:
    """Checks ``virtual_stages`` (stages per worker) divides ``num_stages``; returns the workers."""
    v = check_count("virtual_stages", virtual_stages)
    if num_stages % v:
        lower = num_stages - num_stages % v
        options = f"{lower} or {lower + v}" if lower else f"{v}"
        raise ConfigError(
            f"{schedule}: num_stages={num_stages} is not divisible by virtual_stages={v}; "
            f"each worker runs {v} stages, so use num_stages={options}, "
            "or a virtual_stages that divides num_stages"
        )
    return num_stages // v


def check_schedule_size(schedule: str, num_stages: int, num_microbatches: int, kinds: int) -> None:
    """A ConfigError, before anything is built, when the schedule would exceed MAX_ACTIONS.

    Args:
        schedule: the builder's name, leading the message.
        num_stages: model stages.
        num_microbatches: micro-batches per step.
        kinds: 2 (F, B) or 3 (F, B, W: the zero-bubble schedules).
    """
    check_size(num_stages, num_microbatches, kinds, error=ConfigError, prefix=f"{schedule}: ")
