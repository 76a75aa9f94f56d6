"""One stage's backward pass, whole or split into input gradients (B) and weight gradients (W).

With a forward run deferring (:mod:`pipesched.runtime.deferred_layers`), B is
one backward that leaves the deferrable weights' products in the micro-batch's store
and W runs them: no retained graph, no second traversal, one recomputation. Without
it, B runs autograd from outputs to inputs with the graph retained, capturing the
gradient entering each intermediate that also leads to a weight, and W runs from
those to the weights. Each backward declares its kind
(:mod:`pipesched.runtime.backward_kind`) for the fused and deferred linears.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from pipesched.errors import ConfigError, ScheduleError
from pipesched.runtime.backward_kind import DEFERRED, FULL, BackwardKind, running
from pipesched.runtime.compat.internals import one_recomputation, run_backward
from pipesched.runtime.deferred import WeightStore
from pipesched.runtime.fused_linear import weight_pass
from pipesched.runtime.weight_split import Grads, WeightSplit

__all__ = ["WeightGradients", "backward_full", "backward_input"]


def backward_full(
    outputs: Sequence[Tensor],
    grad_outputs: Sequence[Tensor | None] | None,
    inputs: Sequence[Any],
) -> Grads:
    """Runs one ordinary backward of a stage: weights' ``.grad`` accumulate, input gradients return.

    Args:
        outputs: the stage's output tensors; for the last stage, the scalar loss.
        grad_outputs: one gradient per output (None: that output gets no
            gradient), or None when every output that requires grad is a scalar
            (a loss), which then gets gradient 1.
        inputs: the stage's inputs as the forward received them. Tensors that
            require grad must be leaves (``x.detach().requires_grad_()``).

    Returns:
        The gradient of each input; None for inputs that are not tensors, do
        not require grad, or do not reach the outputs. Inputs' own ``.grad`` is
        left as it was.

    Raises:
        ConfigError: ``grad_outputs`` does not match ``outputs``, or an input is
            not a leaf.
    """
    return _whole(outputs, grad_outputs, inputs, FULL)


def _whole(
    outputs: Sequence[Tensor],
    grad_outputs: Sequence[Tensor | None] | None,
    inputs: Sequence[Any],
    kind: BackwardKind,
    store: WeightStore | None = None,
) -> Grads:
    """One backward over the whole graph, declared as ``kind``; the inputs' gradients
    (``store``: the weights it may defer, those some other op uses flagged first)."""
    roots, root_grads = _roots(outputs, grad_outputs)
    wanted = _inputs_wanting_grad(inputs)
    result: list[Tensor | None] = [None] * len(inputs)
    if not roots:
        return tuple(result)
    if store is not None:
        store.flag_shared(roots)
    previous = [x.grad for _, x in wanted]
    for _, x in wanted:
        x.grad = None
    try:
        with running(kind):
            run_backward(roots, root_grads)  # each root's gradient is of its shape (_roots)
        for i, x in wanted:
            result[i] = x.grad
    finally:
        for (_, x), grad in zip(wanted, previous, strict=True):
            x.grad = grad
    return tuple(result)


def backward_input(
    outputs: Sequence[Tensor],
    grad_outputs: Sequence[Tensor | None] | None,
    inputs: Sequence[Any],
    store: WeightStore | None = None,
) -> tuple[Grads, WeightGradients]:
    """Runs B: the input gradients only, keeping what the weight gradients will need.

    Args and input gradients as in :func:`backward_full`. Calling the returned
    handle's :meth:`WeightGradients.run` later (W) then accumulates into
    ``.grad`` exactly what :func:`backward_full` would have.

    Args:
        store: the store the forward deferred into
            (:mod:`pipesched.runtime.deferred_layers`), or None
            (a forward run without it). With a store, B is one backward that
            leaves the deferrable weights' gradients to W and accumulates the
            others' (weights some other op also uses) itself, as
            :func:`backward_full` would. Without one, no ``.grad`` changes.

    Returns:
        ``(input gradients, W handle)``. Without a store, where no input
        requires grad (a first stage fed token ids) B computes nothing and W
        runs the whole backward.

    Raises:
        ConfigError: as :func:`backward_full`.

    Example:
        >>> layer = torch.nn.Linear(3, 2)
        >>> x = torch.randn(4, 3).requires_grad_()
        >>> y = layer(x)
        >>> (dx,), w = backward_input([y], [torch.ones(4, 2)], [x])
        >>> layer.weight.grad is None
        True
        >>> w.run()
        >>> layer.weight.grad.shape
        torch.Size([2, 3])
    """
    if store is not None:
        grads = _whole(outputs, grad_outputs, inputs, DEFERRED, store)
        return grads, WeightGradients(store=store)
    roots, root_grads = _roots(outputs, grad_outputs)
    wanted = _inputs_wanting_grad(inputs)
    result: list[Tensor | None] = [None] * len(inputs)
    if not roots:
        return tuple(result), WeightGradients((), overlapping=False)
    plan = WeightSplit.of(roots, [x for _, x in wanted])

    captured: dict[Node, Grads] = {}
    hooks = [node.register_prehook(_capture(captured, node)) for node in plan.intermediates]
    try:
        if wanted:
            captured_leaves = frozenset(get_gradient_edge(x).node for _, x in wanted)
            with running(BackwardKind(captured=captured_leaves)):
                grads = torch.autograd.grad(
                    roots,
                    [x for _, x in wanted],
                    root_grads,
                    retain_graph=bool(plan.groups),
                    allow_unused=True,
                )
            for (i, _), grad in zip(wanted, grads, strict=True):
                result[i] = grad
    finally:
        for hook in hooks:
            hook.remove()
    root_edges = [get_gradient_edge(t) for t in roots]
    passes = tuple(
        _WeightPass(*group.pass_inputs(captured, root_edges, root_grads), group.weights)
        for group in plan.groups
    )
    return tuple(result), WeightGradients(passes, overlapping=plan.retraverses)


class WeightGradients:
    """W of one stage and micro-batch: the weight gradients :func:`backward_input` left pending.

    Holds the stashed operands (``store``), or the captured gradients and the graph
    nodes they enter (``passes``), nothing else; :meth:`run` drops them.
    """

    __slots__ = ("_done", "_overlapping", "_passes", "_store")

    def __init__(
        self,
        passes: tuple[_WeightPass, ...] = (),
        *,
        overlapping: bool = False,
        store: WeightStore | None = None,
    ) -> None:
        self._passes = passes
        self._overlapping = overlapping
        self._store = store
        self._done = False

    @property
    def done(self) -> bool:
        """Whether :meth:`run` has been called."""
        return self._done

    def run(self) -> None:
        """Accumulates the weight gradients into ``.grad`` and frees what B kept for them.

        ``.grad`` of a weight this micro-batch reaches becomes the gradient if
        it was None, else the gradient is added; other weights are untouched.

        Raises:
            ScheduleError: W already ran for this stage and micro-batch.
        """
        if self._done:
            raise ScheduleError(
                "the weight gradients (W) of this stage and micro-batch were already "
                "accumulated; each W runs once: look for a duplicated W action"
            )
        self._done = True
        store, self._store = self._store, None
        if store is not None:
            store.run()
            return
        passes, self._passes = self._passes, ()
        # Passes that share no node can share one recomputation of a checkpointed region.
        with contextlib.nullcontext() if self._overlapping else one_recomputation():
            for weight_pass in passes:
                weight_pass.run(retain_graph=self._overlapping)


@dataclass(frozen=True)
class _WeightPass:
    """One autograd call of W: ``grads`` enter at ``sources`` and reach ``weights``, no others.

    ``clamps`` pins each intermediate's incoming gradient to the one B saw, so a
    pass that re-runs input-gradient nodes between two uses of a weight does not
    count their gradient twice.
    """

    sources: tuple[GradientEdge, ...]
    grads: tuple[Tensor, ...]
    clamps: tuple[tuple[Node, Grads], ...]
    weights: tuple[Tensor, ...]

    def run(self, *, retain_graph: bool) -> None:
        if not self.sources:
            return
        if len(self.sources) == 1 and not retain_graph:
            source = self.sources[0]
            if weight_pass(source.node, self.grads[0], self.weights):
                return
        hooks = [node.register_prehook(_replace(grads)) for node, grads in self.clamps]
        leaves = frozenset(get_gradient_edge(w).node for w in self.weights)
        try:
            with running(BackwardKind(accumulated=leaves)):
                torch.autograd.backward(
                    list(self.sources),
                    list(self.grads),
                    retain_graph=retain_graph,
                    inputs=list(self.weights),
                )
        finally:
            for hook in hooks:
                hook.remove()


def _roots(
    outputs: Sequence[Tensor], grad_outputs: Sequence[Tensor | None] | None
) -> tuple[list[Tensor], list[Tensor]]:
    """The outputs a gradient flows back from, each with its gradient made explicit."""
    if grad_outputs is not None and len(grad_outputs) != len(outputs):
        raise ConfigError(
            f"grad_outputs has {len(grad_outputs)} gradients for {len(outputs)} outputs; "
            "give one per output (None for an output that gets no gradient)"
        )
    roots: list[Tensor] = []
    grads: list[Tensor] = []
    for k, out in enumerate(outputs):
        if not out.requires_grad:
            continue
        if grad_outputs is None:
            if out.numel() != 1:
                raise ConfigError(
                    f"grad_outputs is None but output {k} has shape {tuple(out.shape)}; "
                    "only a scalar loss gets an implicit gradient: pass grad_outputs"
                )
            grad = torch.ones_like(out, memory_format=torch.preserve_format)
        else:
            given = grad_outputs[k]
            if given is None:
                continue
            grad = given
        roots.append(out)
        grads.append(grad)
    return roots, grads


def _inputs_wanting_grad(inputs: Sequence[Any]) -> list[tuple[int, Tensor]]:
    """The tensor inputs that require grad, with their positions; each must be a leaf."""
    wanted: list[tuple[int, Tensor]] = []
    for i, x in enumerate(inputs):
        if isinstance(x, Tensor) and x.requires_grad:
            if x.grad_fn is not None:
                raise ConfigError(
                    f"input {i} is not a leaf (grad_fn {x.grad_fn.name()}); a stage's backward "
                    "stops at its inputs: pass x.detach().requires_grad_() to the forward"
                )
            wanted.append((i, x))
    return wanted


def _capture(captured: dict[Node, Grads], node: Node) -> Callable[[Grads], None]:
    def hook(grads: Grads) -> None:
        captured[node] = tuple(grads)

    return hook


def _replace(grads: Grads) -> Callable[[Grads], Grads]:
    def hook(_: Grads) -> Grads:
        return grads

    return hook
