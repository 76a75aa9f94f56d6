"""The built-in schedules, one module each, and :func:`get_schedule` to pick one by name."""

from __future__ import annotations

from collections.abc import Callable

from pipesched.errors import ConfigError, ConfigTypeError
from pipesched.schedule.builders.argument_checks import (
    check_count,
    check_padded_work,
    check_schedule_size,
)
from pipesched.schedule.builders.dualpipe_v import dualpipe_v
from pipesched.schedule.builders.gpipe import gpipe
from pipesched.schedule.builders.interleaved import interleaved_1f1b
from pipesched.schedule.builders.one_f_one_b import one_f_one_b
from pipesched.schedule.builders.v_memory import v_half, v_min
from pipesched.schedule.builders.zb_h2 import zb_h2
from pipesched.schedule.builders.zero_bubble import check_zb_v_work, zb_h1, zb_v
from pipesched.schedule.gc_pause import paused_gc
from pipesched.schedule.schedule import Schedule

__all__ = [
    "SCHEDULES",
    "check_size_of",
    "dualpipe_v",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "stages_per_worker",
    "v_half",
    "v_min",
    "zb_h1",
    "zb_h2",
    "zb_v",
]

SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
    "zb-v": zb_v,
    "zb-h2": zb_h2,
    "dualpipev": dualpipe_v,
    "v-half": v_half,
    "v-min": v_min,
}
"""Builder of each built-in schedule, by name."""

_FIXED_VIRTUAL_STAGES = {
    "gpipe": 1,
    "1f1b": 1,
    "zb-h1": 1,
    "zb-v": 2,
    "zb-h2": 1,
    "dualpipev": 2,
    "v-half": 2,
    "v-min": 2,
}
_KINDS = {
    "gpipe": 2,
    "1f1b": 2,
    "interleaved-1f1b": 2,
    "zb-h1": 3,
    "zb-v": 3,
    "zb-h2": 3,
    "dualpipev": 3,
    "v-half": 3,
    "v-min": 3,
}


def _canonical(name: object) -> str:
    if not isinstance(name, str):
        raise ConfigTypeError(f"schedule name must be a string, got {name!r}; valid: {_valid()}")
    key = name.strip().lower().replace("_", "-")
    if key not in SCHEDULES:
        raise ConfigError(f"unknown schedule {name!r}; valid names: {_valid()}")
    return key


def _valid() -> str:
    return ", ".join(repr(n) for n in SCHEDULES)


def stages_per_worker(name: str, **options: object) -> int:
    """How many stages each worker runs in schedule ``name`` with these options.

    Example:
        >>> [stages_per_worker(name) for name in ("interleaved-1f1b", "zb-v", "1f1b")]
        [2, 2, 1]
    """
    key = _canonical(name)
    if key in _FIXED_VIRTUAL_STAGES:
        return _FIXED_VIRTUAL_STAGES[key]
    return check_count("virtual_stages", options.get("virtual_stages", 2))


def check_size_of(name: str, num_stages: int, num_microbatches: int) -> None:
    """Checks, building nothing, that ``get_schedule(name, ...)`` stays within MAX_ACTIONS.

    Raises:
        ConfigError: an unknown name, or more actions than
            :data:`~pipesched.schedule.limits.MAX_ACTIONS` (the message states
            the count and the limit).

    Example:
        >>> check_size_of("zb-v", 8, 1000)  # 8 stages x 1000 micro-batches x 3 = 24000 actions
        >>> check_size_of("zb-v", 8, 10**6)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        pipesched.errors.ConfigError: zb-v: a schedule of 1000000 micro-batches x 8 stages ...
    """
    key = _canonical(name)
    check_schedule_size(key, num_stages, num_microbatches, _KINDS[key])
    if key == "zb-v":
        check_zb_v_work(num_stages, num_microbatches)
    if key == "dualpipev" and num_stages % 2 == 0:
        check_padded_work(key, num_stages, num_microbatches, num_stages)


def get_schedule(name: str, num_stages: int, num_microbatches: int, **options: object) -> Schedule:
    """Builds the built-in schedule ``name`` for ``num_stages`` model stages.

    Args:
        name: one of ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"``,
            ``"zb-h1"``, ``"zb-v"``, ``"zb-h2"``, ``"dualpipev"``,
            ``"v-half"``, ``"v-min"`` (case and ``_`` vs ``-`` do not matter).
        num_stages: model stages. Schedules with several stages per worker
            run on ``num_stages // virtual_stages`` workers.
        num_microbatches: micro-batches per step.
        **options: ``virtual_stages`` (stages per worker): default 2 for
            interleaved-1f1b; 2 for the V schedules (zb-v, dualpipev, v-half,
            v-min) and 1 for the others, where it may be given only with
            that value.

    Raises:
        ConfigError: unknown name or option, or counts the schedule cannot run.

    Example:
        >>> s = get_schedule("interleaved-1f1b", 8, 4)
        >>> s.num_workers, s.virtual_stages
        (4, 2)
    """
    key = _canonical(name)
    unknown = sorted(set(options) - {"virtual_stages"})
    if unknown:
        raise ConfigTypeError(
            f"get_schedule({key!r}) got unknown options {unknown}; the only option is "
            "virtual_stages (stages per worker)"
        )
    if key in _FIXED_VIRTUAL_STAGES and "virtual_stages" in options:
        fixed = _FIXED_VIRTUAL_STAGES[key]
        if options["virtual_stages"] != fixed:
            raise ConfigError(
                f"{key} runs {fixed} stage{'s' if fixed > 1 else ''} per worker, got "
                f"virtual_stages={options['virtual_stages']!r}; leave virtual_stages out, "
                "or use 'interleaved-1f1b' for another number of stages per worker"
            )
        options = {}
    with paused_gc():
        return SCHEDULES[key](num_stages, num_microbatches, **options)
