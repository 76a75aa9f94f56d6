"""Randomness inside stages: every random draw a pure function of (step seed, micro-batch, place).

Why: stages in threads share torch's generators, so masks would depend on timing
and a recomputation could draw other numbers. A ``TorchDispatchMode`` seeds every
``nondeterministic_seeded`` ATen operation from (step seed, micro-batch, innermost
named module, draw count) on the thread's own generator, so masks depend on neither
timing, cut, schedule nor process. Draws outside the dispatcher are not covered.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
import threading
from collections.abc import Sequence
from contextlib import nullcontext
from types import FrameType
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from pipesched.runtime.compat.internals import OpOverload, TorchDispatchMode, op_schema

__all__ = [
    "LOCK",
    "RANDOM_MODULES",
    "DrawContext",
    "SeededRandomness",
    "StepSeed",
    "draw_seed",
    "generator_key",
    "generator_of",
    "module_names",
    "same_state",
]

RANDOM_MODULES: tuple[type[nn.Module], ...] = (
    nn.modules.dropout._DropoutNd,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
    nn.RReLU,
)
"""Modules that draw random numbers in training mode (a traced graph calls them as layers)."""

_SEEDED = torch.Tag.nondeterministic_seeded
LOCK = threading.RLock()
"""Held around every seeded draw (and by anything that reads a generator's state)."""
_CALL_IMPL = nn.Module._call_impl.__code__
_CHECKPOINT = inspect.unwrap(torch.utils.checkpoint.checkpoint).__code__


class StepSeed:
    """A step's seed: given, or drawn from a generator when first asked for.

    The step's seed is drawn from torch's default CPU generator; a user's
    generator that the step's operations draw from gets a seed of its own,
    drawn from it (:meth:`of`). A seed drawn for an operation that then drew
    nothing (a dropout of p = 0) is given back (:meth:`undraw`): whether a
    step consumes a generator depends only on whether the model drew from it,
    never on how pipesched seeded it.

    Args:
        value: the seed (every rank of a mesh must use one value); None: draw it lazily.
        generator: where it is drawn from; None: torch's default CPU generator.

    Attributes:
        transition: the generator's state just before and just after the
            draw (None: not drawn here), so a tripwire can tell it from an
            unseeded draw.
    """

    def __init__(self, value: int | None = None, generator: torch.Generator | None = None) -> None:
        self._value = value
        self._given = value is not None
        self.generator = generator
        self.transition: tuple[torch.Tensor, torch.Tensor] | None = None
        self._users: dict[int, StepSeed] = {}  # user's generator (generator_key) -> its seed

    @property
    def drawn(self) -> bool:
        """Whether the seed is known (given, or drawn already)."""
        return self._value is not None

    def get(self) -> int:
        """The seed, drawing it on the first call (thread-safe)."""
        with LOCK:
            if self._value is None:
                generator = self.generator or torch.default_generator
                before = generator.get_state()
                self._value = draw_seed(self.generator)
                self.transition = (before, generator.get_state())
            return self._value

    def undraw(self) -> None:
        """Gives a drawn seed back: its generator returns to its state before the draw."""
        with LOCK:
            if not self._given and self.transition is not None:
                (self.generator or torch.default_generator).set_state(self.transition[0])
                self._value = None

    def of(self, generator: torch.Generator) -> StepSeed:
        """The step's seed for draws from ``generator`` (a user's own), drawn from it lazily."""
        key = generator_key(generator)
        seed = self._users.get(key)
        if seed is None:
            with LOCK:
                seed = self._users.setdefault(key, StepSeed(generator=generator))
        return seed

    def seen(self, generator: torch.Generator) -> StepSeed | None:
        """The seed of ``generator`` this step, if one was asked for (:meth:`of`)."""
        return self._users.get(generator_key(generator))

    def put_back(self) -> None:
        """A failed step: every user's generator it drew a seed from goes back (not the CPU's:
        the step's transaction restores that one)."""
        for seed in self._users.values():
            seed.undraw()

    def explains(self, before: torch.Tensor, after: torch.Tensor) -> bool:
        """Whether the generator going from ``before`` to ``after`` is this seed's draw."""
        if self.transition is None:
            return False
        return all(any(same_state(s, t) for t in self.transition) for s in (before, after))


def generator_key(generator: torch.Generator) -> int:
    """Which generator ``generator`` is: the C++ object's address.

    Why not ``id``: the dispatcher hands an operation's ``generator=`` to a
    dispatch mode as a new Python object for the same generator.
    """
    return int(getattr(generator, "_cdata", id(generator)))


def same_state(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two generator states (CPU byte tensors) are equal.

    Their bytes compared: half the time of ``torch.equal``'s dispatch (tripwires
    compare states around every pass of a stage).
    """
    return bool(a.numpy().tobytes() == b.numpy().tobytes())


def draw_seed(generator: torch.Generator | None = None) -> int:
    """A 62-bit seed from ``generator`` (None: torch's default CPU generator)."""
    if generator is None:
        return int(torch.randint(0, 2**62, ()).item())
    return int(torch.randint(0, 2**62, (), generator=generator, device=generator.device).item())


def module_names(
    model: nn.Module, stages: Sequence[nn.Module], extra: Sequence[nn.Module] = ()
) -> list[dict[int, str]]:
    """Per stage, ``id(module) -> name`` for the modules of ``model``: the places of draws.

    Names are the model's own, so places do not depend on the cut; a module
    that runs in several stages (one Dropout called twice in a Sequential)
    gets the stage in its name there, or both calls would draw alike.
    ``extra`` adds modules (a traced model's random operations) under their names.
    """
    names: dict[int, str] = {}
    for root in (model, *extra):
        for name, module in root.named_modules():
            if name:
                names.setdefault(id(module), name)
    holders: dict[int, set[int]] = {}
    for s, stage in enumerate(stages):
        for module in stage.modules():
            holders.setdefault(id(module), set()).add(s)
    shared = [i for i, held in holders.items() if len(held) > 1 and i in names]
    if not shared:
        return [names] * len(stages)
    return [names | {i: f"{names[i]}@stage{s}" for i in shared} for s in range(len(stages))]


class DrawContext:
    """One stage's forward (or recomputation) of one micro-batch: what its draws are keyed by.

    Args:
        names: the model's modules by id (:func:`module_names`).
        seed: the step's seed.
        microbatch: the micro-batch index.
        place: the first element of every draw's key (e.g. ``"loss"``).
        entry: the frame that runs the pass (a stage's forward): the search
            for modules and checkpoints stops there.

    Attributes:
        counts: draws so far per module path: a recomputation starts from zero
            again in a fresh context, so it draws what the forward drew.
        drawn: the innermost named module of each operation that drew numbers
            (None: no named module); a dropout of p = 0 draws none.
        checkpointed: a draw ran inside ``torch.utils.checkpoint`` (the model
            checkpoints itself): its backward recomputes, and must be seeded.
        users: the user's own generators drawn from (``generator=``), by :func:`generator_key`.
    """

    def __init__(
        self,
        names: dict[int, str],
        seed: StepSeed,
        microbatch: int,
        place: str = "",
        entry: FrameType | None = None,
    ) -> None:
        self.names = names
        self.entry = entry
        self.seed = seed
        self.microbatch = microbatch
        self.place = place
        self.counts: dict[tuple[str, str], int] = {}
        self.drawn: dict[int, nn.Module | None] = {}
        self.checkpointed = False
        self.users: dict[int, torch.Generator] = {}

    def seed_for(
        self, frame: FrameType | None, user: StepSeed | None = None
    ) -> tuple[int, nn.Module | None]:
        """The seed of the next draw made from ``frame``: (step, micro-batch, place, count).

        The place is the innermost of the model's named modules running a
        method on the call stack (its ``forward``, or a function of it that
        the model checkpoints): a recomputation that starts inside the model
        (torch's ``checkpoint`` of one layer) finds the same place as the
        forward did.
        Sets :attr:`checkpointed` when the draw is inside a ``torch.utils.checkpoint``
        that the pass runs (pipesched's own checkpoint of a stage runs the pass).

        Args:
            frame: where the draw is made.
            user: the seed of the user's generator the draw names
                (:meth:`StepSeed.of`); None: a draw from a default generator.
                Its draws are counted apart.

        Returns the seed and that module (None: none).
        """
        name, innermost = "", None
        while frame is not None and frame is not self.entry:
            code = frame.f_code
            if innermost is None and code.co_argcount and code.co_varnames[0] == "self":
                module = frame.f_locals.get("self")  # a method of one of the model's modules?
                if id(module) in self.names:
                    name, innermost = self.names[id(module)], module
            if code is _CHECKPOINT:
                self.checkpointed = True
                break
            frame = frame.f_back
        key = (self.place, name) if user is None else (self.place, name + "#generator")
        count = self.counts.get(key, 0)
        self.counts[key] = count + 1
        value = (self.seed if user is None else user).get()
        digest = hashlib.blake2b(
            repr((value, self.microbatch, key, count)).encode(), digest_size=8
        ).digest()
        return int.from_bytes(digest, "little") >> 1, innermost


class SeededRandomness(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """While active, every random operation draws with the seed :class:`DrawContext` gives it.

    Operations tagged ``nondeterministic_seeded`` draw from this thread's
    own generator, seeded (or, lacking a ``generator=`` argument, from their
    device's default generator, seeded under a process-wide lock and
    restored afterwards). Operations given an explicit ``generator=`` draw
    from this thread's own generator too, seeded from the step's seed of
    that generator (see the module), which is left otherwise alone.

    Args:
        context: the stage forward the draws belong to.
    """

    def __init__(self, context: DrawContext) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.context = context

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if _SEEDED not in func.tags:
            return func(*args, **kwargs)
        context = self.context
        given: torch.Generator | None = kwargs.get("generator")
        user = None if given is None else context.seed.of(given)
        step_seed = context.seed if user is None else user
        fresh = not step_seed.drawn
        with LOCK if fresh else nullcontext():  # a seed drawn here is given back atomically
            seed, module = context.seed_for(sys._getframe(1), user)
            if given is not None:
                context.users[generator_key(given)] = given
            device = _device(args, kwargs) if given is None else given.device
            if given is not None or _takes_generator(func):  # a private generator, seeded
                generator = _private_generator(device)
                generator.manual_seed(seed)
                seeded = generator.get_state()
                result = func(*args, **{**kwargs, "generator": generator})
                drew = not torch.equal(seeded, generator.get_state())
            else:  # e.g. CUDA's native_dropout: the default generator, seeded under the lock
                generator = generator_of(device)
                with LOCK:
                    saved = generator.get_state()
                    generator.manual_seed(seed)
                    seeded = generator.get_state()
                    try:
                        result = func(*args, **kwargs)
                    finally:
                        drew = not torch.equal(seeded, generator.get_state())
                        generator.set_state(saved)
            if drew:
                context.drawn[id(module)] = module
            elif fresh:
                step_seed.undraw()
            return result


class _Generators(threading.local):
    def __init__(self) -> None:
        self.by_device: dict[torch.device, torch.Generator] = {}


_generators = _Generators()
_TAKES_GENERATOR: dict[OpOverload, bool] = {}


def _takes_generator(func: OpOverload) -> bool:
    """Whether ``func`` has a ``generator=`` argument."""
    takes = _TAKES_GENERATOR.get(func)
    if takes is None:
        takes = any(a.name == "generator" for a in op_schema(func).arguments)
        _TAKES_GENERATOR[func] = takes
    return takes


def _private_generator(device: torch.device) -> torch.Generator:
    """This thread's own generator for ``device`` (seeded before each use)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    generator = _generators.by_device.get(device)
    if generator is None:
        generator = _generators.by_device[device] = torch.Generator(device=device)
    return generator


def _device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    """The device an operation draws on: its first tensor's, its ``device=``, or the CPU."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    device = kwargs.get("device")
    return torch.device(device) if device is not None else torch.device("cpu")


def generator_of(device: torch.device) -> torch.Generator:
    """The default generator of ``device``."""
    if device.type == "cuda":
        return torch.cuda.default_generators[
            device.index if device.index is not None else torch.cuda.current_device()
        ]
    return torch.default_generator
