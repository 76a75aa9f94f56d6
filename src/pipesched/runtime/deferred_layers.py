"""Deferred weight gradients layer by layer: a split backward's forward without a per-op mode.

Why not :class:`~pipesched.runtime.deferred.DeferredWeightsMode` around the whole
forward: a mode runs Python for every torch call, and two stage threads then queue
on the GIL. Here each layer owning weights gets, once per stage, a forward that
defers while its thread runs a split backward's forward (:class:`deferring`) and is
its own otherwise: linear, layer norm, embedding, convolution, self-attention and
HF GPT-2's ``Conv1D`` call their deferring Functions directly; any other layer with
parameters (a norm, attention with masks) runs its forward under the mode, which
sees only that layer's ops. Which weights another op also uses is read from the
graph in B (:meth:`~pipesched.runtime.deferred.WeightStore.flag_shared`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime.compat.internals import is_compiled
from pipesched.runtime.deferred import DeferredWeightsMode, WeightStore, hooks_in_force
from pipesched.runtime.deferred_ops import HANDLERS, linear
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
        _local.store, _local.hooks = self._store, hooks_in_force()

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
    # Why not inside a torch.compile'd module: Dynamo would compile the deferring forward
    # without a guard on this thread's deferral, and reuse it where the layer's own ran (or
    # the reverse): a recomputation then differs from its forward. Its weights get
    # autograd's whole gradient in B: exact, only not deferred.
    compiled = {id(m) for c in stage.modules() if is_compiled(c) for m in c.modules()}
    for module in stage.modules():
        if id(module) in compiled:
            continue
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
        local = _local
        store = local.store
        if store is not None and _grad_enabled() and hooks_in_force() == local.hooks:
            out = self.deferred(module, store, args, kwargs)
            if out is not None or self.deferred in _WHOLE:
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
    if forward is nn.MultiheadAttention.forward:
        return _attention
    if f"{type(module).__module__}.{type(module).__qualname__}" == _GPT2_CONV1D:
        return _gpt2_conv1d
    if isinstance(module, nn.MultiheadAttention) or next(module.children(), None) is None:
        return _under_mode
    return None


def _linear(module: Any, store: WeightStore, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if kwargs or len(args) != 1:
        return None
    return linear(store, args[0], module.weight, module.bias)


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


def _attention(
    module: Any, store: WeightStore, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``nn.MultiheadAttention``'s self-attention without masks, as its forward calls
    ``F.multi_head_attention_forward`` (in training, or with a gradient to take, its
    fast path is off); any other call runs under the mode."""
    try:
        query, key, value, padding_mask, need_weights, mask, average, causal = _attention_args(
            *args, **kwargs
        )
    except TypeError:  # arguments of another torch's: its own forward says what is wrong
        return _under_mode(module, store, args, kwargs)
    plain = (
        query is key is value
        and type(query) is torch.Tensor
        and query.dim() == 3
        and padding_mask is None
        and mask is None
        and not need_weights
        and not causal
        and module.in_proj_weight is not None  # one packed projection
    )
    if plain and (module.training or _requires_grad(query, module)):
        if module.batch_first:
            query = query.transpose(1, 0)
        call = (
            query, query, query, module.embed_dim, module.num_heads, module.in_proj_weight,
            module.in_proj_bias, module.bias_k, module.bias_v, module.add_zero_attn,
            module.dropout, module.out_proj.weight, module.out_proj.bias,
        )  # fmt: skip
        options = {"training": module.training, "need_weights": False}
        out = HANDLERS[F.multi_head_attention_forward](
            store, call, {**options, "average_attn_weights": average}
        )
        if out is not None:
            attended, weights = out
            return (attended.transpose(1, 0) if module.batch_first else attended), weights
    return _under_mode(module, store, args, kwargs)


def _attention_args(
    query: Any,
    key: Any,
    value: Any,
    key_padding_mask: Any = None,
    need_weights: Any = True,
    attn_mask: Any = None,
    average_attn_weights: Any = True,
    is_causal: Any = False,
) -> tuple[Any, ...]:
    return (
        query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
        is_causal,
    )  # fmt: skip


def _requires_grad(query: torch.Tensor, module: Any) -> bool:
    projections = (module.in_proj_weight, module.in_proj_bias, module.out_proj.weight)
    tensors = (query, *projections, module.out_proj.bias)
    return any(t is not None and t.requires_grad for t in tensors)


_GPT2_CONV1D = "transformers.pytorch_utils.Conv1D"
"""HF GPT-2's ``Conv1D``: ``addmm(bias, x_2d, weight)``, its weight ``(in, out)``."""


def _gpt2_conv1d(
    module: Any, store: WeightStore, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Its forward, the ``addmm`` deferring."""
    if kwargs or len(args) != 1 or type(x := args[0]) is not torch.Tensor:
        return None
    size_out = (*x.shape[:-1], module.nf)
    out = HANDLERS[torch.addmm](store, (module.bias, x.view(-1, x.size(-1)), module.weight), {})
    return None if out is None else out.view(size_out)


def _under_mode(
    module: Any, store: WeightStore, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Any other layer: its own forward, its deferrable ops taken by the mode."""
    with DeferredWeightsMode(store):
        return type(module).forward(module, *args, **kwargs)


_grad_enabled = torch.is_grad_enabled


_WHOLE = frozenset({_attention, _under_mode})
"""The deferring forwards that run the whole layer: their output is the layer's, even None."""
