"""Pipeline.predict: a step simulated with the pipeline's own costs, as the run spends them.

A step's time is more than its passes. Measured from the last training
step's timeline (every rank's, gathered, on a mesh), the model of a step
(:class:`~pipesched.analysis.prediction.StepModel`) counts:

- passes: each stage's mean F, B and W (the loss is inside the last stage's
  F and B), apart for checkpointed and kept micro-batches;
- recomputation: what a checkpointed micro-batch's backward costs more
  (its forward, run again), by the same split;
- overhead: per worker, the median gap before an action whose input was
  already there (taking the input, seeding, bookkeeping);
- transfers: the mean time from a producer's end to the start of its
  consumer on another worker, over consumers that waited for it (negative
  ones, where a producer was preempted after sending, count as 0);
- variability: how like actions' durations spread around their mean. The
  step returned is the median (by makespan) of 31 played with durations
  drawn from the measured spread, seeded: a step whose passes vary waits
  for its slowest producers, and takes longer than its means say;
- outside: ``pipe.step``'s wall time minus the actions' makespan (the
  micro-batches cut, the transaction's snapshot and commit, threads started;
  the slowest rank's on a mesh).

Before any training step only the partition's profiled (or, for a model on
the meta device, estimated) pass times are known, and the prediction says
so in its breakdown's source: it leaves out overhead, transfers and outside.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipesched.analysis.prediction import StepModel, predict
from pipesched.errors import ConfigError, ConfigTypeError
from pipesched.runtime.stage.recompute import stage_stops
from pipesched.schedule import BACKWARD, Timeline

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
        model = StepModel.measure(
            timeline,
            stage_stops(pipe.checkpoint, pipe.num_stages, m),
            outside=max(0.0, _slowest_wall(pipe) - timeline.makespan),
            source=f"the last step's {len(timeline.events)} measured actions",
        )
    else:
        m, model = pipe.chunks, _from_partition(pipe)
    k = m if num_microbatches is None else num_microbatches
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
