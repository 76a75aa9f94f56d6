"""Which outputs of a traced model mix rows of different samples: a micro-batch cannot compute them.

An output is the plain model's only if sample i's value depends on sample i alone
(CLIP's in-batch logits do not). The export's symbolic sizes tell, running nothing:
each value is batch-free, per-sample, pooled or coupled (an outer product over
samples, a scan along the batch, a per-sample value computed from a pooled one).
A pooled value is rebuilt from the micro-batches' as a mean (rows-weighted; a
loss's mean over the targets it keeps, weighed by their counts: see
:mod:`~pipesched.pipeline.checks.masked_means`) or, where the call passes
``num_items_in_batch``, a sum; each pooled value's kind is followed (a mean, a
sum, or other: a max, a variance), and a 0-dim output of another kind is coupled."""

from __future__ import annotations

import math
import operator
import threading
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import fx, nn

from pipesched.errors import BatchCoupledWarning, warn_user
from pipesched.partition.per_sample import leaf_paths
from pipesched.partition.sizes import grows_with
from pipesched.partition.trace import TracedModel
from pipesched.pipeline.checks.masked_means import (
    ROWS,
    ItemCounter,
    Uncounted,
    divisor_counter,
    item_counter,
    masks_targets,
    proportional,
    warn_masked_means,
    warn_uncounted,
    warned,
    weights_of,
)
from pipesched.runtime.compat.internals import (
    OpOverload,
    op_schema,
    pytree,
    size_symbols,
)

__all__ = [
    "Weighing", "coupled_flags", "coupled_paths", "masked_weights", "output_paths", "warn_coupled",
    "warn_uneven_targets",
]  # fmt: skip

_SCANS = frozenset(
    {
        "softmax", "_softmax", "log_softmax", "_log_softmax", "cumsum", "cumprod",
        "logcumsumexp", "cummax", "cummin", "sort", "argsort", "flip", "roll",
    }
)  # fmt: skip
"""Operations whose every output element along ``dim`` depends on the others along it."""

_PER_SAMPLE_HERE = frozenset(
    {
        "batch_norm", "native_batch_norm", "_native_batch_norm_legit",
        "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training",
        "cudnn_batch_norm", "miopen_batch_norm",
    }
)  # fmt: skip
"""Batch statistics told by :mod:`pipesched.pipeline.checks.micro_batch_norm`, not here."""

_Weighers = frozenset[Any]  # ItemCounters, and ROWS for a term that is a mean over samples
_Found = tuple[tuple[bool, ...], tuple[str | None, ...], dict[int, _Weighers]]
_cache: weakref.WeakKeyDictionary[TracedModel, _Found] = weakref.WeakKeyDictionary()


def _found(traced: TracedModel) -> _Found:
    found = _cache.get(traced)
    if found is None:
        found = _cache[traced] = _coupled_flags(traced)
    return found


def coupled_flags(traced: TracedModel, summed: bool = False) -> tuple[bool, ...]:
    """Per flattened output (``pytree`` order): whether micro-batches cannot rebuild it.

    It mixes rows of different samples (see the module docstring), or it is pooled
    over the samples other than as joining rebuilds it: a mean (``summed``: the call
    passes ``num_items_in_batch``, a sum; a mean over the targets a loss keeps is
    a mean, weighed by :func:`masked_weights`). Computed once per trace.
    """
    coupled, pooled, _ = _found(traced)
    fits = {_SUM} if summed else {_MEAN, _MASKED}
    return tuple(
        c or (k is not None and k not in fits) for c, k in zip(coupled, pooled, strict=True)
    )


class Weighing(NamedTuple):
    """How a loss's mean over the targets it keeps is rebuilt from its micro-batches'."""

    weights: list[float] | None
    """What the micro-batches weigh by; None where nothing rebuilds it (see
    :func:`~pipesched.pipeline.checks.masked_means.weights_of`)."""
    kept: list[float]
    """The counts of kept targets (NaN: not known here), shown in warnings."""
    uncounted: bool
    """Whether a term's targets are counted only in the run (:class:`Uncounted`):
    weighed as rows, to be told."""


def masked_weights(
    traced: TracedModel, micro: Sequence[Any], rows: Sequence[int]
) -> dict[int, Weighing]:
    """Per 0-dim output that is a loss's mean over the targets it keeps (its index in
    ``traced.outputs``), how its micro-batches (``micro``: their stage-0 inputs, of
    ``rows`` rows) weigh. Empty (and nothing run) for a model with none."""
    masked = _found(traced)[2]
    if not masked:
        return {}
    m = len(micro)
    unknown = [math.nan] * m
    counters = list(dict.fromkeys(w for ws in masked.values() for w in ws if _counts(w)))
    counts: dict[Any, list[float]] = {w: unknown for ws in masked.values() for w in ws}
    if counters:
        leaves = [traced.input_leaves(inputs) for inputs in micro]
        counted = [c.count(traced, one) for c in counters for one in leaves]
        read = torch.stack([t.to(counted[0].device, torch.float64) for t in counted]).tolist()
        counts |= {c: read[k * m : (k + 1) * m] for k, c in enumerate(counters)}
    found = {}
    for i, weighers in masked.items():
        counted = [counts[w] for w in weighers if _counts(w)]  # shown: an uneven one first
        counted.sort(key=lambda c: proportional(c, rows))
        shown = counted[0] if counted else [float(r) for r in rows]
        uncounted = any(isinstance(w, Uncounted) for w in weighers)
        found[i] = Weighing(weights_of(weighers, counts, rows), shown, uncounted)
    return found


def _counts(weigher: Any) -> bool:
    """Whether ``weigher`` is counted before the run (not ROWS, not :class:`Uncounted`)."""
    return isinstance(weigher, ItemCounter)


def warn_uneven_targets(
    pipe: nn.Module, traced: TracedModel, micro: list[Any], rows: list[int]
) -> None:
    """Warns (once per ``pipe``) where a loss's mean over the targets it keeps has them
    shared otherwise than rows among this step's ``micro``-batches: the step weighs
    ``loss_fn``'s values by rows (see :mod:`~pipesched.pipeline.checks.masked_means`)."""
    if warned(pipe):
        return
    if found := masked_weights(traced, micro, rows):
        paths = output_paths(traced)
        warn_uncounted(pipe, [paths[i] for i, f in found.items() if f.uncounted], rows, "the step")
        counted = {paths[i]: (f.weights, f.kept) for i, f in found.items() if not f.uncounted}
        warn_masked_means(pipe, counted, rows)


def output_paths(traced: TracedModel) -> list[str]:
    """Each flattened output's path (``".loss"``, ``"[0]"``), for messages."""
    shaped = pytree.tree_unflatten(list(range(len(traced.outputs))), traced.out_spec)
    return leaf_paths(shaped)


def coupled_paths(traced: TracedModel, summed: bool = False) -> list[str]:
    """The coupled outputs' paths, written as :func:`~pipesched.partition.per_sample.leaf_paths`."""
    flags = coupled_flags(traced, summed)
    if not any(flags):
        return []
    paths = output_paths(traced)
    return [p for p, flag in zip(paths, flags, strict=True) if flag]


def _coupled_flags(traced: TracedModel) -> _Found:
    batch: set[Any] = set()
    known: set[Any] = set()
    for node in traced.inputs:
        value = node.meta.get("val")
        for k, dim in enumerate(value.shape if isinstance(value, torch.Tensor) else ()):
            if isinstance(dim, torch.SymInt):
                known |= size_symbols(dim)
                batch |= size_symbols(dim) if k == 0 else set()
    if not batch:
        return (False,) * len(traced.outputs), (None,) * len(traced.outputs), {}

    def batch_dims(value: Any) -> list[int]:
        """The dims of ``value`` (a tensor, or any tensor of a tuple) sized by the batch."""
        dims: list[int] = []
        for tensor in pytree.tree_leaves(value):
            if isinstance(tensor, torch.Tensor):
                for k, size in enumerate(tensor.shape):
                    if isinstance(size, torch.SymInt):
                        free = size_symbols(size)
                        if (free & batch and grows_with(size, batch)) or free - known:
                            # (unknown symbols: data-dependent, maybe rows)
                            dims.append(k)
        return dims

    depends: dict[fx.Node, bool] = {}
    coupled: dict[fx.Node, bool] = {}
    pooled: dict[fx.Node, str | None] = {}
    counters: dict[fx.Node, _Weighers] = {}  # what a masked mean's terms weigh by
    for node in traced.inputs:
        depends[node] = 0 in batch_dims(node.meta.get("val"))
        coupled[node] = False
    numbers: set[fx.Node] = set()  # numbers that follow the batch: its size, its data's .item()
    for node in traced.ops:
        sources = [n for n in node.all_input_nodes if depends.get(n, False)]
        value = node.meta.get("val")
        if _follows_batch(node, value, sources, numbers, batch, known):
            numbers.add(node)
        depends[node] = bool(sources) and _is_data(value)
        coupled[node] = depends[node] and (
            any(coupled[n] for n in sources)
            or _couples(node, value, sources, batch_dims)
            or (bool(batch_dims(value)) and _takes_as_value(node, numbers))
        )
        if not depends[node] and isinstance(value, torch.Tensor) and len(batch_dims(value)) >= 2:
            depends[node] = coupled[node] = True  # made over samples x samples (eye(B))
        if depends[node] and not batch_dims(value):
            kind = pooled[node] = _pooling(
                traced, node, sources, pooled, counters, batch, batch_dims
            )
            if kind == _MASKED and node not in counters:  # its terms' weighers
                counters[node] = frozenset().union(
                    *(counters.get(n, {ROWS}) for n in sources if pooled.get(n) in _MEANS)
                )
    outputs = [out if isinstance(out, fx.Node) else None for out in traced.outputs]
    kinds = tuple(None if out is None or not _scalar(out) else pooled.get(out) for out in outputs)
    return (
        tuple(out is not None and coupled.get(out, False) for out in outputs),
        kinds,
        {
            i: counters[out]
            for i, (out, kind) in enumerate(zip(outputs, kinds, strict=True))
            if kind == _MASKED and out is not None
        },
    )


def _scalar(node: fx.Node) -> bool:
    """Whether ``node`` is a 0-dim tensor: what joining rebuilds by averaging (or summing)."""
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.ndim == 0


_MEAN, _SUM, _MASKED, _OTHER = "mean", "sum", "masked", "other"
_MEANS = (_MEAN, _MASKED)
_KEEPS = frozenset(
    {
        "neg", "clone", "detach", "alias", "view", "reshape", "_unsafe_view", "squeeze",
        "unsqueeze", "flatten", "_to_copy", "to", "type_as", "contiguous", "lift_fresh_copy",
        "expand", "_assert_tensor_metadata",
    }
)  # fmt: skip
"""Operations that keep how a value pools over samples (its kind): a copy, a reshape."""


def _pooling(
    traced: TracedModel,
    node: fx.Node,
    sources: list[fx.Node],
    pooled: dict[fx.Node, str | None],
    counters: dict[fx.Node, _Weighers],
    batch: set[Any],
    batch_dims: Any,
) -> str:
    """How ``node``'s value, free of the batch, pools its samples: ``"mean"``, ``"sum"``,
    ``"masked"`` (a loss's mean over the targets it keeps: its counter goes in
    ``counters``) or ``"other"`` (a max, a median, a variance, a nonlinear function of
    a pooled value), which micro-batches cannot rebuild by averaging (or summing)
    their values."""
    op = node.target
    name = op_schema(op).name.split("::")[-1] if isinstance(op, OpOverload) else None
    if op is operator.getitem:
        return pooled.get(sources[0]) or _OTHER
    if any(batch_dims(n.meta.get("val")) for n in sources):  # the samples are pooled here
        if name == "mean":
            return _MEAN
        if name == "sum":
            return _SUM
        if isinstance(op, OpOverload):
            arguments = op_schema(op).arguments
            given = {a.name: a.default_value for a in arguments if a.has_default_value()}
            given |= dict(zip([a.name for a in arguments], node.args, strict=False))
            given |= dict(node.kwargs)
            reduction = given.get("reduction")  # a loss: 1 a mean, 2 a sum (ATen's enum)
            if masks_targets(node, given):  # a mean over the targets it keeps
                counter = item_counter(traced, node, given)
                if counter is None:  # it keeps every target: a mean over the rows
                    return _MEAN
                counters[node] = frozenset({counter})
                return _MASKED
            if reduction in (1, 2):
                return _MEAN if reduction == 1 else _SUM
        return _OTHER
    kinds = {pooled.get(n) or _OTHER for n in sources}
    kind = next(iter(kinds)) if len(kinds) == 1 else _OTHER
    if kinds == {_MEAN, _MASKED}:
        kind = _MASKED  # terms weighed by rows and by counts: each call says if they agree
    others = [a for a in node.all_input_nodes if a not in sources]
    if name in _KEEPS or (name in ("add", "sub") and kind in (_MEAN, _MASKED)):
        return kind  # (a mean plus a constant: the rows' weights add up to one)
    if name in ("add", "sub") and not others and not _scalars(node):
        return kind  # sums of sums: a sum
    if name == "div" and len(sources) == 2 and tuple(node.args[:2]) == tuple(sources):
        counted = pooled.get(sources[1]) == _SUM and divisor_counter(traced, sources[1])
        if pooled.get(sources[0]) == _SUM and counted:  # a sum over the count inputs give
            counters[node] = frozenset({counted})
            return _MASKED
    if name in ("mul", "div") and len(sources) == 1:
        first = node.args[0] if node.args else None
        if name == "div" and first is not sources[0]:
            return _OTHER  # a constant over a pooled value
        divisor = node.args[1] if len(node.args) > 1 else None
        if kind == _SUM and name == "div" and _counts_rows(divisor, batch):
            return _MEAN  # a sum over the rows, divided by their number
        return kind  # scaled by what does not depend on the batch
    return _OTHER


def _scalars(node: fx.Node) -> bool:
    """Whether ``node`` takes a Python number beside its tensors (``x + 1``)."""
    return any(isinstance(a, (int, float)) for a in node.args)


def _counts_rows(divisor: Any, batch: set[Any]) -> bool:
    """Whether ``divisor`` (a node or number) is sized by the batch (``x.shape[0]``)."""
    value = divisor.meta.get("val") if isinstance(divisor, fx.Node) else divisor
    return isinstance(value, torch.SymInt) and bool(size_symbols(value) & batch)


_VALUE_TYPES = frozenset({"Tensor", "Scalar", "float", "Tensor?", "Scalar?", "float?"})
"""Schema types of an argument a number fills as a value (not a size, a dim or an index)."""
_READS = frozenset({"_local_scalar_dense", "item"})


def _follows_batch(
    node: fx.Node, value: Any, sources: list[fx.Node], numbers: set[fx.Node], batch: set[Any],
    known: set[Any],
) -> bool:  # fmt: skip
    """Whether ``node`` is a number that follows the batch: an expression of its size
    (``x.shape[0]``), a read of data that depends on it (``h.max().item()``,
    ``torch.unique(h).numel()``), or arithmetic on such numbers."""
    if not isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return False
    if any(n in numbers for n in node.all_input_nodes):
        return True
    free = size_symbols(value) if isinstance(value, torch.SymInt) else set()
    if free & batch:
        return True
    op = node.target
    name = op_schema(op).name.split("::")[-1] if isinstance(op, OpOverload) else None
    return bool(sources) and (name in _READS or bool(free - known))


def _takes_as_value(node: fx.Node, numbers: set[fx.Node]) -> bool:
    """Whether ``node`` computes with one of ``numbers`` as a value (``h * x.shape[0]``),
    not as a size or an index (``h.view(x.shape[0], -1)``)."""
    op = node.target
    if not numbers or not isinstance(op, OpOverload):
        return False
    arguments = op_schema(op).arguments
    given = list(zip(arguments, node.args, strict=False))
    given += [(a, node.kwargs[a.name]) for a in arguments if a.name in node.kwargs]
    return any(str(a.type) in _VALUE_TYPES and v in numbers for a, v in given)


def _is_data(value: Any) -> bool:
    """Whether a node's value holds tensor data (not a size: those are the batch's shape only)."""
    return any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(value))


def _couples(node: fx.Node, value: Any, sources: list[fx.Node], batch_dims: Any) -> bool:
    """Whether ``node`` itself mixes the rows of its batch-dependent ``sources``."""
    op = node.target
    name = op_schema(op).name.split("::")[-1] if isinstance(op, OpOverload) else None
    if name in _PER_SAMPLE_HERE or op is operator.getitem:
        return False
    dims = batch_dims(value) if not isinstance(value, (tuple, list)) else []
    if isinstance(value, torch.Tensor) and len(dims) >= 2:
        return True  # an outer product over samples
    if dims and any(not batch_dims(n.meta.get("val")) for n in sources):
        return True  # indexed by the batch, computed from a value pooled over it
    if name == "layer_norm" and isinstance(op, OpOverload):  # over its last dims
        first, shape = node.args[0], node.args[1]
        rank = first.meta["val"].ndim if isinstance(first, fx.Node) else 0
        over = range(rank - len(shape), rank) if isinstance(shape, (list, tuple)) else ()
        shape_of = batch_dims(first.meta.get("val")) if isinstance(first, fx.Node) else []
        return any(d in shape_of for d in over)
    if name in _SCANS and isinstance(op, OpOverload):
        first = node.args[0] if node.args else None
        shape_of = batch_dims(first.meta.get("val")) if isinstance(first, fx.Node) else []
        names = [a.name for a in op_schema(op).arguments]
        given = dict(zip(names, node.args, strict=False)) | dict(node.kwargs)
        along = given.get("dim", given.get("dims", -1 if "dim" in names else None))
        rank = first.meta["val"].ndim if isinstance(first, fx.Node) else 0
        wanted = along if isinstance(along, (list, tuple)) else [along]
        return any(isinstance(d, int) and rank and d % rank in shape_of for d in wanted)
    return False


_warned: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_lock = threading.Lock()


def warn_coupled(pipe: nn.Module, paths: list[str], m: int) -> None:
    """Warns once per ``pipe`` that its loss_fn gets batch-coupled outputs per micro-batch."""
    if not paths or pipe in _warned:
        return
    with _lock:
        if pipe in _warned:
            return
        _warned.add(pipe)
    shown = ", ".join(f"output{p}" for p in paths)
    warn_user(
        f"{shown} of the model mix{'es' if len(paths) == 1 else ''} rows of different samples "
        "(each sample's value depends on the other samples of the batch: an in-batch "
        "contrastive loss or a similarity matrix over the batch), or pool"
        f"{'s' if len(paths) == 1 else ''} them other than the micro-batches' values add up "
        "(a max, median or variance over the batch; a sum where the call passes no "
        "num_items_in_batch, or a mean where it passes one: a model that ignores it); "
        f"this step runs {m} "
        "micro-batches, so loss_fn receives each micro-batch's value, not the plain model's "
        "on the batch, and a loss or gradient computed from it is another model's. Fix: have "
        "the model return per-sample outputs (embeddings) only, and compute the coupled loss "
        "outside the pipeline on the whole batch's (pipe(x) under autograd, then "
        "loss.backward()), or use chunks=1. Shown once per Pipeline",
        BatchCoupledWarning,
    )
