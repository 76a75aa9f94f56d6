"""Cutting a model into pipeline stages: the stage graph, cost profiling, balancing, splitting."""

from pipesched.partition.balance import min_max_counts, search_schedule
from pipesched.partition.model_cut import (
    BALANCE_MODES,
    ModelCut,
    plan_partition,
    simulate_partition,
)
from pipesched.partition.profile import NodeCost, measure_sequential, measure_traced
from pipesched.partition.report import Partition, StagePlan
from pipesched.partition.sequential import balance_by_params, check_balance, split_sequential
from pipesched.partition.split import split_traced
from pipesched.partition.stage_graph import (
    Layer,
    layer_graph,
    layers,
    sequential_graph,
    traced_graph,
)
from pipesched.partition.trace import TracedModel, trace_model
from pipesched.partition.traced_stage import TracedStage

__all__ = [
    "BALANCE_MODES",
    "Layer",
    "ModelCut",
    "NodeCost",
    "Partition",
    "StagePlan",
    "TracedModel",
    "TracedStage",
    "balance_by_params",
    "check_balance",
    "layer_graph",
    "layers",
    "measure_sequential",
    "measure_traced",
    "min_max_counts",
    "plan_partition",
    "search_schedule",
    "sequential_graph",
    "simulate_partition",
    "split_sequential",
    "split_traced",
    "trace_model",
    "traced_graph",
]
