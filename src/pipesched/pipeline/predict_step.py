"""Pipeline.predict: a step simulated with the pipeline's own costs, as the run spends them.

From the last training step's timeline (every rank's, on a mesh) the step's
model counts passes, recomputation, per-action overhead, transfers, the spread
of durations and the time outside the actions; before any step, only the
partition's pass times (docs/schedules.md, "Predicting a step", says more).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipesched.analysis.prediction import StepModel, predict
from pipesched.errors import ConfigError, ConfigTypeError
from pipesched.runtime.stage.recompute import stage_stops
from pipesched.schedule import BACKWARD, Schedule, Timeline

if TYPE_CHECKING:
    from pipesched.pipeline.facade import Pipeline

__all__ = ["predict_step"]


def predict_step(pipe: Pipeline, num_microbatches: int | None) -> Timeline:
    """:meth:`Pipeline.predict`: see the module.

    Raises:
        ConfigTypeError: ``num_microbatches`` is not an int.
        ConfigError: ``num_microbatches`` is below 1, or no training step ran
            and the partition has no pass times.
    """
    if num_microbatches is not None:
        if type(num_microbatches) is not int:
            raise ConfigTypeError(
                f"num_microbatches must be an int or None, got {type(num_microbatches).__name__}"
            )
        if num_microbatches < 1:
            raise ConfigError(f"num_microbatches must be at least 1, got {num_microbatches}")
    timeline = pipe.gather_timeline(everywhere=True)  # a collective on a mesh
    if timeline is not None and any(e.action.kind == BACKWARD for e in timeline.events):
        m = 1 + max(e.action.microbatch for e in timeline.events)
        ran = pipe.schedule_for(m)
        model = StepModel.measure(
            timeline,
            stage_stops(pipe.checkpoint, pipe.num_stages, m),
            outside=max(0.0, _slowest_wall(pipe) - timeline.makespan),
            source=f"the last step's {len(timeline.events)} measured actions",
            whole=ran.whole_backwards if pipe.engine.runtime.passes.whole_backward else frozenset(),
        )
    else:
        m, model = pipe.chunks, _from_partition(pipe)
    k = m if num_microbatches is None else num_microbatches
    fixed = pipe.schedule
    if isinstance(fixed, Schedule) and fixed.num_microbatches != k:
        raise ConfigError(
            f"predict(num_microbatches={k}): this pipeline runs the schedule {fixed.name!r} "
            f"given as a table of {fixed.num_microbatches} micro-batches, which predicts no "
            f"other count; call predict() for {fixed.num_microbatches}, or build the "
            "pipeline with a schedule name (schedule='1f1b'), which is made for any count"
        )
    return predict(pipe.schedule_for(k), model, stage_stops(pipe.checkpoint, pipe.num_stages, k))


def _from_partition(pipe: Pipeline) -> StepModel:
    partition = pipe.partition
    forward = [s.forward_time for s in partition.stages]
    backward = [s.backward_time for s in partition.stages]
    if any(t is None for t in forward + backward):
        raise ConfigError(
            "predict() before any training step needs the partition's pass times, and this "
            "pipeline was not profiled (its balance is 'params' or a list): run one pipe.step(...) "
            "first, or build it with balance='time' and example_inputs"
        )
    what = "estimated (meta-device model)" if partition.estimated else "profiled"
    schedule = pipe.schedule_for(pipe.chunks)
    return StepModel.from_stage_times(
        [float(t or 0.0) for t in forward],
        [float(t or 0.0) for t in backward],
        schedule.num_workers,
        split_backward=schedule.split_backward,
        source=f"the partition's {what} pass times, before any step: no overhead, "
        "transfers or time outside the actions",
    )


def _slowest_wall(pipe: Pipeline) -> float:
    """The last step's wall time, the slowest pp rank's on a mesh (a collective there)."""
    wall = pipe.last_step_seconds or 0.0
    if pipe.mesh is None:
        return wall
    import torch.distributed as dist

    walls: list[Any] = [None] * pipe.mesh.pp_size
    dist.all_gather_object(walls, wall, group=pipe.mesh.pp_group)
    return max(float(w) for w in walls)
