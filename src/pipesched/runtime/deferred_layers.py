"""Deferred weight gradients layer by layer: a split backward's forward without a per-op mode.

Why not :class:`~pipesched.runtime.deferred.DeferredWeightsMode` around the whole
forward: a mode runs Python for every torch call, and two stage threads then queue
on the GIL. Here each layer that owns weights gets, once per stage, a forward of
its own that defers while its thread runs a split backward's forward
(:class:`deferring`) and is the layer's own forward otherwise: linear, layer norm,
embedding and convolution call their deferring Function directly; any other layer
owning parameters (GPT-2's ``Conv1D``, ``nn.MultiheadAttention``, a norm) runs its
forward under the mode, which then sees only that layer's ops. Which weights some
other op also uses is read from the graph in B
(:meth:`~pipesched.runtime.deferred.WeightStore.flag_shared`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime.compat.internals import top_saved_tensors_hooks
from pipesched.runtime.deferred import DeferredWeightsMode, WeightStore
from pipesched.runtime.deferred_ops import HANDLERS
from pipesched.runtime.placement import is_traced

__all__ = ["Deferral", "deferral", "deferring", "install_deferred_layers"]

Deferral = Callable[[WeightStore], AbstractContextManager[Any]]
"""What a split backward's forward of a stage (and its recomputation) runs in."""

_Deferred = Callable[[nn.Module, WeightStore, tuple[Any, ...], dict[str, Any]], Any]
"""A layer's deferring forward: its output, or None where the call is not one it defers."""


class _Local(threading.local):
    def __init__(self) -> None:
        self.store: WeightStore | None = None
        self.hooks: Any = None


_local = _Local()


class deferring:  # lower case: used as a function, ``with deferring(store):``
    """Inside the block, the calling thread's deferred layers defer into ``store``.

    Entered around each forward of a stage whose backward is split, and around its
    recomputation: the layers defer in both, so a checkpoint recomputes the same
    ops. A checkpoint inside the stage (saved-tensor hooks pushed after entry)
    recomputes without it, so its region runs the layers' own forwards.
    """

    __slots__ = ("_previous", "_store")

    def __init__(self, store: WeightStore) -> None:
        self._store = store

    def __enter__(self) -> None:
        self._previous = (_local.store, _local.hooks)
        _local.store, _local.hooks = self._store, _saved_tensor_hooks()

    def __exit__(self, *exc: object) -> None:
        _local.store, _local.hooks = self._previous


def deferral(stage: nn.Module) -> Deferral:
    """How ``stage``'s forwards defer: layer by layer (installed here, once), or, for a
    traced stage (a graph of ATen ops on the model's parameters), under the mode."""
    if is_traced(stage):
        return DeferredWeightsMode
    install_deferred_layers(stage)
    return deferring


def install_deferred_layers(stage: nn.Module) -> int:
    """Gives each layer of ``stage`` that owns parameters its deferring forward; idempotent.

    A layer whose forward was replaced already (by its user, or here) keeps it;
    one with parameters of its own and sublayers (a model holding a position
    embedding) keeps its forward, which would put the sublayers' ops under the mode.

    Returns:
        The number of layers that defer.
    """
    count = 0
    for module in stage.modules():
        if isinstance(vars(module).get("forward"), _DeferringForward):
            count += 1
            continue
        if (
            "forward" in vars(module)
            or isinstance(module, torch.jit.ScriptModule)  # its forward is compiled
            or next(module.parameters(recurse=False), None) is None
        ):
            continue
        deferred = _deferred_forward(module)
        if deferred is not None:
            module.forward = _DeferringForward(module, deferred)
            count += 1
    return count


class _DeferringForward:
    """A layer's forward: its deferring one while its thread defers, its own otherwise.

    Holds the layer, not its bound forward: a copied or pickled model keeps working.
    """

    __slots__ = ("deferred", "module")

    def __init__(self, module: nn.Module, deferred: _Deferred) -> None:
        self.module, self.deferred = module, deferred

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        store = _local.store
        if store is not None and torch.is_grad_enabled() and _saved_tensor_hooks() == _local.hooks:
            out = self.deferred(module, store, args, kwargs)
            if out is not None:
                return out
        return type(module).forward(module, *args, **kwargs)


def _deferred_forward(module: nn.Module) -> _Deferred | None:
    forward = type(module).forward
    if forward is nn.Linear.forward:
        return _linear
    if forward is nn.LayerNorm.forward:
        return _layer_norm
    if forward is nn.Embedding.forward:
        return _embedding
    if type(module) in _CONVS:  # not a subclass: it may pad its own way
        return _conv
    if isinstance(module, nn.MultiheadAttention) or next(module.children(), None) is None:
        return _under_mode
    return None


def _linear(module: Any, store: WeightStore, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if kwargs or len(args) != 1:
        return None
    return HANDLERS[F.linear](store, (args[0], module.weight, module.bias), {})


def _layer_norm(
    module: Any, store: WeightStore, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if kwargs or len(args) != 1:
        return None
    call = (args[0], module.normalized_shape, module.weight, module.bias, module.eps)
    return HANDLERS[F.layer_norm](store, call, {})


def _embedding(
    module: Any, store: WeightStore, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if kwargs or len(args) != 1:
        return None
    call = (
        args[0], module.weight, module.padding_idx, module.max_norm, module.norm_type,
        module.scale_grad_by_freq, module.sparse,
    )  # fmt: skip
    return HANDLERS[F.embedding](store, call, {})


def _conv(module: Any, store: WeightStore, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if kwargs or len(args) != 1:
        return None
    x, padding = args[0], module.padding
    if module.padding_mode != "zeros":  # padded first, as the layer's own forward pads
        if isinstance(padding, str):
            return None
        x = F.pad(x, [p for p in reversed(padding) for _ in range(2)], mode=module.padding_mode)
        padding = (0,) * len(padding)
    call = (x, module.weight, module.bias, module.stride, padding, module.dilation)
    return HANDLERS[F.conv1d](store, (*call, module.groups), {})  # one handler for 1, 2 and 3-d


_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _under_mode(
    module: Any, store: WeightStore, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Any other layer: its own forward, its deferrable ops taken by the mode."""
    with DeferredWeightsMode(store):
        return type(module).forward(module, *args, **kwargs)


def _saved_tensor_hooks() -> Any:
    return None if top_saved_tensors_hooks is None else top_saved_tensors_hooks()
