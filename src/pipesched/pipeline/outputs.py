"""The output of ``pipe(x)``: the micro-batches' outputs joined as the plain model's would be."""

from __future__ import annotations

from typing import Any

from torch import nn

from pipesched.partition import TracedStage
from pipesched.partition.call import Call
from pipesched.partition.per_sample import leaf_paths, per_sample_flags
from pipesched.pipeline.checks.coupled_outputs import coupled_flags, masked_weights
from pipesched.pipeline.checks.masked_means import warn_uncounted
from pipesched.runtime.stage.microbatch import join_outputs

__all__ = ["join_step_outputs"]


def join_step_outputs(
    batch: Any,
    outputs: dict[int, Any],
    rows: list[int],
    last: nn.Module,
    micro: list[Any] | None = None,
) -> Any:
    """The micro-batches' ``outputs`` joined into one output of the batch ``batch``.

    Tensors are concatenated along dim 0; a 0-dim floating-point tensor (a loss
    the model computes) is the rows-weighted mean of the micro-batches', or
    their sum under Hugging Face's ``num_items_in_batch`` contract (each is its
    micro-batch's share of the batch's). ``last``: the last stage, whose export
    says which outputs follow the batch; given the ``micro``-batches' inputs, a
    loss's mean over the targets it keeps weighs them by their counts of those.
    """
    summed = isinstance(batch, Call) and batch.kwargs.get("num_items_in_batch") is not None
    values = [outputs[i] for i in range(len(rows))]
    fixed: list[str] = []
    coupled: list[str] = []
    counts: dict[str, list[float]] = {}
    unweighed: list[str] = []
    if isinstance(last, TracedStage):  # the export says which outputs follow the batch
        paths = leaf_paths(values[0])
        if len(paths) == len(flags := per_sample_flags(last.traced)):
            fixed = [path for path, flag in zip(paths, flags, strict=True) if not flag]
        if len(paths) == len(mixed := coupled_flags(last.traced, summed)):
            coupled = [path for path, flag in zip(paths, mixed, strict=True) if flag]
            if micro is not None and not summed:  # a loss's mean over the targets it keeps
                found = masked_weights(last.traced, micro, rows)
                for i, weighing in found.items():
                    if weighing.weights is None:  # terms kept in other shares: nothing rebuilds it
                        unweighed.append(paths[i])
                    else:
                        counts[paths[i]] = weighing.weights
                uncounted = [paths[i] for i, w in found.items() if w.uncounted]
                warn_uncounted(last.traced, uncounted, rows, "pipe(x)")
    scalars = "sum" if summed else "mean"
    return join_outputs(values, rows, scalars, fixed, coupled, counts, unweighed)
