"""Where a stage's random operations get seeded: the whole forward, or only modules seen drawing.

Why not seed the whole forward always: :mod:`pipesched.rng` seeds at the
dispatcher, which costs one Python call per ATen operation while it is on. On a
stage of small layers that made a step up to twice as slow, and most stages
draw nothing at all. So a stage on the local runtime seeds its whole forward
only in its first step (per training mode: ``train()`` and ``eval()`` are
learned apart, dropout draws in one only), recording which modules drew. From
its next step on, only those modules are seeded (a hook turns the dispatch
mode on while they run), and a tripwire watches the rest: before and after
each forward it reads the default generators' states, under the lock every
seeded draw holds (seeded draws restore the state, so they are invisible to
it). A changed state means an unseeded draw, somewhere no draw was seen
before: the stage raises :class:`UnseededDraws`, the pipeline puts the step
back (:mod:`pipesched.transaction`, generators included) and runs it again
with every stage seeded throughout, learning the new place. Draws are keyed
the same way whichever of these is on, so the numbers never depend on it. A
stage whose draws come from no named module (a random loss function), or
that trips three times, stays seeded throughout. On a mesh a rerun would need
every rank, so there every stage is seeded throughout, always.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from pipesched.errors import PipeschedError
from pipesched.rng import LOCK, DrawContext, SeededRandomness, StepSeed, generator_of

__all__ = ["StageSeeding", "UnseededDraws"]

_STRIKES = 3  # tripwires before a stage stays seeded throughout


class UnseededDraws(PipeschedError, RuntimeError):
    """A stage drew random numbers while its seeding was off; the pipeline reruns the step.

    Seen by users only when a rerun trips again: another thread drew from
    torch's default generator while the pipeline ran.
    """


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.context: DrawContext | None = None  # the stage forward running in this thread
        self.modes: list[SeededRandomness | None] = []  # entered by module hooks
        self.active = 0  # dispatch modes on in this thread


_thread = _ThreadState()


class StageSeeding:
    """How one stage's forwards seed their random operations.

    Args:
        names: the model's modules by id (:func:`pipesched.rng.module_names`).
        module: the stage (its ``training`` flag picks what was learned).
        device: the stage's device (its generator is watched with the CPU's).
        adaptive: learn where to seed (see the module's docstring); False:
            seed the whole forward always.
    """

    def __init__(
        self, names: dict[int, str], module: nn.Module, device: torch.device, *, adaptive: bool
    ) -> None:
        self.names = names
        self.module = module
        self.generators = [torch.default_generator]
        if device.type == "cuda":
            self.generators.append(generator_of(device))
        self.permanent = not adaptive
        self.strikes = 0
        self.full = {True: True, False: True}  # per training mode: seed the whole forward
        self.hooked: dict[int, list[Any]] = {}
        self._learning: set[bool] = set()  # modes seeded throughout since the last settle()

    @property
    def needs_seed(self) -> bool:
        """Whether this stage's forwards may draw seeded numbers."""
        return self.full[self.module.training] or bool(self.hooked)

    @property
    def watching(self) -> bool:
        """Whether a tripwire is armed: then a step's seed must be drawn before it starts."""
        return not self.full[self.module.training]

    def probe(self) -> None:
        """Before a rerun: every forward of the step is seeded throughout (and learned from)."""
        self.full = {True: True, False: True}

    def settle(self) -> None:
        """After a step: from now on, seeding only in the modules seen drawing."""
        for training in self._learning:
            self.full[training] = self.permanent
        self._learning.clear()

    @contextmanager
    def forward(self, seed: StepSeed, microbatch: int, place: str = "") -> Iterator[None]:
        """Runs the block as one forward of this stage for ``microbatch``, its draws seeded.

        Raises:
            UnseededDraws: a tripwire saw a draw no seeding covered.
        """
        training = self.module.training
        context = DrawContext(self.names, seed, microbatch, place)
        previous, _thread.context = _thread.context, context
        try:
            if self.full[training]:
                _thread.active += 1
                try:
                    with SeededRandomness(context):
                        yield
                finally:
                    _thread.active -= 1
                self._learn(context, training)
            else:
                before = self._states()
                yield
                if not all(map(torch.equal, before, self._states())):
                    self.strikes += 1
                    self.permanent = self.permanent or self.strikes >= _STRIKES
                    raise UnseededDraws(
                        f"micro-batch {microbatch} drew random numbers where none were seen "
                        "before: the step is rerun with seeding on throughout (a second time "
                        "means another thread drew from torch's default generator meanwhile)"
                    )
        finally:
            _thread.context = previous

    def _states(self) -> list[torch.Tensor]:
        with LOCK:
            return [g.get_state() for g in self.generators]

    def _learn(self, context: DrawContext, training: bool) -> None:
        """After a forward seeded throughout: hooks on the modules that drew (:meth:`settle`)."""
        self._learning.add(training)
        if self.permanent:
            return
        if any(module is None for module in context.drawn.values()):
            self.permanent = True  # a draw outside every named module: no place for a hook
            return
        for key, module in context.drawn.items():
            if key not in self.hooked and module is not None:
                self.hooked[key] = [
                    module.register_forward_pre_hook(_enter),
                    module.register_forward_hook(_exit, always_call=True),
                ]


def _enter(module: nn.Module, args: Any) -> None:
    """Forward pre-hook of a module seen drawing: seeding on while it runs (in a stage)."""
    context = _thread.context
    if context is None or _thread.active:
        _thread.modes.append(None)
        return
    mode = SeededRandomness(context)
    mode.__enter__()  # type: ignore[no-untyped-call]
    _thread.active += 1
    _thread.modes.append(mode)


def _exit(module: nn.Module, args: Any, output: Any) -> None:
    mode = _thread.modes.pop() if _thread.modes else None
    if mode is not None:
        _thread.active -= 1
        mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
