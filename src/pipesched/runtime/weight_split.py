"""Where B stops and W starts in a micro-batch's autograd graph.

Read once per B: which intermediates must have their incoming gradient captured,
and how W splits into autograd calls (a :class:`Group` per source and the weights it
reaches). Pure graph functions over ``torch.autograd.graph.Node``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["Grads", "Group", "WeightSplit", "leaf_node"]

Grads = tuple[Tensor | None, ...]
"""Gradients, one per input of a stage or of a graph node; None where none flows."""


@dataclass(frozen=True)
class Group:
    """Sources and the weights they reach without passing through a node that leads to an input."""

    intermediates: tuple[Node, ...]
    root_nodes: frozenset[Node]
    weights: tuple[Tensor, ...]

    def pass_inputs(
        self, captured: dict[Node, Grads], root_edges: list[GradientEdge], root_grads: list[Tensor]
    ) -> tuple[tuple[GradientEdge, ...], tuple[Tensor, ...], tuple[tuple[Node, Grads], ...]]:
        """``(sources, grads, clamps)`` of this group's W pass, from what B captured.

        ``clamps`` pins each intermediate's incoming gradient to the one B saw.
        """
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
        return tuple(sources), tuple(grads), tuple(clamps)


@dataclass(frozen=True)
class WeightSplit:
    """Where B stops and W starts in one micro-batch's graph."""

    intermediates: tuple[Node, ...]
    groups: tuple[Group, ...]
    retraverses: bool
    """Some W pass re-runs input-gradient nodes (a weight used twice), so no pass may free them."""

    @classmethod
    def of(cls, roots: Sequence[Tensor], inputs: Sequence[Tensor]) -> WeightSplit:
        input_nodes = {get_gradient_edge(x).node for x in inputs}
        root_nodes = list(dict.fromkeys(get_gradient_edge(t).node for t in roots))
        parents = _parents(root_nodes)
        weights = {
            n: w for n in parents if n not in input_nodes and (w := leaf_node(n)) is not None
        }
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
        groups = tuple(Group(tuple(i), frozenset(r), tuple(w)) for i, r, w in members.values())
        retraverses = any(_retraverses(g.intermediates, to_input) for g in groups)
        return cls(tuple(intermediates), groups, retraverses)


def _children(node: Node) -> Iterable[Node]:
    return (child for child, _ in node.next_functions if child is not None)


def leaf_node(node: Node) -> Tensor | None:
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
