"""Which backward pipesched is running, declared to the fused linears a thread built.

A fused linear must know whether the running backward accumulates its weight's
gradient, captures it (``autograd.grad``) or does not want it; torch answers only
the first and last, so pipesched declares what it runs: :data:`FULL`, ``captured``
(B) or ``accumulated`` (a W pass). The declaration is per thread; an undeclared
backward gets every gradient returned to autograd (exact, not fused).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import Node, get_gradient_edge

__all__ = [
    "ACCUMULATE",
    "ACCUMULATE_GRAD",
    "DEFERRED",
    "FULL",
    "RETURN",
    "SKIP",
    "BackwardKind",
    "Declaration",
    "running",
]

SKIP, ACCUMULATE, RETURN = 0, 1, 2
"""What a backward wants of a leaf: nothing, its ``.grad`` accumulated, its gradient returned."""

ACCUMULATE_GRAD: type[Any] = type(get_gradient_edge(torch.zeros((), requires_grad=True)).node)
"""The type of a leaf's node (``AccumulateGrad``)."""


@dataclass(frozen=True)
class BackwardKind:
    """What one backward call does with the leaves (``AccumulateGrad`` nodes) it reaches.

    Attributes:
        full: every leaf accumulates (``torch.autograd.backward`` without ``inputs=``).
        captured: leaves whose gradient is returned (``torch.autograd.grad``'s inputs).
        accumulated: the only leaves that accumulate (``backward``'s ``inputs=``).
        deferred: a split B whose deferrable weight gradients go to their
            micro-batch's store (:mod:`pipesched.runtime.deferred`) for W.
    """

    full: bool = False
    captured: frozenset[Node] = field(default_factory=frozenset)
    accumulated: frozenset[Node] = field(default_factory=frozenset)
    deferred: bool = False

    def leaf(self, node: Node) -> int:
        """:data:`SKIP`, :data:`ACCUMULATE` or :data:`RETURN` for the leaf ``node``."""
        if self.full or node in self.accumulated:
            return ACCUMULATE
        return RETURN if node in self.captured else SKIP


FULL = BackwardKind(full=True)
"""``torch.autograd.backward`` without ``inputs=``."""

DEFERRED = BackwardKind(full=True, deferred=True)
"""A split B: a whole backward, less the weight gradients it defers to W."""


class Declaration:
    """One thread's declared backward; None while it runs none (or one it did not declare)."""

    __slots__ = ("kind",)

    def __init__(self) -> None:
        self.kind: BackwardKind | None = None


class _Local(threading.local):
    def __init__(self) -> None:
        self.declaration = Declaration()


_local = _Local()


def declaration() -> Declaration:
    """The calling thread's declaration (a fused linear keeps its forward thread's)."""
    return _local.declaration


class running:  # lower case: used as a function, ``with running(kind):``
    """Declares ``kind`` as the backward the calling thread runs inside the block.

    A class, not a generator: it is entered around every backward of every
    micro-batch, and a generator's context manager costs three times as much.
    """

    __slots__ = ("_held", "_kind", "_previous")

    def __init__(self, kind: BackwardKind) -> None:
        self._kind = kind

    def __enter__(self) -> None:
        self._held = held = _local.declaration
        self._previous, held.kind = held.kind, self._kind

    def __exit__(self, *exc: object) -> None:
        self._held.kind = self._previous
