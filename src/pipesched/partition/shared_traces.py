"""One trace per model and kind of call within a scope: the planner's pipelines share it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipesched.partition.call import Call
from pipesched.runtime.compat.internals import pytree

if TYPE_CHECKING:
    from pipesched.partition.trace import TracedModel

__all__ = ["keep_trace", "shared_trace", "traces_shared"]

_shared: ContextVar[dict[tuple[Any, ...], TracedModel] | None] = ContextVar(
    "pipesched_shared_traces", default=None
)


@contextlib.contextmanager
def traces_shared() -> Iterator[None]:
    """Within it, :func:`~pipesched.partition.trace.trace_model` traces a model once per call kind.

    Why: ``Pipeline(schedule="auto")`` builds four pipelines of one model that
    nothing changes in between (the profile, two timing runs, the pick), and
    each export takes seconds. A trace is reused for the same model object in
    the same mode, called with the same structure, shapes, dtypes, devices and
    non-tensor values; only within this scope, since outside it a user may
    change the model between two Pipelines.
    """
    if _shared.get() is not None:  # already inside one
        yield
        return
    token = _shared.set({})
    try:
        yield
    finally:
        _shared.reset(token)


def shared_trace(model: nn.Module, call: Call) -> TracedModel | None:
    """The trace of ``model`` for this kind of call made earlier in the scope, or None."""
    shared = _shared.get()
    if shared is None:
        return None
    traced = shared.get(_key(model, call))
    return traced if traced is not None and traced.model is model else None


def keep_trace(model: nn.Module, call: Call, traced: TracedModel) -> None:
    """Keeps ``traced`` for the rest of the scope (nothing outside one)."""
    shared = _shared.get()
    if shared is not None:
        shared[_key(model, call)] = traced


def _key(model: nn.Module, call: Call) -> tuple[Any, ...]:
    """What a trace of ``model`` depends on, of the call that traces it."""
    leaves, spec = pytree.tree_flatten(call)
    kinds = tuple(
        (tuple(v.shape), v.dtype, v.device, v.requires_grad)
        if isinstance(v, torch.Tensor)
        else (type(v), repr(v))
        for v in leaves
    )
    return id(model), model.training, str(spec), kinds
