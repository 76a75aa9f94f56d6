"""The planner: schedule x cut x checkpoint mode (x chunks) chosen from measured costs and a budget.

``Pipeline(model, chunks, schedule="auto", example_inputs=(x,))`` and the
``pipesched plan`` command run it; :func:`plan_model` and :func:`plan_layers`
are the same search as functions, returning a :class:`Planning` that prints
every candidate compared, with predicted step time and memory, and the pick.
"""

from __future__ import annotations

from pipesched.planning.candidate import Candidate, LayerCost, Planning
from pipesched.planning.measure import layer_costs, plan_auto, plan_model
from pipesched.planning.plan import Plan, resolve_plan
from pipesched.planning.search import peak_bytes, plan_layers

__all__ = [
    "Candidate",
    "LayerCost",
    "Plan",
    "Planning",
    "layer_costs",
    "peak_bytes",
    "plan_auto",
    "plan_layers",
    "plan_model",
    "resolve_plan",
]
