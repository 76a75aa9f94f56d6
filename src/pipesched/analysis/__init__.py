"""Reasoning about schedules without torch: synthesis, lower bounds, prediction, comparison."""

from pipesched.analysis.bound import lower_bound
from pipesched.analysis.compare import Comparison, compare
from pipesched.analysis.synthesize import synthesize

__all__ = ["Comparison", "compare", "lower_bound", "synthesize"]
