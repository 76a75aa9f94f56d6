"""Manipulation of micro-batches: scatter a batch into micro-batches, gather them back.

Two departures from torchgpipe, on purpose: sizes follow :func:`torch.tensor_split`
(as even as possible, never an empty micro-batch), and inputs may be any nesting of
tuples, lists, mappings and namedtuples. Tensor leaves with ``ndim >= 1`` are cut
along dim 0 as views; other leaves are shared by every micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from pipesched.errors import (
    BatchCoupledWarning,
    ConfigError,
    ConfigTypeError,
    PipeschedWarning,
    warn_user,
)

__all__ = ["batch_size", "gather", "microbatch_sizes", "scatter"]


def microbatch_sizes(batch_size: int, chunks: int) -> list[int]:
    """The sizes :func:`scatter` cuts a batch of ``batch_size`` rows into.

    ``min(chunks, batch_size)`` micro-batches, as even as possible, larger
    first: the sizes of :func:`torch.tensor_split` without its empty pieces.

    Args:
        batch_size: Rows in the batch, at least 1.
        chunks: Micro-batches asked for, at least 1.

    Returns:
        One size per micro-batch; every size is at least 1 and they sum to
        ``batch_size``.

    Raises:
        ConfigError: ``batch_size`` or ``chunks`` is not an int >= 1.

    Example:
        >>> microbatch_sizes(10, 4)
        [3, 3, 2, 2]
        >>> microbatch_sizes(3, 4)
        [1, 1, 1]
    """
    _check_count("chunks", chunks, "the number of micro-batches to cut each batch into")
    _check_count("batch_size", batch_size, "an empty batch has no micro-batch to run; skip it")
    m = min(chunks, batch_size)
    q, r = divmod(batch_size, m)
    return [q + 1] * r + [q] * (m - r)


def batch_size(inputs: Any, name: str = "inputs") -> int:
    """The dim-0 size shared by every batched tensor leaf of ``inputs``.

    Args:
        inputs: A nesting of tuples, lists and Mappings with tensor and
            non-tensor leaves.
        name: What ``inputs`` is called in errors (the root of their paths).

    Returns:
        The size of dim 0 of every tensor leaf with ``ndim >= 1``.

    Raises:
        ConfigError: No leaf is a tensor with a batch dimension, or two such
            leaves differ on dim 0 (the message names both by their path).
    """
    first: tuple[str, int] | None = None
    for path, leaf in _leaves(inputs, name):
        if not (isinstance(leaf, Tensor) and leaf.ndim >= 1):
            continue
        if first is None:
            first = (path, leaf.shape[0])
        elif leaf.shape[0] != first[1]:
            raise ConfigError(
                f"{path} has batch size {leaf.shape[0]} but {first[0]} has {first[1]}; "
                "every tensor with ndim >= 1 is cut along dim 0, so all must have the "
                "same size there: fix the batch, or pass a value meant for every "
                "micro-batch as a 0-dim tensor or a non-tensor"
            )
    if first is None:
        raise ConfigError(
            f"no tensor with a batch dimension was found in {name} "
            f"(a {type(inputs).__name__}); pass at least one tensor with ndim >= 1 "
            "whose dim 0 is the batch"
        )
    return first[1]


def scatter(inputs: Any, chunks: int) -> list[Any]:
    """Splits a batch into micro-batches along dim 0.

    Every tensor leaf with ``ndim >= 1`` is cut into views of the sizes
    :func:`microbatch_sizes` gives; other leaves (0-dim tensors included) are
    passed unchanged, the same object, to every micro-batch. Tuples, lists,
    dicts and namedtuples keep their type; another Mapping keeps its type when it
    can be built from keywords (a ``ModelOutput``), else becomes a dict.

    Args:
        inputs: A nesting of tuples, lists and Mappings with tensor and
            non-tensor leaves; at least one leaf is a tensor with ``ndim >= 1``.
        chunks: Micro-batches asked for; a batch of fewer rows gives one
            micro-batch per row.

    Returns:
        ``min(chunks, batch_size(inputs))`` structures shaped like ``inputs``.

    Raises:
        ConfigError: ``chunks`` is not an int >= 1, the batch is empty, no
            tensor with a batch dimension is found, or batch sizes differ.

    Example:
        >>> x = torch.arange(10)
        >>> parts = scatter((x, {"mask": x > 4}, "train"), chunks=4)
        >>> [len(p[0]) for p in parts]
        [3, 3, 2, 2]
        >>> parts[1]
        (tensor([3, 4, 5]), {'mask': tensor([False, False,  True])}, 'train')
        >>> torch.equal(gather(parts)[0], x)
        True
    """
    _check_count("chunks", chunks, "the number of micro-batches to cut each batch into")
    rows = batch_size(inputs)
    if rows == 0:
        raise ConfigError(
            "the batch is empty (0 rows in dim 0 of its tensors): a pipeline runs "
            "micro-batches of one row or more, so there is nothing to run; skip empty "
            "batches before the call (the plain model would return an empty output)"
        )
    return _split(inputs, microbatch_sizes(rows, chunks))


def gather(outputs: Sequence[Any]) -> Any:
    """Joins the outputs of the micro-batches into the output of the batch.

    The inverse of :func:`scatter`: tensors with ``ndim >= 1`` are concatenated
    along dim 0 (:func:`torch.cat`, which keeps autograd); tuples, lists,
    Mappings and namedtuples are gathered field by field. 0-dim tensors (such
    as a per-micro-batch loss) are stacked into a 1-D tensor with one entry
    per micro-batch. Non-tensor leaves give the first value if all are equal,
    otherwise the list of them.

    Args:
        outputs: The output of each micro-batch, in micro-batch order, all of
            the same structure.

    Returns:
        One structure shaped like ``outputs[0]``.

    Raises:
        ConfigError: ``outputs`` is empty or not a sequence, or a micro-batch's
            structure, tensor shape or device differs from micro-batch 0's (the
            message names the micro-batch and the path).
    """
    if isinstance(outputs, (Tensor, str, bytes)) or not isinstance(outputs, Sequence):
        raise ConfigTypeError(
            f"outputs is {_describe(outputs)}; pass a non-empty list with the output "
            "of each micro-batch"
        )
    if not outputs:
        raise ConfigError(
            f"outputs is {_describe(outputs)}; pass a non-empty list with the output "
            "of each micro-batch"
        )
    return _gather(list(outputs), "")


def join_outputs(
    outputs: Sequence[Any],
    rows: Sequence[int],
    scalars: str = "mean",
    not_per_sample: Collection[str] = (),
    coupled: Collection[str] = (),
    counts: Mapping[str, Sequence[float]] | None = None,
    unweighed: Collection[str] = (),
) -> Any:
    """The batch's output from its micro-batches', as the plain model would return it.

    Like :func:`gather`, except that a 0-dim floating-point tensor (a loss the
    model computes) becomes the mean of the micro-batches' values weighted by
    their ``rows`` (a mean over samples), or their sum (``scalars="sum"``: a
    sum over items divided by the whole batch's count), not a stack of them.
    A tensor that is not per sample (its path in ``not_per_sample``, or a dim
    0 that does not grow with the micro-batches' rows) is not concatenated:
    equal in every micro-batch, it is that value (a weight norm); otherwise
    the plain model's value on the batch cannot be rebuilt, and the list of
    the micro-batches' values comes back, with a warning. Containers keep
    their type (a ``ModelOutput`` stays one).

    Args:
        outputs: the output of each micro-batch, in order.
        rows: each micro-batch's sample count.
        scalars: ``"mean"`` or ``"sum"``.
        not_per_sample: paths (``"['mean']"``, ``"[1]"``) of tensors known
            not to follow the batch in dim 0 (a traced model's export says).
        coupled: paths of tensors that mix rows of different samples (an
            in-batch contrastive loss, a similarity matrix over the batch:
            :mod:`pipesched.pipeline.checks.coupled_outputs`): with more than one
            micro-batch, returned as the list of the micro-batches' values,
            with a :class:`~pipesched.errors.BatchCoupledWarning` naming them
            and the fix.
        counts: per path of a 0-dim mean over the items each micro-batch holds
            (the targets a loss keeps, padding skipped), those items' counts:
            its micro-batches weigh by them, not by rows. One that holds none
            (its mean a NaN, 0/0) weighs nothing, as in the plain model's; NaN
            counts (not known here) weigh by rows.
        unweighed: paths of 0-dim outputs that add means over items kept in
            other shares (a masked-LM loss plus one over the rows): returned as
            the list of the micro-batches' values, told as such.
    """
    total = sum(rows)
    weights = [r / total for r in rows] if scalars == "mean" else [1.0] * len(rows)

    def weighed(values: list[Tensor], path: str) -> Any:
        items = (counts or {}).get(path)
        if items is None or not sum(items) > 0:  # (none at all: the plain model's 0/0 too)
            return sum(w * v for w, v in zip(weights, values, strict=True))
        every = sum(items)
        return sum((c / every) * v for c, v in zip(items, values, strict=True) if c)

    def special(values: list[Any], path: str) -> Any:
        if path in unweighed and len(values) > 1:
            warn_user(
                f"pipe(x): output{path or ''} adds means over targets its micro-batches keep "
                "in different shares (a loss over the tokens its labels keep plus one over "
                "the rows or over other labels, as BertForPreTraining's masked-LM and "
                "next-sentence losses), so no weighing of the micro-batches' values (of "
                f"{list(rows)} rows) is the plain model's on the batch; it is returned as the "
                "list of the micro-batches' values. Fix: compute each term from the outputs "
                "(their logits) on the whole batch, or call with chunks=1",
                BatchCoupledWarning,
            )
            return list(values)
        if path in coupled and len(values) > 1:
            warn_user(
                f"pipe(x): output{path or ''} mixes rows of different samples (each "
                "sample's value depends on the other samples of the batch: an in-batch "
                "contrastive loss or a similarity matrix over the batch), or pools them "
                "other than the micro-batches' values add up (a max, median or variance over "
                "the batch; a sum where the call passes no num_items_in_batch, or a mean "
                "where it passes one), so the "
                f"micro-batches of {list(rows)} rows cannot rebuild the plain model's value "
                "on the batch; it is returned as the list of the micro-batches' values. "
                "Fix: have the model return per-sample outputs (embeddings) and compute the "
                "coupled value from the whole batch's outside the pipeline, or call with "
                "chunks=1",
                BatchCoupledWarning,
            )
            return list(values)
        if all(isinstance(v, Tensor) and v.ndim == 0 and v.is_floating_point() for v in values):
            return weighed(values, path)
        if not all(isinstance(v, Tensor) and v.ndim >= 1 for v in values):
            return None
        first = values[0].shape[0]
        follows = all(v.shape[0] * rows[0] == first * r for v, r in zip(values, rows, strict=True))
        if follows and path not in not_per_sample:
            return None
        if all(v.shape == values[0].shape and torch.equal(v, values[0]) for v in values):
            return values[0]
        warn_user(
            f"pipe(x): output{path or ''} (dim 0 of {[v.shape[0] for v in values]} in "
            f"micro-batches of {list(rows)} rows) is not per sample, so its value on the "
            "batch cannot be rebuilt from the micro-batches' (the plain model computes it "
            "over the whole batch); it is returned as the list of the micro-batches' values. "
            "Compute it from per-sample outputs, or call with one micro-batch",
            PipeschedWarning,
        )
        return list(values)

    return _gather(list(outputs), "", special)


def _check_count(name: str, value: object, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigTypeError(f"{name} must be an int >= 1, got {value!r}: {meaning}")
    if value < 1:
        raise ConfigError(f"{name} must be an int >= 1, got {value!r}: {meaning}")


def _children(value: Any) -> list[tuple[str, Any]] | None:
    """The path suffix and value of each element of a container; None for a leaf."""
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return [(f".{name}", v) for name, v in zip(value._fields, value, strict=True)]
    if isinstance(value, (tuple, list)):
        return [(f"[{i}]", v) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        return [(f"[{key!r}]", v) for key, v in value.items()]
    return None


def _rebuild(like: Any, items: list[Any]) -> Any:
    """A container of the kind of ``like`` holding ``items``."""
    if isinstance(like, Mapping):
        joined = dict(zip(like.keys(), items, strict=True))
        if type(like) is not dict:
            try:  # keep the type: OrderedDict, a Hugging Face ModelOutput, ...
                return type(like)(**joined)
            except Exception:
                pass
        return joined
    if isinstance(like, list):
        return items
    if hasattr(like, "_fields"):  # namedtuple
        return type(like)(*items)
    if hasattr(like, "n_sequence_fields"):  # torch.return_types, e.g. of torch.max
        return type(like)(items)
    return tuple(items)


def _leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    children = _children(value)
    if children is None:
        yield path, value
        return
    for suffix, child in children:
        yield from _leaves(child, path + suffix)


def _split(value: Any, sizes: list[int]) -> list[Any]:
    """``value`` cut into ``len(sizes)`` micro-batches (batch sizes already checked)."""
    m = len(sizes)
    if isinstance(value, Tensor):
        return list(value.split_with_sizes(sizes)) if value.ndim >= 1 else [value] * m
    children = _children(value)
    if children is None:
        return [value] * m
    columns = [_split(child, sizes) for _, child in children]
    rows = zip(*columns, strict=True) if columns else [()] * m
    return [_rebuild(value, list(row)) for row in rows]


def _kind(value: Any) -> object:
    """What must agree across micro-batches at one path for them to be gathered."""
    if isinstance(value, Tensor):
        return Tensor
    if isinstance(value, Mapping):
        return Mapping
    if isinstance(value, (tuple, list)):
        return type(value)
    return None


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)} on {value.device}"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {list(value)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of length {len(value)}"
    return f"a {type(value).__name__}"


def _mismatch(i: int, path: str, seen: str, first: str, fix: str) -> ConfigError:
    return ConfigError(
        f"micro-batch {i} cannot be gathered with micro-batch 0: outputs[{i}]{path} is "
        f"{seen} but outputs[0]{path} is {first}; {fix}"
    )


_SAME_STRUCTURE = "every micro-batch must return the same nesting of tuples, lists and dicts"


def _gather(
    values: list[Any], path: str, special: Callable[[list[Any], str], Any] | None = None
) -> Any:
    """Gathers the values found at ``path`` in each micro-batch's output.

    ``special``: tried first at every path; a result other than None is taken.
    """
    if special is not None and (joined := special(values, path)) is not None:
        return joined
    first = values[0]
    for i, value in enumerate(values):
        if _kind(value) != _kind(first):
            raise _mismatch(i, path, _describe(value), _describe(first), _SAME_STRUCTURE)
    if isinstance(first, Tensor):
        return _gather_tensors(values, path)
    if isinstance(first, Mapping):
        keys = list(first)
        for i, value in enumerate(values):
            if set(value) != set(keys):
                raise _mismatch(i, path, _describe(value), _describe(first), _SAME_STRUCTURE)
        suffixes = [f"[{key!r}]" for key in keys]
        columns = [[value[key] for value in values] for key in keys]
    elif isinstance(first, (tuple, list)):
        for i, value in enumerate(values):
            if len(value) != len(first):
                raise _mismatch(i, path, _describe(value), _describe(first), _SAME_STRUCTURE)
        suffixes = [suffix for suffix, _ in _children(first) or []]
        columns = [list(column) for column in zip(*values, strict=True)]
    else:
        return first if all(_equal(value, first) for value in values) else values
    gathered = [
        _gather(column, path + suffix, special)
        for suffix, column in zip(suffixes, columns, strict=True)
    ]
    return _rebuild(first, gathered)


def _gather_tensors(tensors: list[Tensor], path: str) -> Tensor:
    first = tensors[0]
    for i, tensor in enumerate(tensors):
        if (tensor.ndim == 0) != (first.ndim == 0) or tensor.shape[1:] != first.shape[1:]:
            raise _mismatch(
                i,
                path,
                _describe(tensor),
                _describe(first),
                "micro-batch outputs must agree on every dimension but dim 0 (the batch)",
            )
        if tensor.device != first.device:
            raise _mismatch(
                i,
                path,
                _describe(tensor),
                _describe(first),
                "move the outputs to one device before gathering them",
            )
    return torch.stack(tensors) if first.ndim == 0 else torch.cat(tensors)


def _equal(a: object, b: object) -> bool:
    """``a == b`` for non-tensor leaves; values that cannot be compared are unequal."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False
