"""Argument checks shared by the schedule builders and the analysis over them."""

from __future__ import annotations

from pipesched.errors import ConfigError, ConfigTypeError
from pipesched.schedule.limits import MAX_ACTIONS, check_size, limit_text

__all__ = ["check_count", "check_padded_work", "check_schedule_size", "check_virtual_stages"]


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


def check_v_stages(schedule: str, num_stages: int) -> int:
    """Workers of a V schedule (two stages each) for ``num_stages``.

    Raises:
        ConfigError: ``num_stages`` is odd.
    """
    if num_stages % 2:
        raise ConfigError(
            f"{schedule} runs two stages per worker, so num_stages must be even, got "
            f"{num_stages}; use num_stages={num_stages - 1 or 2} or {num_stages + 1}"
        )
    return num_stages // 2


def check_schedule_size(schedule: str, num_stages: int, num_microbatches: int, kinds: int) -> None:
    """A ConfigError, before anything is built, when the schedule would exceed MAX_ACTIONS.

    Args:
        schedule: the builder's name, leading the message.
        num_stages: model stages.
        num_microbatches: micro-batches per step.
        kinds: 2 (F, B) or 3 (F, B, W: the zero-bubble schedules).
    """
    check_size(num_stages, num_microbatches, kinds, error=ConfigError, prefix=f"{schedule}: ")


def check_padded_work(schedule: str, num_stages: int, num_microbatches: int, built: int) -> None:
    """A ConfigError when an order built for ``built`` micro-batches exceeds MAX_ACTIONS.

    Some builders make their order for at least ``built`` micro-batches and
    then remove those past ``num_microbatches``; with few micro-batches on
    many stages that intermediate order is larger than the schedule kept.
    """
    work = 3 * num_stages * built
    if num_microbatches < built and work > MAX_ACTIONS:
        raise ConfigError(
            f"{schedule}: the order for {num_stages} stages is built for {built} micro-batches "
            f"(those past {num_microbatches} are then removed): {built} micro-batches x "
            f"{num_stages} stages x 3 kinds = {work} actions exceeds {limit_text()}; use fewer "
            "stages or another schedule"
        )
