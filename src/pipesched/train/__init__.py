"""Training around a pipeline: accumulation windows, loss scaling, clipping, checkpoints."""

from pipesched.train.accumulator import GradientAccumulator, StepResult
from pipesched.train.batch_size import BatchChoice, BatchPlan, plan_accumulation
from pipesched.train.export import export_model, import_model, load_model, model_state

__all__ = [
    "BatchChoice",
    "BatchPlan",
    "GradientAccumulator",
    "StepResult",
    "export_model",
    "import_model",
    "load_model",
    "model_state",
    "plan_accumulation",
]
