"""Training around a pipeline: accumulation windows, loss scaling, clipping, checkpoints."""

from pipesched.train.accumulator import GradientAccumulator, StepResult
from pipesched.train.batch_size import BatchChoice, BatchPlan, plan_accumulation

__all__ = ["BatchChoice", "BatchPlan", "GradientAccumulator", "StepResult", "plan_accumulation"]
