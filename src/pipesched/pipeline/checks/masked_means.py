"""Means over the targets a loss keeps: counted per micro-batch from its inputs alone.

A cross-entropy's default ``reduction="mean"`` divides by the number of targets
that are not ``ignore_index`` (with ``weight=``, by their classes' weights): with
padding, a micro-batch's share of the batch's mean is its count over the batch's,
not its rows over the batch's rows. The target is computed from the inputs (a
Hugging Face causal LM shifts its labels inside the model), so the operations
between the inputs and the target are run again on each micro-batch's inputs:
a few index operations, no layer. Indices the model computes (a teacher's
argmax) are never a negative ``ignore_index``: a mean over the rows. Other
targets computed from its parameters (pseudo-labels with padding kept) cannot
be counted before the run: weighed by rows, and told (:class:`Uncounted`).
"""

from __future__ import annotations

import math
import operator
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
    "ROWS", "ItemCounter", "Uncounted", "divisor_counter", "item_counter", "masks_targets",
    "proportional", "warn_masked_means", "warn_uncounted", "warned", "weights_of",
]  # fmt: skip

_LOSSES = frozenset(
    {
        "cross_entropy_loss", "nll_loss", "nll_loss2d", "nll_loss_nd", "nll_loss_forward",
        "nll_loss2d_forward",
    }
)  # fmt: skip
"""Losses whose mean divides by the count (or weight) of the targets they keep."""

_INDICES = frozenset({"argmax", "argmin", "argsort", "multinomial"})
"""Operations whose value is indices, never negative (and the second value of these:)."""
_INDICES_SECOND = frozenset({"topk", "sort", "max", "min", "kthvalue", "mode"})
_SHAPES = frozenset(
    {
        "view", "_unsafe_view", "reshape", "flatten", "clone", "contiguous", "slice", "select",
        "squeeze", "unsqueeze", "permute", "transpose", "t", "expand", "alias", "detach",
        "_to_copy", "to", "lift_fresh_copy",
    }
)  # fmt: skip
"""Operations that move or copy a tensor's values: indices stay non-negative."""

ROWS = "rows"
"""What a mean over the samples is weighed by: their rows (a counter's mean, by its counts)."""


@dataclass(frozen=True, eq=False)
class ItemCounter:
    """How many targets a loss's mean divides by, computed from a call's inputs.

    Args:
        nodes: the operations from the inputs to the target (and class weights),
            in the graph's order, with the buffers, constants and (for the class
            weights) parameters they read.
        target: the loss's target; or (``ignore_index`` None) the count itself,
            the divisor of a mean written by hand (``(loss * mask).sum() / mask.sum()``).
        weight: its class weights, or None.
        ignore_index: the target value the loss skips.
    """

    nodes: tuple[fx.Node, ...]
    target: fx.Node
    weight: fx.Node | None
    ignore_index: int | None

    def count(self, traced: TracedModel, leaves: Sequence[Any]) -> torch.Tensor:
        """The loss's divisor on the call whose user inputs are ``leaves``: a 0-dim tensor
        on the inputs' device (read them all at once: one sync).

        Computed where the inputs are (a ``.to(device)`` the trace recorded is not
        followed: a meta build traced on meta). NaN where a tensor it reads is not on
        this process (a meta build on a mesh materializes only the rank's own stages).
        """
        env: dict[fx.Node, Any] = dict(zip(traced.inputs, leaves, strict=False))
        here = next((v.device for v in leaves if isinstance(v, torch.Tensor)), None)
        unknown = torch.tensor(math.nan, device=here)
        with torch.no_grad():
            for node in self.nodes:
                if node in env:
                    continue
                ref = traced.state.get(node)
                if ref is not None:
                    value = _state(traced, ref.kind, ref.name)
                    if value.is_meta:
                        return unknown
                    env[node] = value if here is None else value.to(here)
                    continue
                args = fx.node.map_arg(node.args, env.__getitem__)
                kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
                kwargs = {k: v for k, v in kwargs.items() if k != "device"}
                env[node] = node.target(*args, **kwargs)  # type: ignore[operator]
            target: torch.Tensor = env[self.target]
            if target.is_meta:
                return unknown
            if self.ignore_index is None:  # the divisor itself
                return target.detach().to(torch.float64)
            kept = target != self.ignore_index
            if self.weight is None:
                return kept.sum()
            weight: torch.Tensor = env[self.weight].to(target.device)
            return (weight[target.masked_fill(~kept, 0)] * kept).sum()


@dataclass(frozen=True, eq=False)
class Uncounted:
    """A loss's mean over targets the model computes from its parameters (pseudo-labels
    that keep the labels' padding): how many a micro-batch keeps shows only in its run,
    so its value is weighed by rows and the weighing told (:func:`warn_uncounted`).

    Args:
        loss: the loss's node.
    """

    loss: fx.Node


def _state(traced: TracedModel, kind: str, name: str) -> torch.Tensor:
    if kind == "buffer":
        return traced.model.get_buffer(name)
    if kind == "parameter":
        return traced.model.get_parameter(name).detach()
    return traced.constant(name)


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


def item_counter(
    traced: TracedModel, node: fx.Node, given: dict[str, Any]
) -> ItemCounter | Uncounted | None:
    """The counter of loss ``node``'s mean (one :func:`masks_targets` holds for); None
    where it keeps every target (indices the model computes, a negative ``ignore_index``:
    a mean over the rows); :class:`Uncounted` where its target cannot be computed from
    the inputs alone (it reads a parameter: pseudo-labels; or draws random numbers).
    Class weights may be parameters."""
    target, weight = given.get("target"), given.get("weight")
    ignore_index = int(given.get("ignore_index", -100))
    if weight is None and ignore_index < 0 and _indices(target):
        return None
    if not isinstance(target, fx.Node) or not (weight is None or isinstance(weight, fx.Node)):
        return Uncounted(node)
    needed = _path(traced, target, parameters=False)
    weights = set() if weight is None else _path(traced, weight, parameters=True)
    if needed is None or weights is None:
        return Uncounted(node)
    needed |= weights
    order = [n for n in traced.state if n in needed] + [n for n in traced.ops if n in needed]
    return ItemCounter(tuple(order), target, weight, ignore_index)


def _indices(node: Any) -> bool:
    """Whether ``node``'s values are indices an operation computed (never negative)."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        if node.target is operator.getitem:
            source, k = node.args[0], node.args[1]
            second = isinstance(k, int) and k == 1
            return second and isinstance(source, fx.Node) and _op_name(source) in _INDICES_SECOND
        name = _op_name(node)
        if name in _INDICES:
            return True
        if name not in _SHAPES or not node.args:
            return False
        node = node.args[0]
    return False


def _op_name(node: fx.Node) -> str | None:
    op = node.target
    return op_schema(op).name.split("::")[-1] if isinstance(op, OpOverload) else None


def divisor_counter(traced: TracedModel, divisor: fx.Node) -> ItemCounter | None:
    """The counter of a mean written by hand, a sum over the batch divided by ``divisor``
    (a sum of what the inputs alone give, ``mask.sum()``); None where it reads more."""
    needed = _path(traced, divisor, parameters=False)
    if needed is None:
        return None
    order = [n for n in traced.state if n in needed] + [n for n in traced.ops if n in needed]
    return ItemCounter(tuple(order), divisor, None, None)


def _path(traced: TracedModel, start: fx.Node, *, parameters: bool) -> set[fx.Node] | None:
    """The nodes ``start`` is computed from, back to the inputs and the state it reads;
    None where that reads a parameter (unless ``parameters``) or draws."""
    needed: set[fx.Node] = set()
    todo = [start]
    while todo:
        n = todo.pop()
        if n in needed:
            continue
        needed.add(n)
        ref = traced.state.get(n)
        if n in traced.inputs or (ref is not None and (parameters or ref.kind != "parameter")):
            continue
        if ref is not None or n.op != "call_function":
            return None
        if isinstance(n.target, OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags:
            return None
        todo.extend(n.all_input_nodes)
    return needed


def weights_of(
    weighers: frozenset[Any], counts: dict[Any, list[float]], rows: Sequence[int]
) -> list[float] | None:
    """What a pooled output's micro-batches weigh by: their counts (or rows) where every
    term of it (``weighers``: counters, and :data:`ROWS` for a mean over the samples)
    shares them; None where its terms' shares differ, which no weighing rebuilds.

    A count not known here (NaN) weighs as rows.
    """
    by_rows = [float(r) for r in rows]
    vectors = [
        by_rows if w is ROWS or any(map(math.isnan, counts[w])) else counts[w] for w in weighers
    ]
    vectors = [v for v in vectors if sum(v) > 0]  # a term over no target: the plain 0/0 too
    if not vectors:
        return by_rows
    if all(proportional(v, vectors[0]) for v in vectors[1:]):
        return vectors[0]
    return None


def proportional(counts: Sequence[float], rows: Sequence[float]) -> bool:
    """Whether each micro-batch's count is its share of the batch's as by ``rows``.

    Within 1e-6: class weights summed in float32 round.
    """
    total, everyone = sum(counts), sum(rows)
    return all(
        math.isclose(c * everyone, total * r, rel_tol=1e-6, abs_tol=1e-9)
        for c, r in zip(counts, rows, strict=True)
    )


_warned: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_lock = threading.Lock()


def warned(pipe: nn.Module) -> bool:
    """Whether ``pipe`` has told its masked means already (then nothing need be counted)."""
    return pipe in _warned


def warn_masked_means(
    pipe: nn.Module, found: dict[str, tuple[list[float] | None, list[float]]], rows: list[int]
) -> None:
    """Warns once per ``pipe`` where an output's micro-batches do not weigh as their rows.

    ``found``: per output path, what its micro-batches weigh by (:func:`weights_of`;
    None: nothing rebuilds it) and the counts of kept targets to show.
    """
    uneven = {p: f for p, f in found.items() if f[0] is None or not proportional(f[0], rows)}
    if not uneven:
        return
    with _lock:
        if pipe in _warned:
            return
        _warned.add(pipe)
    path, (weights, kept) = next(iter(uneven.items()))
    shown = [int(c) if float(c).is_integer() else round(c, 4) for c in kept]
    mixed = (
        ""
        if weights is not None
        else " It adds terms over targets kept in other shares (two losses on different "
        "labels, or one over the rows), so no weighing of the micro-batches' values is the "
        "plain model's, pipe(x)'s included."
    )
    warn_user(
        f"output{path} of the model is a mean over the targets its loss keeps (a "
        "cross-entropy's reduction='mean' skips ignore_index, -100 by default: padding; "
        "with weight=, it divides by the kept targets' class weights; or a sum divided by "
        "a count of what the inputs keep, mask.sum()), and this step's "
        f"micro-batches keep {shown} of them for {rows} rows.{mixed} A loss_fn returning it "
        "is taken as a mean over samples and weighed by rows, so the step's loss and "
        "gradients are not the plain model's on the batch (a mean over all its kept "
        "targets): the targets of a micro-batch that keeps fewer weigh more. Fix: pass "
        "num_items_in_batch=1 in the call and num_items=<the batch's kept targets (with "
        "weight=, their summed class weights)> to the step, for a model that honours it "
        "(guide: 'A model that computes its own loss'), or compute the summed loss from the "
        "logits in loss_fn (reduction='sum') and pass num_items=. Shown once per Pipeline",
        BatchCoupledWarning,
    )


_uncounted_told: weakref.WeakSet[Any] = weakref.WeakSet()


def warn_uncounted(key: Any, paths: Sequence[str], rows: Sequence[int], call: str) -> None:
    """Warns once per ``key`` (a Pipeline, or the trace ``pipe(x)`` runs) where outputs
    ``paths`` are means over targets counted only in the run (:class:`Uncounted`), so
    ``call`` (``"pipe(x)"``, ``"the step"``) weighs their micro-batches by ``rows``."""
    if not paths or len(rows) < 2:
        return
    with _lock:
        if key in _uncounted_told:
            return
        _uncounted_told.add(key)
    fix = (
        "compute the loss from the outputs (logits) on the whole batch outside the model"
        if call == "pipe(x)"
        else "compute the summed loss in loss_fn (reduction='sum') and pass num_items=<the "
        "batch's kept targets> to the step, or return it from the model under "
        "num_items_in_batch=1 (guide: 'A model that computes its own loss')"
    )
    warn_user(
        f"{call}: output{paths[0]} of the model is a mean over the targets its loss keeps "
        "(a cross-entropy's reduction='mean' skips ignore_index, -100 by default), and the "
        "model computes those targets from its parameters (pseudo-labels), so how many each "
        f"micro-batch keeps shows only in its run: the values of the micro-batches of {list(rows)} "
        "rows are weighed by their rows. That is the plain model's value on the batch only "
        "where each micro-batch keeps targets in proportion to its rows (no padding among "
        f"them). Fix: {fix}. Shown once per Pipeline",
        BatchCoupledWarning,
    )
