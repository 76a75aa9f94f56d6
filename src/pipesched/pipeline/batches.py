"""The micro-batches of one step: cut from one batch, or given one by one with their own shapes.

Why a list of micro-batches: packed or variable-length data (sequence
lengths 37, 512 and 129 in one step) cannot be one tensor without padding
every micro-batch to the longest. torch's pipelining requires static shapes
and Megatron-LM sizes its buffers by the longest micro-batch; here each
micro-batch is run as given, and only its weight in the loss needs its size:
``rows_i / sum(rows)`` for a mean loss (the loss of the concatenated batch,
where shapes allow concatenating), or ``1 / num_items`` for a summed one.

Index letters as in the rest of pipesched: ``i`` a micro-batch, ``m`` their count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pipesched.errors import ConfigError, ConfigTypeError
from pipesched.pipeline.arguments import check_inputs, check_target
from pipesched.runtime.stage.microbatch import scatter
from pipesched.runtime.stage.tree import tensors

__all__ = ["StepBatches", "step_batches"]


@dataclass(frozen=True)
class StepBatches:
    """The micro-batches one step runs.

    Attributes:
        inputs: stage 0's input of each micro-batch (``m`` of them).
        targets: the loss target of each micro-batch, or None.
        rows: each micro-batch's sample count (its inputs' dim 0).
    """

    inputs: list[Any]
    targets: list[Any] | None
    rows: list[int]

    @property
    def total_rows(self) -> int:
        """Samples in the step: the sum of :attr:`rows`."""
        return sum(self.rows)

    def items(self, num_items: int | float | torch.Tensor | None, *, positive: bool) -> float:
        """The step's item count: ``num_items``, or its rows when None.

        Args:
            num_items: the user's count (a number or a one-element tensor).
            positive: the count divides a loss (``step``): it must be > 0;
                else (``accumulate``, a window's share) 0 is allowed.

        Raises:
            ConfigError: a count below what ``positive`` allows.
        """
        if num_items is None:
            return float(self.total_rows)
        count = float(num_items.item() if isinstance(num_items, torch.Tensor) else num_items)
        if positive and not count > 0:
            raise ConfigError(
                f"num_items must be > 0, got {num_items!r}; it is the number of items "
                "(e.g. non-padding tokens) the summed loss is divided by"
            )
        if not count >= 0:
            raise ConfigError(f"num_items must be >= 0, got {num_items!r}")
        return count


def step_batches(
    inputs: Any, target: Any, microbatches: Any, targets: Any, *, chunks: int
) -> StepBatches:
    """The micro-batches of a step given ``inputs`` (cut into ``chunks``) or ``microbatches``.

    Args:
        inputs, target: one batch and its target, cut along dim 0.
        microbatches: instead of ``inputs``, a list of micro-batches, each
            what one micro-batch of ``inputs`` would be (a tensor, tuple or
            dict); their shapes may differ (rows, sequence length, ...).
        targets: with ``microbatches``: None or a list of their targets.
        chunks: micro-batches to cut ``inputs`` into (unused with ``microbatches``).

    Raises:
        ConfigError: both or neither of ``inputs`` and ``microbatches``; a
            ``target`` with ``microbatches`` or ``targets`` with ``inputs``;
            an empty list; a micro-batch without rows, requiring grad, or
            whose target has another number of rows.
        ConfigTypeError: ``microbatches`` or ``targets`` is not a list.
    """
    if (inputs is None) == (microbatches is None):
        seen = "both were given" if inputs is not None else "neither was given"
        raise ConfigError(
            f"pass exactly one of inputs and microbatches ({seen}): inputs= is one batch "
            "that pipesched cuts into `chunks` micro-batches; microbatches=[...] is the "
            "list of micro-batches themselves, each with its own shape"
        )
    if microbatches is None:
        if targets is not None:
            raise ConfigError(
                "targets= goes with microbatches=[...] (one target per micro-batch); with "
                "inputs= pass the batch's target as target= (it is cut like inputs)"
            )
        count = check_inputs(inputs, "inputs")
        check_target(target, "target")
        other = {t.shape[0] for t in tensors(target) if t.ndim >= 1} - {count}
        if other:
            raise ConfigError(
                f"target has {max(other)} rows (dim 0) but inputs has {count}: the "
                "target is cut into micro-batches with the inputs, so it needs one row per "
                "input row, in the same order (pass a value shared by every row as a 0-dim "
                "tensor or a non-tensor)"
            )
        micro = scatter((inputs, target), chunks)
        sizes = [_rows(x) for x, _ in micro]
        return StepBatches(
            [x for x, _ in micro], None if target is None else [t for _, t in micro], sizes
        )
    if target is not None:
        raise ConfigError(
            "target= goes with inputs=; with microbatches=[...] pass targets=[...], one "
            "target per micro-batch (in the same order)"
        )
    given = _as_list("microbatches", microbatches, "the micro-batches themselves")
    if not given:
        raise ConfigError(
            "microbatches is an empty list: a step needs at least one micro-batch; skip "
            "the step instead"
        )
    target_list = None
    if targets is not None:
        target_list = _as_list("targets", targets, "one target per micro-batch")
        if len(target_list) != len(given):
            raise ConfigError(
                f"targets has {len(target_list)} entries but microbatches has {len(given)}: "
                "pass one target per micro-batch, in the same order"
            )
    rows = [check_inputs(x, f"microbatches[{i}]") for i, x in enumerate(given)]
    for i, (x, r) in enumerate(zip(given, rows, strict=True)):
        if r == 0:
            raise ConfigError(
                f"microbatches[{i}] has 0 rows (dim 0 of {_first_shape(x)}): an empty "
                "micro-batch has no mean loss and nothing to run; drop it from the list"
            )
        if target_list is not None:
            _check_target_rows(i, target_list[i], r)
            check_target(target_list[i], f"targets[{i}]")
    return StepBatches(given, target_list, rows)


def _as_list(name: str, value: Any, meaning: str) -> list[Any]:
    if isinstance(value, Sequence) and not isinstance(value, str | bytes) and not _is_record(value):
        return list(value)
    raise ConfigTypeError(
        f"{name} must be a list ({meaning}), got {type(value).__name__}; to have pipesched "
        "cut one batch into `chunks` micro-batches, pass it as inputs= (and target=) instead"
    )


def _is_record(value: Any) -> bool:
    """A tensor, dict or namedtuple: one micro-batch, not a list of them."""
    return isinstance(value, Mapping) or hasattr(value, "_fields") or hasattr(value, "shape")


def _check_target_rows(i: int, target: Any, rows: int) -> None:
    seen = {t.shape[0] for t in tensors(target) if t.ndim >= 1}
    if seen - {rows}:
        raise ConfigError(
            f"targets[{i}] has {max(seen - {rows})} rows (dim 0) but microbatches[{i}] has "
            f"{rows}: a micro-batch's target must have as many rows as its input, in the "
            "same order (pass a value shared by every row as a 0-dim tensor or a non-tensor)"
        )


def _rows(value: Any) -> int:
    return next(t.shape[0] for t in tensors(value) if t.ndim > 0)


def _first_shape(value: Any) -> tuple[int, ...]:
    return next((tuple(t.shape) for t in tensors(value) if t.ndim > 0), ())
