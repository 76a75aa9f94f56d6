"""A call of a model: its positional and keyword arguments as one value a pipeline can cut.

``pipe(*args, **kwargs)`` packs its arguments into a :class:`Call`; the batch
of ``pipe.step(batch, ...)`` becomes one too (:func:`as_call`). A Call is a
NamedTuple, so :func:`pipesched.runtime.stage.microbatch.scatter` cuts every tensor in it
along dim 0 like any other nesting, and stage 0 of a traced model unpacks it
into the model's own arguments.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from pipesched.errors import ConfigError, ConfigTypeError
from pipesched.runtime.compat.internals import pytree

__all__ = [
    "Call",
    "as_call",
    "call_key",
    "describe_change",
    "one_call",
    "stage_input",
    "with_cache_off",
]


class Call(NamedTuple):
    """The arguments of one call of a model: ``model(*args, **kwargs)``.

    Pass one to :meth:`pipesched.Pipeline.step` when the batch is several
    positional arguments *and* keyword arguments:
    ``pipe.step(Call((x,), {"mask": m}), y, loss_fn=...)``.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @classmethod
    def of(cls, example_inputs: tuple[Any, ...] | Call) -> Call:
        """``example_inputs`` (a Call, or a tuple of positional arguments) as a Call."""
        if isinstance(example_inputs, Call):
            return example_inputs
        if not isinstance(example_inputs, tuple | list):  # a tensor would be read row by row
            raise ConfigTypeError(
                f"example_inputs must be a tuple of the model's positional arguments (or a "
                f"Call), got {type(example_inputs).__name__}; write example_inputs=(x,)"
            )
        return cls(tuple(example_inputs), {})

    def leaves(self, order: list[str] | None = None) -> tuple[list[Any], pytree.TreeSpec]:
        """The flattened ``(args, kwargs)`` as ``torch.export`` sees them.

        Args:
            order: the keyword names in the order the trace saw them (a call's
                keyword order does not matter to Python, so it must not here).
        """
        kwargs = self.kwargs
        if order is not None and set(order) == set(kwargs):
            kwargs = {name: kwargs[name] for name in order}
        return pytree.tree_flatten((tuple(self.args), kwargs))


def as_call(model: nn.Module, batch: Any) -> Call:
    """What ``pipe.step(batch)`` calls a (traced) model with.

    - a :class:`Call`: as it is;
    - a Mapping whose keys ``model.forward`` accepts as keywords: keyword
      arguments (``{"input_ids": ..., "attention_mask": ...}``);
    - a tuple: positional arguments, unless the forward takes it only as its
      one argument (``forward(self, pair)``);
    - anything else (a tensor, a Mapping the forward takes as one argument):
      the one positional argument.
    """
    if isinstance(batch, Call):
        return batch
    if isinstance(batch, Mapping) and _binds(model, (), dict(batch)):
        return Call((), dict(batch))
    if type(batch) is tuple and (_binds(model, batch, {}) or not _binds(model, (batch,), {})):
        return Call(batch, {})
    return Call((batch,), {})


def stage_input(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A pipeline's stage-0 input for ``model(*args, **kwargs)``.

    An ``nn.Sequential``: its one argument (its first layer's input). Any
    other model: a :class:`Call` (one positional argument and no keywords is
    read by :func:`as_call`, as a step's batch is), with caching off.

    Raises:
        ConfigTypeError: an ``nn.Sequential`` called with several arguments.
    """
    if isinstance(model, nn.Sequential):
        if len(args) != 1 or kwargs:
            raise ConfigTypeError(
                f"a Pipeline of an nn.Sequential takes one input (its first layer's), got "
                f"{len(args)} positional and {len(kwargs)} keyword arguments; pass a tuple "
                "or dict as one argument if the first layer takes several tensors"
            )
        return args[0]
    call = as_call(model, args[0]) if len(args) == 1 and not kwargs else Call(args, kwargs)
    return with_cache_off(model, call)


def one_call(inputs: list[Any]) -> Call | None:
    """The call every micro-batch of a step makes (None: an nn.Sequential's inputs).

    Raises:
        ConfigError: given micro-batches that are different kinds of call.
    """
    first = inputs[0]
    if not isinstance(first, Call):
        return None
    key = call_key(first)
    for i, x in enumerate(inputs[1:], start=1):
        if isinstance(x, Call) and (other := call_key(x)) != key:
            raise ConfigError(
                f"microbatches[{i}] is another kind of call than microbatches[0]: "
                f"{describe_change(key, other)}; give every micro-batch of a step the same "
                "keywords, nesting, dtypes and number of dimensions (sizes may differ)"
            )
    return first


def with_cache_off(model: nn.Module, call: Call) -> Call:
    """``call`` with ``use_cache=False`` when the model takes ``use_cache`` and it is not given.

    Why: Hugging Face models return a cache object (``DynamicCache``) by
    default, which is neither a tensor nor useful in training; a pipeline runs
    them with caching off unless the caller asks for it.
    """
    if "use_cache" in call.kwargs:
        return call
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return call
    if "use_cache" not in parameters:
        return call
    return Call(call.args, {**call.kwargs, "use_cache": False})


def call_key(call: Call) -> tuple[Any, ...]:
    """What a trace of ``call`` depends on: the structure, non-tensor values, dtypes and ranks.

    Two calls with equal keys run on one trace; sizes (batch, sequence length)
    may differ, they are dynamic in the trace.
    """
    order = sorted(call.kwargs)
    leaves, spec = call.leaves(order)
    names = f"{len(call.args)} positional argument(s) and keywords {order}"
    return (names, spec, *(_leaf_key(leaf) for leaf in leaves))


def describe_change(old: tuple[Any, ...], new: tuple[Any, ...]) -> str:
    """What differs between two :func:`call_key` values, in words."""
    if old[0] != new[0]:
        return f"the call changed from {old[0]} to {new[0]}"
    if old[1] != new[1]:
        return "the arguments' structure changed (a nesting of tuples, lists or dicts)"
    for i, (a, b) in enumerate(zip(old[2:], new[2:], strict=True)):
        if a != b:
            return f"argument leaf {i} changed from {_show(a)} to {_show(b)}"
    return "nothing"


def _leaf_key(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return ("tensor", leaf.dtype, leaf.ndim)
    try:
        hash(leaf)
    except TypeError:
        return ("object", type(leaf).__name__, id(leaf))
    return ("value", leaf)


def _show(key: Any) -> str:
    kind, *rest = key
    if kind == "tensor":
        return f"a {rest[1]}-dim {rest[0]} tensor"
    if kind == "value":
        return repr(rest[0])
    return f"a {rest[0]}"


def _binds(model: nn.Module, args: tuple[Any, ...], kwargs: dict[Any, Any]) -> bool:
    """Whether ``model.forward`` accepts these arguments (True when it cannot tell)."""
    if not all(isinstance(key, str) for key in kwargs):
        return False
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return True
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return False
    return True
