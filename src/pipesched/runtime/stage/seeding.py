"""Where a stage's random operations get seeded: the whole forward, or only modules seen drawing.

Why not always the whole forward: the dispatch mode costs a Python call per
operation, and most stages draw nothing. A stage seeds throughout in its first step,
then only the modules seen drawing, with a tripwire on the generators' states: an
unseeded draw raises :class:`UnseededDraws`, and the step is put back and rerun
seeded throughout. A stage of torch's non-drawing layers
(:func:`~pipesched.runtime.stage.draw_free.draws_nothing`) is never seeded.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from types import FrameType
from typing import Any

import torch
from torch import nn

from pipesched.errors import PipeschedError
from pipesched.runtime.stage.draw_free import draws_nothing
from pipesched.runtime.stage.draw_keys import DrawContext, StepSeed, generator_key
from pipesched.runtime.stage.native_keys import native_table
from pipesched.runtime.stage.rng import SeededRandomness, generator_of, prepare
from pipesched.runtime.stage.tripwire import Tripwire

__all__ = ["StageSeeding", "UnseededDraws"]

_STRIKES = 3  # tripwires before a stage stays seeded throughout


class UnseededDraws(PipeschedError, RuntimeError):
    """A stage drew random numbers while its seeding was off; the pipeline reruns the step.

    Seen by users only when the rerun, every pass of every stage seeded
    throughout, trips again: a draw pipesched cannot seed (one made on
    another thread, such as an autograd thread of another device running a
    backward, or another thread of the program drawing from torch's default
    generator, or from a generator a stage uses, while the step ran).
    """


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.context: DrawContext | None = None  # the stage pass running in this thread
        self.mode: SeededRandomness | None = None  # the dispatch mode on in this thread
        self.entered: list[bool] = []  # per module hook: whether it turned the mode on


_thread = _ThreadState()
_NOTHING = nullcontext()  # reusable: a pass of a stage where nothing can draw


class StageSeeding:
    """How one stage's forwards (and backwards) seed their random operations.

    Args:
        names: the model's modules by id (:func:`pipesched.runtime.stage.draw_keys.module_names`).
        module: the stage (its children's ``training`` flags pick what was learned).
        device: the stage's device (its generator is watched with the CPU's).
        adaptive: learn where to seed (see the module's docstring); False:
            seed the whole forward always.
        loss: the passes run the loss function, not ``module``: seeded whatever
            the module is.
        deferred: a tripwire that trips marks the step :attr:`spoiled`
            instead of raising (a mesh: every rank finishes the step, then the
            ranks agree on a rerun).
        label: what the stage is called in messages (``"stage 1"``).

    Attributes:
        recomputes: the stage's backward draws too (the model checkpoints
            itself, so backward recomputes its forward, or an autograd
            Function's backward or a gradient hook draws): backwards are
            seeded like forwards.
        checkpoints: the model checkpoints itself inside the stage
            (``torch.utils.checkpoint``, seen in a seeded pass).
        spoiled: ``deferred`` only: a tripwire tripped in this step (reset by
            :meth:`begin`).
    """

    def __init__(
        self,
        names: dict[int, str],
        module: nn.Module,
        device: torch.device,
        *,
        adaptive: bool,
        loss: bool = False,
        deferred: bool = False,
        label: str = "a stage",
    ) -> None:
        self.names = names
        self.label = label
        self.deferred = deferred
        self.spoiled = False
        self.module = module
        self.plain = not loss  # whether the passes run the module itself (see draws_nothing)
        self.generators = [torch.default_generator]
        if device.type == "cuda":
            self.generators.append(generator_of(device))
        self.permanent = not adaptive
        self.strikes = 0
        self.recomputes = False
        self.checkpoints = False
        self.probing = False  # a rerun: backwards seeded throughout too, a trip is the user's
        self.users: dict[int, torch.Generator] = {}  # users' generators the tripwire watches
        self._scanned = False  # whether the modules were searched for generators (begin())
        self.full = {True: True, False: True}  # per training mode: seed the whole forward
        self.hooked: dict[int, list[Any]] = {}
        self._learning: set[bool] = set()  # modes seeded throughout since the last settle()
        self._quiet: bool | None = None  # during a step: nothing in it can draw (begin())
        self.routed = prepare()  # random operations routed to Python, once per process (rng)
        self.table = native_table(names) if self.routed else None  # (the C++ kernel's names)
        self._only: frozenset[int] = frozenset()  # routed: the modules seen drawing (hooked)

    @property
    def training(self) -> bool:
        """Whether the stage runs in training mode (``model.eval()`` reaches its children)."""
        # The module's _modules read directly: children() walks a generator per call.
        children = [c for c in self.module._modules.values() if c is not None]
        return any(c.training for c in children) if children else self.module.training

    @property
    def watching(self) -> bool:
        """Whether a tripwire is armed in this stage's forwards."""
        return not self.full[self.training]

    def begin(self) -> None:
        """A step starts: whether anything in the stage can draw is read once, for all its passes.

        Why once: :func:`draws_nothing` walks the stage's modules, and a step
        of many micro-batches of a small stage paid that walk at every pass.
        Layers swapped or hooked between steps are seen at the next one.
        """
        self._quiet = self.plain and draws_nothing(self.module)
        self.spoiled = False
        if self.routed:
            prepare()  # operations defined since the last step are routed too
        if not self._scanned:  # the modules' own generators are watched from the first step
            self._scanned = True
            self.users.update((generator_key(g), g) for g in _generators_in(self.module))

    def end(self) -> None:
        """The step has ended: passes outside a step read the stage again each time."""
        self._quiet = None

    def probe(self) -> None:
        """Before a rerun: every pass of the step is seeded throughout (and learned from).

        Backwards too: the draw that tripped may have been in another stage's
        backward (an autograd Function drawing there) that the failed run
        never reached.
        """
        self.full = {True: True, False: True}
        self.probing = True
        self._scanned = False
        prepare(refresh=True)  # operations registered since the stage was built are routed too

    def settle(self, *, pin: bool = False) -> None:
        """After a step: from now on, seeding only in the modules seen drawing.

        Args:
            pin: seed throughout from now on, without tripwires (a stage of the
                pipeline checkpoints itself: torch's recomputation moves the
                shared generator from its thread, which would trip others).
        """
        self.probing = False
        if pin:
            self.permanent = True
            self.full = {True: True, False: True}
        for training in self._learning:
            self.full[training] = self.permanent
        self._learning.clear()

    def forward(
        self, seed: StepSeed, microbatch: int, place: str = ""
    ) -> AbstractContextManager[None]:
        """Runs the block as one forward of this stage for ``microbatch``, its draws seeded.

        Raises:
            UnseededDraws: a tripwire saw a draw no seeding covered.
        """
        if self._quiet and _thread.mode is None:  # nothing can draw: not even a generator
            return _NOTHING
        # The scope itself, not a context manager around it: one generator per pass, not two.
        return self._scope(seed, microbatch, place, sys._getframe(1), backward=False)

    def backward(self, seed: StepSeed, microbatch: int) -> AbstractContextManager[None]:
        """Runs the block as a backward of this stage for ``microbatch``.

        Its draws (a recomputation by the model's own checkpointing) are keyed
        as the forward's were, so they reproduce its masks.

        Raises:
            UnseededDraws: a tripwire saw a draw no seeding covered.
        """
        if self._quiet and _thread.mode is None:
            return _NOTHING
        return self._scope(seed, microbatch, "", sys._getframe(1), backward=True)

    @contextmanager
    def _scope(
        self, seed: StepSeed, microbatch: int, place: str, entry: FrameType, *, backward: bool
    ) -> Iterator[None]:
        """A pass of this stage; ``entry``: the frame running it (its caller's, past contextlib)."""
        quiet = self._quiet
        if quiet is None:  # outside a step: read now
            quiet = self.plain and draws_nothing(self.module)
        if quiet and _thread.mode is None:
            yield  # nothing in it can draw: no seeding, no tripwire
            return
        training = self.training
        mode = _thread.mode
        seeded = self.recomputes or self.probing if backward else self.full[training]
        # Not seeded throughout: routed, only the draws inside the modules seen drawing are
        # (the context made so at once: each call costs microseconds in a stage thread).
        only = self._only if self.routed and self._only and not (mode or seeded) else None
        context = DrawContext(
            self.names, seed, microbatch, place, entry, self.table, only=only, learns=not only
        )
        previous, _thread.context = _thread.context, context
        if mode is not None:  # nested (a recomputation inside a backward): the inner pass keys
            outer, mode.context = mode.context, context
        try:
            if mode is not None or seeded:
                # In the rerun, seeded passes are watched too: a draw no seeding reaches (on
                # another thread) fails the step with what to change, not silently.
                watch = self.probing and mode is None and not self.checkpoints
                wire = self._wire() if watch else None
                context.learns = not self.permanent or (backward and not self.recomputes)
                with _seeded(context):
                    yield
                if wire is not None and not wire.explained(seed):
                    if self.deferred:
                        self.spoiled = True
                    else:
                        raise UnseededDraws(self._tripped(microbatch, backward))
                if backward and context.drawn:  # a recomputation, or a draw in backward
                    self.recomputes = True
                self._learn(context, training)
            elif backward and self.permanent:  # seeded throughout, for good: no tripwire
                with self._in_modules_seen(context):
                    yield
            else:
                wire = self._wire()
                with self._in_modules_seen(context):
                    yield
                if not wire.explained(seed):
                    if self.spoiled:  # deferred, tripped already: the step reruns anyway
                        return  # (a recomputation of the same draw teaches nothing)
                    self.strikes += 1
                    self.permanent = self.permanent or self.strikes >= _STRIKES
                    if self.deferred:
                        self.spoiled = True
                        return
                    raise UnseededDraws(self._tripped(microbatch, backward))
        finally:
            _thread.context = previous
            if mode is not None:
                mode.context = outer
            self.checkpoints = self.checkpoints or context.checkpointed
            self.recomputes = self.recomputes or context.checkpointed

    @staticmethod
    def _in_modules_seen(context: DrawContext) -> AbstractContextManager[Any]:
        """Routed: draws inside the modules seen drawing (``context.only``, set by the
        scope) are seeded, the others run as they are (the tripwire sees them). Not routed,
        the modules' hooks do it (:func:`_enter`)."""
        return _NOTHING if context.only is None else SeededRandomness(context)

    def _wire(self) -> Tripwire:
        """A tripwire on the stage's default generators and the users' it has seen."""
        return Tripwire([*self.generators, *self.users.values()], len(self.generators))

    def _tripped(self, microbatch: int, backward: bool) -> str:
        """What an unseeded draw means: a rerun (first time), or what the user must change."""
        where = "backward" if backward else "forward"
        if not self.probing:
            # Caught by the stepper, which reruns the step seeded throughout.
            return (
                f"{self.label} drew random numbers in its {where} of micro-batch {microbatch} "
                "where none were seen before: the step is rerun with seeding on throughout"
            )
        if backward:
            return (
                f"{self.label} drew random numbers in its backward of micro-batch {microbatch} "
                "(in an autograd.Function's backward or a gradient hook) that pipesched could "
                "not seed, though the step was rerun with every pass seeded: the draw ran on "
                "a thread other than the stage's (an autograd thread of another device), so "
                "recomputation and a split (zero-bubble) backward cannot replay it and runs "
                "would not repeat. Draw the noise in the forward and save it for backward "
                "(ctx.save_for_backward), or draw in backward from a torch.Generator of your "
                "own seeded from the forward's; the step was put back"
            )
        return (
            f"{self.label} drew random numbers in its forward of micro-batch {microbatch} "
            "that pipesched could not seed, though the step was rerun with every pass seeded: "
            "another thread of the program drew from torch's default generator (or from a "
            "generator this stage uses) while the step ran. Give that thread a "
            "torch.Generator of its own; the step was put back"
        )

    def _learn(self, context: DrawContext, training: bool) -> None:
        """After a pass seeded throughout: hooks on the modules that drew (:meth:`settle`)."""
        self._learning.add(training)
        self.users.update(context.users)  # watched by the tripwire from now on
        if self.permanent:
            return
        if any(module is None for module in context.drawn.values()):
            self.permanent = True  # a draw outside every named module: no place for a hook
            return
        for key, module in context.drawn.items():
            if key in self.hooked or module is None:
                continue
            if self.routed:  # found on the call stack by each draw (see rng): no hooks
                self.hooked[key] = []
                self._only = frozenset(self.hooked)
                continue
            self.hooked[key] = [  # first: the module's own pre-hooks may draw
                module.register_forward_pre_hook(_enter, prepend=True),
                module.register_forward_hook(_exit, always_call=True),
            ]


def _generators_in(module: nn.Module) -> list[torch.Generator]:
    """The ``torch.Generator`` attributes of ``module``'s modules (``self.g``)."""
    return [
        value
        for m in module.modules()
        for value in vars(m).values()
        if isinstance(value, torch.Generator)
    ]


@contextmanager
def _seeded(context: DrawContext) -> Iterator[None]:
    """The dispatch mode on for this thread, unless it is on already."""
    if _thread.mode is not None:
        yield
        return
    _thread.mode = mode = SeededRandomness(context)
    try:
        with mode:
            yield
    finally:
        _thread.mode = None


def _enter(module: nn.Module, args: Any) -> None:
    """Forward pre-hook of a module seen drawing: seeding on while it runs (in a stage)."""
    context = _thread.context
    if context is None or _thread.mode is not None:
        _thread.entered.append(False)
        return
    _thread.mode = mode = SeededRandomness(context)
    mode.__enter__()
    _thread.entered.append(True)


def _exit(module: nn.Module, args: Any, output: Any) -> None:
    mode = _thread.mode
    if _thread.entered.pop() if _thread.entered else False:
        _thread.mode = None
        if mode is not None:
            mode.__exit__(None, None, None)
