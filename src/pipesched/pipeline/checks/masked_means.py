"""Means over the targets a loss keeps: counted per micro-batch from its inputs alone.

A cross-entropy's default ``reduction="mean"`` divides by the number of targets
that are not ``ignore_index`` (with ``weight=``, by their classes' weights): with
padding, a micro-batch's share of the batch's mean is its count over the batch's,
not its rows over the batch's rows. The target is computed from the inputs (a
Hugging Face causal LM shifts its labels inside the model), so the operations
between the inputs and the target are run again on each micro-batch's inputs:
a few index operations, no layer. Targets the model computes from its
parameters (pseudo-labels) cannot be counted before the run; they are taken to
skip none, a mean over the rows.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from pipesched.errors import BatchCoupledWarning, warn_user
from pipesched.partition.trace import TracedModel
from pipesched.runtime.compat.internals import OpOverload, op_schema

__all__ = [
    "ItemCounter", "item_counter", "masks_targets", "proportional", "warn_masked_means", "warned",
]  # fmt: skip

_LOSSES = frozenset(
    {
        "cross_entropy_loss", "nll_loss", "nll_loss2d", "nll_loss_nd", "nll_loss_forward",
        "nll_loss2d_forward",
    }
)  # fmt: skip
"""Losses whose mean divides by the count (or weight) of the targets they keep."""


@dataclass(frozen=True, eq=False)
class ItemCounter:
    """How many targets a loss's mean divides by, computed from a call's inputs.

    Args:
        nodes: the operations from the inputs to the target (and class weights),
            in the graph's order, with the buffers and constants they read.
        target: the loss's target.
        weight: its class weights, or None.
        ignore_index: the target value the loss skips.
    """

    nodes: tuple[fx.Node, ...]
    target: fx.Node
    weight: fx.Node | None
    ignore_index: int

    def count(self, traced: TracedModel, leaves: Sequence[Any]) -> float:
        """The loss's divisor on the call whose user inputs are ``leaves``.

        NaN where a buffer it reads is not on this process (a meta build on a mesh
        materializes only the rank's own stages): a rank without the loss's stage.
        """
        env: dict[fx.Node, Any] = dict(zip(traced.inputs, leaves, strict=False))
        with torch.no_grad():
            for node in self.nodes:
                if node in env:
                    continue
                ref = traced.state.get(node)
                if ref is not None:
                    env[node] = (
                        traced.model.get_buffer(ref.name)
                        if ref.kind == "buffer"
                        else traced.constant(ref.name)
                    )
                    if env[node].is_meta:
                        return math.nan
                    continue
                args = fx.node.map_arg(node.args, env.__getitem__)
                kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
                env[node] = node.target(*args, **kwargs)  # type: ignore[operator]
            target = env[self.target]
            kept = target != self.ignore_index
            if self.weight is None:
                return float(kept.sum())
            weight = env[self.weight].to(target.device)
            return float((weight[target.masked_fill(~kept, 0)] * kept).sum())


def masks_targets(node: fx.Node, given: dict[str, Any]) -> bool:
    """Whether loss ``node`` (``given``: its arguments by name) is a mean over the class
    targets it keeps, not over its rows (class probabilities as targets skip none)."""
    op = node.target
    if not isinstance(op, OpOverload) or op_schema(op).name.split("::")[-1] not in _LOSSES:
        return False
    target = given.get("target")
    value = target.meta.get("val") if isinstance(target, fx.Node) else None
    return given.get("reduction") == 1 and not (
        isinstance(value, torch.Tensor) and value.is_floating_point()
    )


def item_counter(traced: TracedModel, node: fx.Node, given: dict[str, Any]) -> ItemCounter | None:
    """The counter of loss ``node``'s mean (one :func:`masks_targets` holds for), or None
    where its target cannot be computed from the inputs alone (it reads a parameter,
    or draws random numbers)."""
    target, weight = given.get("target"), given.get("weight")
    if not isinstance(target, fx.Node) or not (weight is None or isinstance(weight, fx.Node)):
        return None
    needed: set[fx.Node] = set()
    todo = [target] if weight is None else [target, weight]
    while todo:
        n = todo.pop()
        if n in needed:
            continue
        needed.add(n)
        ref = traced.state.get(n)
        if n in traced.inputs or (ref is not None and ref.kind != "parameter"):
            continue
        if ref is not None or n.op != "call_function":
            return None
        if isinstance(n.target, OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags:
            return None
        todo.extend(n.all_input_nodes)
    order = [n for n in traced.state if n in needed] + [n for n in traced.ops if n in needed]
    ignore = given.get("ignore_index", -100)
    return ItemCounter(tuple(order), target, weight, int(ignore))


def proportional(counts: Sequence[float], rows: Sequence[int]) -> bool:
    """Whether each micro-batch's count is its rows' share of the batch's: rows weigh right."""
    total, everyone = sum(counts), sum(rows)
    return all(
        math.isclose(c * everyone, total * r, rel_tol=1e-9)
        for c, r in zip(counts, rows, strict=True)
    )


_warned: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_lock = threading.Lock()


def warned(pipe: nn.Module) -> bool:
    """Whether ``pipe`` has told its masked means already (then nothing need be counted)."""
    return pipe in _warned


def warn_masked_means(pipe: nn.Module, counts: dict[str, list[float]], rows: list[int]) -> None:
    """Warns once per ``pipe`` where an output's targets are not shared as its micro-batches' rows.

    ``counts``: per output path, each micro-batch's count of targets its loss keeps.
    """
    uneven = {p: c for p, c in counts.items() if not any(map(math.isnan, c))}
    uneven = {p: c for p, c in uneven.items() if not proportional(c, rows)}
    if not uneven:
        return
    with _lock:
        if pipe in _warned:
            return
        _warned.add(pipe)
    path, kept = next(iter(uneven.items()))
    shown = [int(c) if float(c).is_integer() else round(c, 4) for c in kept]
    warn_user(
        f"output{path} of the model is a mean over the targets its loss keeps (a "
        "cross-entropy's reduction='mean' skips ignore_index, -100 by default: padding; "
        "with weight=, it divides by the kept targets' class weights), and this step's "
        f"micro-batches keep {shown} of them for {rows} rows. A loss_fn returning it is "
        "taken as a mean over samples and weighed by rows, so the step's loss and gradients "
        f"are not the plain model's on the batch (a mean over all {sum(shown)}): the "
        "targets of a micro-batch that keeps fewer weigh more. Fix: pass "
        "num_items_in_batch=1 in the call and num_items=<the batch's target count> to the "
        "step, for a model that honours it (guide: 'A model that computes its own loss'), "
        "or compute the summed cross-entropy from the logits in loss_fn "
        "(reduction='sum') and pass num_items=. pipe(x) under autograd returns the plain "
        "model's mean. Shown once per Pipeline",
        BatchCoupledWarning,
    )
