"""Parameters several stages share (tied weights): their gradients summed in stage order.

Why: stage threads would add into one ``.grad`` in whatever order they get there,
and floating-point addition is not associative. While a step runs, a hook takes each
contribution into its stage's sum (:meth:`TiedGradients.stage`), and the sums are
added to ``.grad`` in stage order when the step has run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from pipesched.runtime.placement import stage_parameters

__all__ = ["TiedGradients", "shared_parameters"]


def shared_parameters(stages: Sequence[nn.Module | None]) -> list[nn.Parameter]:
    """The parameters more than one stage computes with, each once, in order of first use."""
    users: dict[int, tuple[nn.Parameter, set[int]]] = {}
    for s, stage in enumerate(stages):
        if stage is None:
            continue
        for p in stage_parameters(stage):
            users.setdefault(id(p), (p, set()))[1].add(s)
    return [p for p, held in users.values() if len(held) > 1]


class _Current(threading.local):
    def __init__(self) -> None:
        self.stage: int | None = None


class TiedGradients:
    """One step's contributions to shared parameters, per stage, summed in stage order.

    Args:
        stages: the stage modules (None: another rank's).
    """

    def __init__(self, stages: Sequence[nn.Module | None]) -> None:
        self.stages = stages
        self._current = _Current()
        self._sums: dict[tuple[int, int], torch.Tensor] = {}  # (id(param), stage) -> sum
        self._params: list[nn.Parameter] = []
        self._handles: list[Any] = []
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        """Whether contributions are being diverted (between :meth:`begin` and the end)."""
        return bool(self._handles)

    def begin(self) -> None:
        """A step in several threads starts: shared parameters' gradients are diverted.

        Read at each step: parameters replaced since count.
        """
        self._sums.clear()
        self._params = shared_parameters(self.stages)
        self._handles = [
            p.register_hook(self._divert(p))  # type: ignore[no-untyped-call]
            for p in self._params
        ]

    @contextmanager
    def stage(self, s: int) -> Iterator[None]:
        """The block runs stage ``s``'s backward in this thread: its contributions are its."""
        previous, self._current.stage = self._current.stage, s
        try:
            yield
        finally:
            self._current.stage = previous

    def _divert(self, p: nn.Parameter) -> Callable[[torch.Tensor], torch.Tensor | None]:
        key = id(p)

        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            s = self._current.stage
            if s is None:  # not in one of the step's backwards here: autograd's as before
                return None
            with self._lock:  # the dict is shared; each stage's sum has one thread
                held = self._sums.get((key, s))
                self._sums[key, s] = grad if held is None else held + grad
            if grad.layout != torch.strided:
                return torch.zeros_like(grad)
            return grad.new_zeros(()).expand_as(grad)  # AccumulateGrad adds an exact zero

        return hook

    def finish(self) -> None:
        """The step has run: each shared ``.grad`` gets its stages' sums, in stage order."""
        try:
            for p in self._params:
                stages = sorted(s for i, s in self._sums if i == id(p))
                parts = [self._sums[id(p), s] for s in stages]
                if not parts:
                    continue
                total = parts[0]
                for part in parts[1:]:
                    total = _add(total, part)
                grad = p.grad
                if grad is None:
                    p.grad = total.clone() if total is parts[0] else total
                elif grad.layout == torch.strided and total.layout == torch.strided:
                    grad.add_(total)
                else:
                    p.grad = _add(grad, total)
        finally:
            self.end()

    def end(self) -> None:
        """Hooks off, sums dropped (after :meth:`finish`, or a step that failed)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._sums.clear()
        self._params = []


def _add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a + b``, also where ``a`` is sparse and ``b`` dense (torch adds only dense + sparse;
    the sum is the same either way round: floating-point addition commutes)."""
    return b + a if a.layout != torch.strided and b.layout == torch.strided else a + b
