"""One stage's backward pass, whole or split into input gradients (B) and weight gradients (W).

Zero-bubble schedules run B as soon as the next stage's gradient arrives (the
previous stage waits for it) and W later, in idle time (no stage waits for it).
B runs autograd from the outputs to the inputs only, graph retained, while a
pre-hook captures the gradient entering each *intermediate*: a node B executes
that also leads to a weight along an edge B does not follow. W runs from those
gradients to the weights only, so B and W together cost one full backward.

Why not ``torch.distributed.pipelining._backward``: it is private and untyped,
and its W needs the inputs to require grad (torch runs a full backward on the
first stage instead). Here weights are the leaves found in the graph, so W
accumulates into exactly the tensors :func:`backward_full` does; an output that
does not depend on the inputs (every output of a first stage fed token ids) is
itself a source of W, so there B computes nothing and W does all the work, the
part that fills bubbles; ``.grad`` is accumulated by autograd's own
``AccumulateGrad`` (layout, hooks), not by hand; the caller's outputs are not
detached in place: the graph dies with the caller's last reference to them.

Costs beyond one backward (results stay exact): a graph analysis per B,
and one autograd call per group of weights in W, except for a fused linear
(:func:`pipesched.runtime.fused_linear.weight_pass` runs its W directly).

- A weight used at several places of one stage (tied, or a layer applied twice):
  W re-runs the input-gradient chain between the uses, clamped so nothing
  counts twice. A node that ignores which gradients are asked for (a custom
  ``autograd.Function``) does its whole work in B and again in W.
- Non-reentrant checkpointing (``use_reentrant=False``) works, but B and W each
  recompute the checkpointed region: one extra forward of it. The passes of one
  W share a recomputation (``torch.utils.checkpoint.GraphExecGroup``); B and W
  cannot, since a node unpacks all its saved tensors whatever it computes.
  Reentrant checkpointing rejects ``torch.autograd.grad``: use
  :func:`backward_full` there.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from pipesched.errors import ConfigError, ScheduleError
from pipesched.runtime.fused_linear import weight_pass

__all__ = ["WeightGradients", "backward_full", "backward_input"]

Grads = tuple[Tensor | None, ...]
"""Gradients, one per input of a stage or of a graph node; None where none flows."""

_one_recomputation: Callable[[], contextlib.AbstractContextManager[Any]] = getattr(
    torch.utils.checkpoint, "GraphExecGroup", contextlib.nullcontext
)
"""Backward calls inside it recompute each non-reentrant checkpointed region once in all."""


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
    roots, root_grads = _roots(outputs, grad_outputs)
    wanted = _inputs_wanting_grad(inputs)
    result: list[Tensor | None] = [None] * len(inputs)
    if not roots:
        return tuple(result)
    previous = [x.grad for _, x in wanted]
    for _, x in wanted:
        x.grad = None
    try:
        torch.autograd.backward(roots, root_grads)
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
) -> tuple[Grads, WeightGradients]:
    """Runs B: the input gradients only, keeping what the weight gradients will need.

    Args and input gradients as in :func:`backward_full`; no ``.grad`` changes.
    Calling the returned handle's :meth:`WeightGradients.run` later (W) then
    accumulates into ``.grad`` exactly what :func:`backward_full` would have.

    Returns:
        ``(input gradients, W handle)``. Where no input requires grad (a first
        stage fed token ids) B computes nothing and W runs the whole backward.

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
    roots, root_grads = _roots(outputs, grad_outputs)
    wanted = _inputs_wanting_grad(inputs)
    result: list[Tensor | None] = [None] * len(inputs)
    if not roots:
        return tuple(result), WeightGradients((), overlapping=False)
    plan = _Plan.of(roots, [x for _, x in wanted])

    captured: dict[Node, Grads] = {}
    hooks = [node.register_prehook(_capture(captured, node)) for node in plan.intermediates]
    try:
        if wanted:
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
    passes = tuple(group.weight_pass(captured, root_edges, root_grads) for group in plan.groups)
    return tuple(result), WeightGradients(passes, overlapping=plan.retraverses)


class WeightGradients:
    """W of one stage and micro-batch: the weight gradients :func:`backward_input` left pending.

    Holds the captured gradients and the graph nodes they enter, nothing else;
    :meth:`run` drops them.
    """

    __slots__ = ("_done", "_overlapping", "_passes")

    def __init__(self, passes: tuple[_WeightPass, ...], *, overlapping: bool) -> None:
        self._passes = passes
        self._overlapping = overlapping
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
        passes, self._passes = self._passes, ()
        # Passes that share no node can share one recomputation of a checkpointed region.
        with contextlib.nullcontext() if self._overlapping else _one_recomputation():
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
        try:
            torch.autograd.backward(
                list(self.sources),
                list(self.grads),
                retain_graph=retain_graph,
                inputs=list(self.weights),
            )
        finally:
            for hook in hooks:
                hook.remove()


@dataclass(frozen=True)
class _Group:
    """Sources and the weights they reach without passing through a node that leads to an input."""

    intermediates: tuple[Node, ...]
    root_nodes: frozenset[Node]
    weights: tuple[Tensor, ...]

    def weight_pass(
        self, captured: dict[Node, Grads], root_edges: list[GradientEdge], root_grads: list[Tensor]
    ) -> _WeightPass:
        sources: list[GradientEdge] = []
        grads: list[Tensor] = []
        clamps: list[tuple[Node, Grads]] = []
        for node in self.intermediates:
            seen = captured.get(node)
            if seen is None:  # B never reached it: no gradient flows there.
                continue
            clamps.append((node, seen))
            for k, grad in enumerate(seen):
                if grad is not None:
                    sources.append(GradientEdge(node, k))
                    grads.append(grad)
        for edge, grad in zip(root_edges, root_grads, strict=True):
            if edge.node in self.root_nodes:
                sources.append(edge)
                grads.append(grad)
        return _WeightPass(tuple(sources), tuple(grads), tuple(clamps), self.weights)


@dataclass(frozen=True)
class _Plan:
    """Where B stops and W starts in one micro-batch's graph."""

    intermediates: tuple[Node, ...]
    groups: tuple[_Group, ...]
    retraverses: bool
    """Some W pass re-runs input-gradient nodes (a weight used twice), so no pass may free them."""

    @classmethod
    def of(cls, roots: Sequence[Tensor], inputs: Sequence[Tensor]) -> _Plan:
        input_nodes = {get_gradient_edge(x).node for x in inputs}
        root_nodes = list(dict.fromkeys(get_gradient_edge(t).node for t in roots))
        parents = _parents(root_nodes)
        weights = {n: w for n in parents if n not in input_nodes and (w := _leaf(n)) is not None}
        to_input = _ancestors(input_nodes.intersection(parents), parents)
        to_weight = _ancestors(weights, parents)

        def weight_side(node: Node) -> bool:
            return node in to_weight and node not in to_input

        intermediates = [
            n
            for n in parents
            if n in to_input and n in to_weight and any(map(weight_side, _children(n)))
        ]
        root_only = [n for n in root_nodes if weight_side(n)]

        # A source and the weights it reaches by weight-side edges run in one autograd call.
        sets = _DisjointSets()
        for n in [*intermediates, *(n for n in parents if weight_side(n))]:
            for c in filter(weight_side, _children(n)):
                sets.union(n, c)
        members: dict[Node, tuple[list[Node], list[Node], list[Tensor]]] = {}
        for n in intermediates:
            members.setdefault(sets.find(n), ([], [], []))[0].append(n)
        for n in root_only:
            members.setdefault(sets.find(n), ([], [], []))[1].append(n)
        for n, w in weights.items():  # each is reached from a source, so has a group
            members[sets.find(n)][2].append(w)
        groups = tuple(_Group(tuple(i), frozenset(r), tuple(w)) for i, r, w in members.values())
        retraverses = any(_retraverses(g.intermediates, to_input) for g in groups)
        return cls(tuple(intermediates), groups, retraverses)


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


def _children(node: Node) -> Iterable[Node]:
    return (child for child, _ in node.next_functions if child is not None)


def _leaf(node: Node) -> Tensor | None:
    """The tensor whose ``.grad`` the node accumulates into, if it is an ``AccumulateGrad``."""
    variable = getattr(node, "variable", None)
    return variable if isinstance(variable, Tensor) else None


def _parents(roots: Iterable[Node]) -> dict[Node, list[Node]]:
    """Every node reachable from ``roots``, in reach order, with its parents."""
    parents: dict[Node, list[Node]] = {r: [] for r in roots}
    queue = deque(parents)
    while queue:
        node = queue.popleft()
        for child in _children(node):
            if child not in parents:
                parents[child] = []
                queue.append(child)
            parents[child].append(node)
    return parents


def _ancestors(targets: Iterable[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """The targets and every node from which one of them is reachable."""
    found = set(targets)
    queue = deque(found)
    while queue:
        for parent in parents[queue.popleft()]:
            if parent not in found:
                found.add(parent)
                queue.append(parent)
    return found


def _retraverses(intermediates: tuple[Node, ...], to_input: set[Node]) -> bool:
    """Whether one intermediate reaches another through input-side nodes."""
    if len(intermediates) < 2:
        return False
    targets = set(intermediates)
    seen: set[Node] = set()
    queue = deque(c for n in intermediates for c in _children(n) if c in to_input)
    while queue:
        node = queue.popleft()
        if node in targets:
            return True
        if node not in seen:
            seen.add(node)
            queue.extend(c for c in _children(node) if c in to_input)
    return False


def _capture(captured: dict[Node, Grads], node: Node) -> Callable[[Grads], None]:
    def hook(grads: Grads) -> None:
        captured[node] = tuple(grads)

    return hook


def _replace(grads: Grads) -> Callable[[Grads], Grads]:
    def hook(_: Grads) -> Grads:
        return grads

    return hook


class _DisjointSets:
    """Union-find over graph nodes."""

    def __init__(self) -> None:
        self._parent: dict[Node, Node] = {}

    def find(self, node: Node) -> Node:
        root = node
        while (up := self._parent.get(root, root)) is not root:
            root = up
        while node is not root:
            node, self._parent[node] = self._parent[node], root
        return root

    def union(self, a: Node, b: Node) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra is not rb:
            self._parent[ra] = rb
