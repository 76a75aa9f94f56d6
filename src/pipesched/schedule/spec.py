"""A schedule named or given: what ``Pipeline(schedule=...)`` and the planner accept."""

from __future__ import annotations

import functools

from pipesched.errors import ConfigError, ConfigTypeError, ScheduleError
from pipesched.schedule.builders import get_schedule, stages_per_worker
from pipesched.schedule.schedule import Schedule

__all__ = ["ScheduleSpec", "check_spec", "schedule_for", "spec_name", "spec_placement"]

ScheduleSpec = str | Schedule
"""A built-in schedule's name (built for every micro-batch count), or one Schedule."""


def check_spec(spec: object, chunks: int | None = None) -> ScheduleSpec:
    """Checks a schedule argument; a Schedule is validated here, before anything runs.

    Args:
        spec: the argument.
        chunks: the micro-batches per step a given Schedule must be written for.

    Raises:
        ConfigTypeError: neither a name nor a Schedule.
        ConfigError: an unknown name, or a Schedule for another count than ``chunks``.
        ScheduleError: the Schedule cannot run (an action missing, duplicated,
            on the wrong worker, or an order that deadlocks).
    """
    if isinstance(spec, Schedule):
        if chunks is not None and spec.num_microbatches != chunks:
            raise ConfigError(
                f"the schedule {spec.name!r} runs {spec.num_microbatches} micro-batches, but "
                f"chunks={chunks}; pass chunks={spec.num_microbatches} (a Schedule is one "
                "table, for one number of micro-batches)"
            )
        return spec.validate()
    if not isinstance(spec, str):
        raise ConfigTypeError(
            f"schedule must be a schedule's name ('1f1b', ...) or a pipesched.Schedule "
            f"(e.g. Schedule.from_csv(text)), got {type(spec).__name__} {spec!r}"
        )
    stages_per_worker(spec)  # checks the name
    return spec


def spec_name(spec: ScheduleSpec) -> str:
    """The schedule's name (a given Schedule's own ``name``)."""
    return spec.name if isinstance(spec, Schedule) else spec


def spec_placement(spec: ScheduleSpec, num_workers: int) -> tuple[int, ...]:
    """The worker of each stage: a given Schedule's, or the named schedule's on ``num_workers``."""
    if isinstance(spec, Schedule):
        return spec.placement
    return get_schedule(spec, num_workers * stages_per_worker(spec), 1).placement


def schedule_for(spec: ScheduleSpec, num_stages: int, num_microbatches: int) -> Schedule:
    """The validated schedule of ``num_microbatches`` micro-batches over ``num_stages`` stages.

    Raises:
        ConfigError: a given Schedule was written for another number of stages
            or micro-batches (a Schedule is one table; only named schedules
            are built for any count).
    """
    if not isinstance(spec, Schedule):
        return _built(spec, num_stages, num_microbatches)
    if spec.num_stages != num_stages:
        raise ScheduleError(
            f"the schedule {spec.name!r} has {spec.num_stages} stages but the model is cut "
            f"into {num_stages}; give a balance of {spec.num_stages} stages"
        )
    if spec.num_microbatches != num_microbatches:
        raise ConfigError(
            f"the schedule {spec.name!r} runs {spec.num_microbatches} micro-batches but this "
            f"step has {num_microbatches}; pass batches of at least chunks="
            f"{spec.num_microbatches} rows (or that many micro-batches), or a schedule "
            "written for this count"
        )
    return spec


@functools.lru_cache(maxsize=64)
def _built(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    return get_schedule(name, num_stages, num_microbatches).validate()
