"""Deferred weight gradients: B keeps each weight's operands, W runs its product directly.

Why not autograd for W: a second traversal per weight group costs a graph walk and an
engine call each, a fifth of a Transformer's backward. Under :class:`DeferredWeightsMode`
the ops whose weight gradient is one product (linear, GPT-2's addmm, convolution,
embedding, self-attention's projections; layer_norm's affine part) run as Functions
(:mod:`pipesched.runtime.deferred_ops`) that in a split B compute the input gradient
and keep ``(input, gradient)`` in the micro-batch's :class:`WeightStore`; W computes
them with autograd's formulas and accumulates as ``AccumulateGrad`` does. A weight
another op also uses (or hooked, or not a leaf) gets its whole gradient from autograd
in B: exact, only not deferred.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from pipesched.runtime.compat.internals import top_saved_tensors_hooks
from pipesched.runtime.deferred_ops import HANDLERS, accumulate, linear_weight_grads
from pipesched.runtime.fused_linear import accumulate_mm, weight_factors

__all__ = ["DeferredWeightsMode", "WeightStore"]

# A stashed product: what W computes, from what, for which parameters.
_Entry = tuple[Callable[..., tuple[Tensor | None, ...]], tuple[Tensor | None, ...], tuple[Any, ...]]


class WeightStore:
    """One stage and micro-batch's deferred weight gradients, filled by B and emptied by W.

    Args:
        fused: ids of the parameters whose gradient W adds into ``.grad`` inside
            the GEMM (:mod:`pipesched.runtime.fused_linear`); others get
            autograd's sum, bitwise.
    """

    __slots__ = ("entries", "flagged", "fused")

    def __init__(self, fused: frozenset[int] = frozenset()) -> None:
        self.fused = fused
        self.flagged: set[int] = set()
        """Ids of parameters an op other than the deferred ones used (autograd's, in B)."""
        self.entries: list[_Entry] = []
        """What B stashed, in the order the backward ran the ops."""

    def __len__(self) -> int:
        return len(self.entries)

    def run(self) -> None:
        """W: each stashed weight gradient computed and accumulated into ``.grad``; frees them.

        The products run last-stashed first (what B touched last is likeliest in
        cache). A parameter reached several times gets the sum of its parts in
        the order B reached them, then one accumulation, as autograd's engine does.
        """
        entries, self.entries = self.entries, []
        uses: dict[int, int] = {}
        for _, params, _ in entries:
            for p in params:
                if p is not None:
                    uses[id(p)] = uses.get(id(p), 0) + 1
        parts: dict[int, list[tuple[int, Tensor]]] = {}
        with torch.no_grad():
            for index in range(len(entries) - 1, -1, -1):
                compute, params, payload = entries.pop()
                w = params[0]
                if compute is linear_weight_grads and w is not None and self._fuses(w, uses):
                    x, grad, transposed, _ = payload  # its only use: added inside the GEMM
                    accumulate_mm(
                        w, *weight_factors(x, grad.reshape(-1, grad.shape[-1]), transposed)
                    )
                    params = (None, params[1])
                grads = compute(params, *payload)
                del payload
                for p, g in zip(params, grads, strict=True):
                    if p is None or g is None:
                        continue
                    if uses[id(p)] == 1:
                        accumulate(p, g)
                        continue
                    held = parts.setdefault(id(p), [])
                    held.append((index, g))
                    if len(held) == uses[id(p)]:
                        del parts[id(p)]
                        held.sort(key=lambda part: part[0])
                        total = held[0][1]
                        for _, part in held[1:]:
                            total = total + part
                        accumulate(p, total)

    def _fuses(self, p: Tensor, uses: dict[int, int]) -> bool:
        return id(p) in self.fused and uses[id(p)] == 1


class DeferredWeightsMode(TorchFunctionMode):
    """Runs a stage's forward with its deferrable ops as Functions writing to ``store``.

    Entered around every forward (and checkpoint recomputation) of a stage whose
    backward is split; which ops are deferred depends on nothing that changes
    between a forward and its recomputation.
    """

    def __init__(self, store: WeightStore) -> None:
        super().__init__()
        self.store = store
        self._hooks: Any = None

    def __enter__(self) -> DeferredWeightsMode:
        # A checkpoint inside the stage recomputes without this mode: its region runs torch's ops.
        self._hooks = _saved_tensor_hooks()
        return super().__enter__()  # type: ignore[no-untyped-call,no-any-return]

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        handler = HANDLERS.get(func)
        if handler is not None and torch.is_grad_enabled() and _saved_tensor_hooks() == self._hooks:
            out = handler(self.store, args, kwargs)
            if out is not None:
                return out
        out = func(*args, **kwargs)
        if _requires_grad(out):  # a weight some other op uses: autograd's in B
            _flag(self.store.flagged, args)
            if kwargs:
                _flag(self.store.flagged, tuple(kwargs.values()))
        return out


def _saved_tensor_hooks() -> Any:
    return None if top_saved_tensors_hooks is None else top_saved_tensors_hooks()


def _requires_grad(out: Any) -> bool:
    if isinstance(out, Tensor):
        return out.requires_grad
    if type(out) is tuple or type(out) is list:
        return any(isinstance(t, Tensor) and t.requires_grad for t in out)
    return False


def _flag(flagged: set[int], args: tuple[Any, ...]) -> None:
    for a in args:
        kind = type(a)
        if kind is Tensor:  # the common case first: Parameter's isinstance is a Python call
            continue
        if kind is nn.Parameter or (issubclass(kind, Tensor) and isinstance(a, nn.Parameter)):
            flagged.add(id(a))
        elif kind is tuple or kind is list:
            _flag(flagged, a)
