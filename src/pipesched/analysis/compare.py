"""The built-in schedules side by side on the same workers and the same model."""

from __future__ import annotations

from dataclasses import dataclass

from pipesched.errors import ConfigError
from pipesched.schedule.builders import SCHEDULES, check_size_of, get_schedule, stages_per_worker
from pipesched.schedule.builders.argument_checks import check_count
from pipesched.schedule.costs import Costs
from pipesched.schedule.schedule import Schedule
from pipesched.schedule.timeline import Timeline

__all__ = ["Comparison", "compare", "format_comparison"]


@dataclass(frozen=True)
class Comparison:
    """One schedule's simulated step, or why it cannot run this configuration."""

    name: str
    schedule: Schedule | None
    timeline: Timeline | None
    reason: str = ""

    @property
    def peak_memory(self) -> tuple[float, ...]:
        """Per worker, the peak activations it holds, in micro-batches of a whole worker's share.

        A schedule with ``v`` stages per worker keeps ``1/v`` of a worker's
        activations per stage and micro-batch.
        """
        if self.timeline is None or self.schedule is None:
            return ()
        v = self.schedule.virtual_stages
        peaks = []
        for w in range(self.schedule.num_workers):
            held: dict[float, int] = {}
            for s in self.schedule.stages_of(w):
                for t, _ in self.timeline.activations_over_time[s]:
                    held[t] = 0
            for s in self.schedule.stages_of(w):
                level = 0
                points = dict(self.timeline.activations_over_time[s])
                for t in sorted(held):
                    level = points.get(t, level)
                    held[t] += level
            peaks.append(max(held.values(), default=0) / v)
        return tuple(peaks)


def compare(
    num_workers: int,
    num_microbatches: int,
    costs: Costs | None = None,
    names: list[str] | None = None,
) -> list[Comparison]:
    """Simulates each schedule on ``num_workers`` workers for one and the same model.

    Args:
        num_workers: pipeline workers (devices). Single-stage schedules have
            one stage per worker; the others cut each worker's share of the
            model into ``v`` stages.
        num_microbatches: micro-batches per step.
        costs: F, B, W of one worker's share of the model on one micro-batch;
            a stage of a ``v``-stage schedule costs ``1/v`` of it. Unit costs
            when None.
        names: schedules to compare; all built-in ones when None.

    Raises:
        ConfigError: a count is not a positive integer, a name is unknown, or
            a schedule would exceed :data:`~pipesched.schedule.limits.MAX_ACTIONS`
            actions; checked before any schedule is built.

    Example:
        >>> rows = compare(4, 8)
        >>> [(r.name, round(r.timeline.bubble_fraction, 3)) for r in rows][:2]
        [('gpipe', 0.273), ('1f1b', 0.273)]
    """
    check_count("num_workers", num_workers)
    check_count("num_microbatches", num_microbatches)
    names = names or list(SCHEDULES)
    for name in names:  # every size first: refuse before building any
        check_size_of(name, num_workers * stages_per_worker(name), num_microbatches)
    costs = costs or Costs()
    rows = []
    for name in names:
        v = stages_per_worker(name)
        try:
            schedule = get_schedule(name, num_workers * v, num_microbatches)
        except ConfigError as error:
            rows.append(Comparison(name, None, None, str(error)))
            continue
        rows.append(Comparison(name, schedule, schedule.simulate(costs.scaled(1 / v))))
    return rows


def format_comparison(rows: list[Comparison]) -> str:
    """The comparison as a table: makespan, bubble, peak activations per stage and per worker."""
    header = (
        f"{'schedule':<17}{'stages':>7}{'makespan':>10}{'bubble':>8}  "
        "peak activations per stage  |  per worker (whole share)"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        if r.timeline is None or r.schedule is None:
            lines.append(f"{r.name:<17}{'':>7}{'n/a':>10}{'':>8}  {r.reason.split(';')[0]}")
            continue
        t = r.timeline
        stages = " ".join(str(n) for n in t.peak_activations)
        workers = " ".join(f"{x:g}" for x in r.peak_memory)
        lines.append(
            f"{r.name:<17}{r.schedule.num_stages:>7}{t.makespan:>10.4g}"
            f"{100 * t.bubble_fraction:>7.1f}%  {stages}  |  {workers}"
        )
    return "\n".join(lines)
