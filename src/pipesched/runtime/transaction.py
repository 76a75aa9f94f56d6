"""A step as a transaction: what a step changes, taken before it and put back if it raises.

Why: a failed step has already added some micro-batches' gradients; a retry
would count them twice, silently. So each ``.grad`` is set aside (not copied)
and the step accumulates into fresh ones, added in at commit; or, under
``grad_backup="host"`` or ``"disk"``, copied off the device
(:mod:`~pipesched.runtime.grad_backup`) while the step adds in place. BatchNorm
statistics, deferred BatchNorm accumulators and the default generators are
kept too.
"""

from __future__ import annotations

import _signal
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from pipesched.runtime.grad_backup import DiskCopies, HostCopies, copies_for, in_place, read_back
from pipesched.runtime.stage.batchnorm import DeferredBatchNorm

__all__ = ["InterruptHold", "StepSnapshot", "deferred_interrupts"]


@dataclass(frozen=True)
class StepSnapshot:
    """What a step may change, as it was before the step.

    Attributes:
        aside: each parameter whose ``.grad`` existed, with that ``.grad``
            (the parameter's ``.grad`` is None until :meth:`commit`).
        fresh: the parameters whose ``.grad`` was None.
        buffers: each BatchNorm running statistic, with a copy.
        deferred: the deferred BatchNorm layers (their accumulators start empty).
        rng: the CPU generator's state, and each initialized CUDA device's.
        early: the parameters committed early (:meth:`commit_early`).
        kept: each parameter whose ``.grad`` the step adds into in place, with
            that tensor (``grad_backup`` "host" or "disk").
        copies: those gradients' copies, or None.
    """

    aside: dict[nn.Parameter, torch.Tensor]
    fresh: tuple[nn.Parameter, ...]
    buffers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    deferred: tuple[DeferredBatchNorm, ...]
    rng: tuple[torch.Tensor, list[torch.Tensor] | None]
    early: set[nn.Parameter] = field(default_factory=set)
    kept: tuple[tuple[nn.Parameter, torch.Tensor], ...] = ()
    copies: HostCopies | DiskCopies | None = None

    @classmethod
    def take(
        cls, parameters: list[nn.Parameter], layers: list[_BatchNorm], backup: str = "device"
    ) -> StepSnapshot:
        """Sets the gradients aside (or copies them, per ``backup``) and remembers
        ``layers``' statistics and the generators."""
        fresh = tuple(p for p in parameters if p.grad is None)
        kept = tuple(
            (p, p.grad) for p in parameters if p.grad is not None and in_place(backup, p.grad)
        )
        # First: a copy that fails leaves everything as it was.
        copies = copies_for(backup, [g for _, g in kept], "the window's gradients before the step")
        aside = {}
        for p in parameters:
            if p.grad is not None and not in_place(backup, p.grad):
                aside[p], p.grad = p.grad, None
        buffers = [
            (buffer, buffer.clone())
            for layer in layers
            for buffer in (layer.running_mean, layer.running_var, layer.num_batches_tracked)
            if isinstance(buffer, torch.Tensor)
        ]
        deferred = tuple(layer for layer in layers if isinstance(layer, DeferredBatchNorm))
        cuda = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            cuda = torch.cuda.get_rng_state_all()
        rng = (torch.get_rng_state(), cuda)
        return cls(aside, fresh, tuple(buffers), deferred, rng, set(), kept, copies)

    def commit(self) -> None:
        """Puts the window's gradients in: each set-aside gradient plus the step's, in the
        step's tensor (as :meth:`commit_early`). Undone by :meth:`restore` until
        :meth:`release`: the set-aside gradients and the copies are still held."""
        with torch.no_grad():
            for p, before in self.aside.items():
                grad = p.grad
                if p in self.early:
                    continue
                if grad is None:
                    p.grad = before
                elif grad.layout == torch.strided and before.layout == torch.strided:
                    p.grad = grad.add_(before)
                else:  # sparse: as AccumulateGrad adds
                    p.grad = before + grad

    def release(self) -> None:
        """Drops what would undo a committed step: it is final."""
        self.aside.clear()
        if self.copies is not None:  # the kept gradients hold the step's sums already
            self.copies.close()

    def commit_early(self, parameters: list[nn.Parameter]) -> None:
        """Makes ``parameters``' gradients final before the step ends (a replica's all-reduce).

        Each ``.grad`` becomes the set-aside gradient plus the step's, in the
        step's tensor (the same bits: addition commutes): the set-aside one
        stays untouched, so :meth:`restore` still puts it back if the step
        fails later.
        """
        with torch.no_grad():
            for p in parameters:
                before = self.aside.get(p)
                if before is None or p in self.early:
                    continue
                self.early.add(p)
                grad = p.grad
                if grad is None:
                    p.grad = before.clone()
                elif grad.layout == torch.strided and before.layout == torch.strided:
                    p.grad = grad.add_(before)
                else:
                    p.grad = before + grad

    def restore(self) -> None:
        """Puts everything back as it was when the snapshot was taken."""
        for p, grad in self.aside.items():
            p.grad = grad
        for p in self.fresh:
            p.grad = None
        for p, grad in self.kept:  # the same tensor, whatever the step put in its place
            p.grad = grad
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
        for layer in self.deferred:
            layer.reset_accumulators()
        cpu, cuda = self.rng
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        if self.copies is not None:  # last: if it fails, all the rest is back
            read_back(
                self.copies,
                [grad for _, grad in self.kept],
                "the step failed, and the gradients of this window's earlier steps are lost; "
                "zero them (optimizer.zero_grad()) and run the window again",
            )


class InterruptHold:
    """Holds Ctrl-C (SIGINT) from its creation until :meth:`release`, which raises one held.

    Why: setting gradients aside, committing or putting them back, cut
    half-way, would leave some parameters' gradients lost or counted twice;
    and a step's commit and its owner's count of it (a window's position)
    are one change, across returns. Only the main thread receives signals,
    and a SIGINT handler set outside Python cannot be put back: there this
    holds nothing.

    Attributes:
        caught: the signals held so far (to stop early where one came).
    """

    __slots__ = ("_previous", "caught")

    def __init__(self) -> None:
        self.caught: list[tuple[int, Any]] = []
        self._previous: Any = None
        if (
            threading.current_thread() is threading.main_thread()
            and _signal.getsignal(signal.SIGINT) is not None
        ):
            # _signal, not signal: the same call without signal.py's enum conversions, a
            # tenth of the time (a step holds interrupts four times).
            self._previous = _signal.signal(signal.SIGINT, self._hold)

    def _hold(self, number: int, frame: Any) -> None:
        self.caught.append((number, frame))

    def deliver(self, note: str | None = None) -> None:
        """Runs now what a held Ctrl-C would have run (the handler before this hold, which
        raises ``KeyboardInterrupt`` unless the program set its own), ``note`` added to
        what it raises; holding goes on."""
        if not self.caught or self._previous is None:
            return
        number, frame = self.caught[0]
        self.caught.clear()
        previous = self._previous
        try:
            if callable(previous):
                previous(number, frame)
            elif previous == signal.SIG_DFL:  # the default action: the process ends
                _signal.signal(signal.SIGINT, previous)
                signal.raise_signal(signal.SIGINT)
        except BaseException as exc:
            if note is not None:
                exc.add_note(note)
            raise

    def release(self, note: str | None = None) -> None:
        """Stops holding, then runs a Ctrl-C held (:meth:`deliver`)."""
        previous = self._previous
        if previous is None:
            return
        _signal.signal(signal.SIGINT, previous)
        try:
            self.deliver(note)
        finally:
            self._previous = None


@contextmanager
def deferred_interrupts() -> Iterator[list[tuple[int, Any]]]:
    """Holds a Ctrl-C (SIGINT) back until the block ends, then raises it
    (:class:`InterruptHold` over the block); the block gets the signals held so far."""
    hold = InterruptHold()
    try:
        yield hold.caught
    finally:
        hold.release()
