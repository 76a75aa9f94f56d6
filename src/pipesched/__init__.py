"""pipesched: pipeline-parallel micro-batch scheduling for PyTorch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The schedule layer is imported eagerly: it is pure Python. Everything that
# needs torch loads on first use, so `import pipesched.schedule` (and the CLI's
# schedule commands) never import torch; a test checks it.
from pipesched.errors import (
    BatchCoupledWarning,
    CheckpointError,
    ConfigError,
    ConfigTypeError,
    GradientBackupError,
    MicroBatchNormWarning,
    MissingDependencyError,
    NativeKernelWarning,
    PartitionError,
    PipeschedError,
    RemoteError,
    ScheduleError,
    TorchInternalsWarning,
)
from pipesched.runtime.compat.torch_floor import check_torch_version, installed_torch_version
from pipesched.schedule import Action, Costs, Schedule, Timeline, get_schedule

check_torch_version(installed_torch_version())  # without importing torch

if TYPE_CHECKING:
    from pipesched.partition.materialize import initialize
    from pipesched.pipeline.facade import Pipeline
    from pipesched.runtime.mesh import init_mesh
    from pipesched.runtime.stage.batchnorm import DeferredBatchNorm
    from pipesched.runtime.stage.recompute import is_recomputing
    from pipesched.train import GradientAccumulator

__all__ = [
    "Action",
    "BatchCoupledWarning",
    "CheckpointError",
    "ConfigError",
    "ConfigTypeError",
    "Costs",
    "DeferredBatchNorm",
    "GradientAccumulator",
    "GradientBackupError",
    "MicroBatchNormWarning",
    "MissingDependencyError",
    "NativeKernelWarning",
    "PartitionError",
    "Pipeline",
    "PipeschedError",
    "RemoteError",
    "Schedule",
    "ScheduleError",
    "Timeline",
    "TorchInternalsWarning",
    "get_schedule",
    "init_mesh",
    "initialize",
    "is_recomputing",
]
__version__ = "0.1.0"

_LAZY = {
    "Pipeline": "pipesched.pipeline.facade",
    "DeferredBatchNorm": "pipesched.runtime.stage.batchnorm",
    "is_recomputing": "pipesched.runtime.stage.recompute",
    "GradientAccumulator": "pipesched.train",
    "initialize": "pipesched.partition.materialize",
    "init_mesh": "pipesched.runtime.mesh",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pipesched' has no attribute {name!r}")
