"""pipesched: pipeline-parallel micro-batch scheduling for PyTorch."""

# Only torch-free names are imported here: `import pipesched.schedule` must not
# import torch (tests check it). Names that need torch will load lazily.
from pipesched.errors import ConfigError, PipeschedError, ScheduleError
from pipesched.schedule import Action, Costs, Schedule, Timeline, get_schedule

__all__ = [
    "Action",
    "ConfigError",
    "Costs",
    "PipeschedError",
    "Schedule",
    "ScheduleError",
    "Timeline",
    "get_schedule",
]
__version__ = "0.1.0"
