"""Deferred weight gradients: B keeps each weight's operands, W runs its product directly.

Why not autograd for W: a second traversal per weight group costs a graph walk and an
engine call each, a fifth of a Transformer's backward. Under :class:`DeferredWeightsMode`
the ops whose weight gradient is one product (linear, GPT-2's addmm, convolution,
embedding, self-attention's projections; layer_norm's affine part) run as Functions
(:mod:`pipesched.runtime.deferred_ops`) that in a split B compute the input gradient
and keep ``(input, gradient)`` in the micro-batch's :class:`WeightStore`; W computes
them with autograd's formulas and accumulates as ``AccumulateGrad`` does. A weight
another op also uses (read from the graph as B starts: :meth:`WeightStore.flag_shared`),
hooked, or not a leaf, gets its whole gradient from autograd in B: exact, only not
deferred. Eager stages defer layer by layer (:mod:`pipesched.runtime.deferred_layers`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import Node
from torch.overrides import TorchFunctionMode

from pipesched.runtime.backward_kind import ACCUMULATE_GRAD
from pipesched.runtime.compat.internals import top_saved_tensors_hooks
from pipesched.runtime.deferred_ops import HANDLERS, input_edges, linear_weight_grads
from pipesched.runtime.fused_linear import accumulate, accumulate_mm, weight_factors

__all__ = ["DeferredWeightsMode", "WeightStore", "hooks_in_force"]

# A stashed product: what W computes, from what, for which parameters.
_Entry = tuple[Callable[..., tuple[Tensor | None, ...]], tuple[Tensor | None, ...], tuple[Any, ...]]


class WeightStore:
    """One stage and micro-batch's deferred weight gradients, filled by B and emptied by W.

    Args:
        fused: ids of the parameters whose gradient W adds into ``.grad`` inside
            the GEMM (:mod:`pipesched.runtime.fused_linear`); others get
            autograd's sum, bitwise.
        siblings: the same stage's stores in this step, in the order of their
            forwards (a list the caller extends), this one included.
    """

    __slots__ = ("entries", "flagged", "fused", "siblings")

    def __init__(
        self, fused: frozenset[int] = frozenset(), siblings: Sequence[WeightStore] = ()
    ) -> None:
        self.fused = fused
        self.siblings = siblings
        self.flagged: set[int] = set()
        """Ids of parameters an op other than the deferred ones used (autograd's, in B)."""
        self.entries: list[_Entry] = []
        """What B stashed, in the order the backward ran the ops."""

    def __len__(self) -> int:
        return len(self.entries)

    def flag_shared(self, roots: Sequence[Tensor]) -> None:
        """Flags the parameters that a backward from ``roots`` reaches other than as the
        weight of a deferred op: B gives them autograd's whole gradient.

        Read from the graph, once per B, so a weight some op uses only in some
        forwards (a data-dependent branch) is flagged exactly where it is used.
        The pending W of a weight flagged here (from micro-batches whose B ran
        before this one) run first: ``.grad`` sums the micro-batches in order, as a
        whole backward per micro-batch does.
        """
        flagged = self.flagged
        seen: set[Node] = set()
        stack: list[Any] = [t.grad_fn for t in roots if t.grad_fn is not None]
        flagged.update(id(t) for t in roots if t.grad_fn is None)  # a leaf as an output
        while stack:
            node = stack.pop()
            kind = type(node)
            inputs = _INPUT_EDGES.get(kind, _UNKNOWN)
            if inputs is _UNKNOWN:
                inputs = _INPUT_EDGES[kind] = input_edges(node)
            for k, (child, _) in enumerate(node.next_functions):
                if child is None:
                    continue
                if type(child) is ACCUMULATE_GRAD:
                    if inputs is None or k in inputs:
                        flagged.add(id(child.variable))
                elif child not in seen:
                    seen.add(child)
                    stack.append(child)
        if flagged:
            for store in self.siblings:  # before its B, this one holds nothing
                if store.entries:
                    store.run(flagged)

    def run(self, only: set[int] | None = None) -> None:
        """W: each stashed weight gradient computed and accumulated into ``.grad``; frees them.

        The products run last-stashed first (what B touched last is likeliest in
        cache). A parameter reached several times gets the sum of its parts in
        the order B reached them, then one accumulation, as autograd's engine does.

        Args:
            only: ids of the parameters to run now (None: all); the others stay.
        """
        entries, self.entries = self.entries, []
        if only is not None:
            entries = [now for e in entries if (now := self._part(e, only)) is not None]
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
                        accumulate(p, _in_order(held))
                        held.clear()
                grads, g = (), None  # freed before the next product: one at a time

    def _part(self, entry: _Entry, only: set[int]) -> _Entry | None:
        """The part of ``entry`` for the parameters in ``only`` (None: no part); the rest of
        it goes back to :attr:`entries`."""
        compute, params, payload = entry
        now = tuple(p if p is not None and id(p) in only else None for p in params)
        later = tuple(None if q is not None else p for p, q in zip(params, now, strict=True))
        if any(p is not None for p in later):
            self.entries.append((compute, later, payload))
        return (compute, now, payload) if any(p is not None for p in now) else None

    def _fuses(self, p: Tensor, uses: dict[int, int]) -> bool:
        return id(p) in self.fused and uses[id(p)] == 1


class DeferredWeightsMode(TorchFunctionMode):
    """Runs a forward with its deferrable ops as Functions writing to ``store``.

    Entered around every forward (and checkpoint recomputation) of a traced stage
    whose backward is split, or of one layer (:mod:`pipesched.runtime.deferred_layers`);
    which ops are deferred depends on nothing that changes between a forward and
    its recomputation.
    """

    def __init__(self, store: WeightStore) -> None:
        super().__init__()
        self.store = store
        self._hooks: Any = None

    def __enter__(self) -> DeferredWeightsMode:
        # A checkpoint inside the stage recomputes without this mode: its region runs torch's ops.
        self._hooks = hooks_in_force()
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
        if handler is not None and torch.is_grad_enabled() and hooks_in_force() == self._hooks:
            out = handler(self.store, args, kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


hooks_in_force: Callable[[], Any] = top_saved_tensors_hooks or (lambda: None)
"""The innermost saved-tensor hooks in force (None: none, or they cannot be read). A
deferral notes them as it starts: a checkpoint inside the stage, whose hooks come after,
recomputes its region without deferring."""


_INPUT_EDGES: dict[type, frozenset[int] | None] = {}
"""Per node type, the positions of its edges that are not a deferring op's weights
(None: all of them)."""
_UNKNOWN = frozenset({-1})


def _in_order(held: list[tuple[int, Tensor]]) -> Tensor:
    """The parts of one parameter's gradient summed in the order B reached them."""
    held.sort(key=lambda part: part[0])
    total = held[0][1]
    for _, part in held[1:]:
        total = total + part
    return total
