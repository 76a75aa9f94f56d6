"""Randomness inside stages: every random draw a pure function of (step seed, micro-batch, place).

Why: stages in threads share torch's generators, so masks would depend on timing
and a recomputation could draw other numbers. Every ``nondeterministic_seeded`` ATen
operation is seeded from (step seed, micro-batch, innermost named module, draw count)
on the thread's own generator, so masks depend on neither timing, cut, schedule nor
process. Only those operations reach Python: each has a kernel at a dispatch key of its
own, on only in a thread that seeds (``compat.random_routing``); a dispatch mode on
every operation stays as the fallback. Draws outside the dispatcher are not covered.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
import threading
from collections.abc import Callable, Sequence
from types import CodeType, FrameType
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from pipesched.runtime.compat.internals import OpOverload, TorchDispatchMode, op_schema
from pipesched.runtime.compat.random_routing import (
    route_random_ops,
    route_random_ops_here,
    seed_here_with,
)

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
    "prepare",
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
        self._kept = self._given  # an operation drew with it: it stays (see keep)
        self.generator = generator
        self.transition: tuple[torch.Tensor, torch.Tensor] | None = None
        self._users: dict[int, StepSeed] = {}  # user's generator (generator_key) -> its seed

    @property
    def drawn(self) -> bool:
        """Whether the seed is known (given, or drawn already)."""
        return self._value is not None

    def get(self) -> int:
        """The seed, drawing it on the first call (thread-safe)."""
        if self._kept:  # no one can give it back any more: no lock (every draw reads it)
            return self._value  # type: ignore[return-value]
        with LOCK:
            if self._value is None:
                generator = self.generator or torch.default_generator
                before = generator.get_state()
                self._value = draw_seed(self.generator)
                self.transition = (before, generator.get_state())
            return self._value

    def keep(self) -> None:
        """An operation drew numbers with the seed: readers need no lock from now on (only a
        failed step's :meth:`put_back` gives it back, with every stage stopped)."""
        self._kept = self._value is not None

    def undraw(self) -> None:
        """Gives a drawn seed back: its generator returns to its state before the draw."""
        with LOCK:
            if not self._given and self.transition is not None:
                (self.generator or torch.default_generator).set_state(self.transition[0])
                self._value, self._kept = None, False

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


_METHODS: dict[int, tuple[CodeType, bool]] = {}  # id(code) -> (code, first argument is self)


def _is_method(code: CodeType) -> bool:
    return bool(code.co_argcount) and code.co_varnames[0] == "self"


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
        counts: draws so far per module name (a user's generator's apart): a
            recomputation starts from zero again in a fresh context, so it draws
            what the forward drew.
        drawn: the innermost named module of each operation that drew numbers
            (None: no named module); a dropout of p = 0 draws none.
        checkpointed: a draw ran inside ``torch.utils.checkpoint`` (the model
            checkpoints itself): its backward recomputes, and must be seeded.
        users: the user's own generators drawn from (``generator=``), by :func:`generator_key`.
        only: seed only the draws made inside these modules (ids of modules seen
            drawing); None: every draw.
        learns: whether :attr:`drawn` is read after the pass; False: it may list
            a module whose operation drew nothing (telling costs two generator states).
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
        self.counts: dict[str, int] = {}
        self._bases: dict[int, int] = {}  # step seed -> (step seed, micro-batch, place) mixed
        self.drawn: dict[int, nn.Module | None] = {}
        self.checkpointed = False
        self.users: dict[int, torch.Generator] = {}
        self.only: frozenset[int] | None = None
        self.learns = True

    def seed_for(
        self, frame: FrameType | None, user: StepSeed | None = None
    ) -> tuple[int, nn.Module | None] | None:
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

        Returns the seed and that module (None: none); None where :attr:`only`
        leaves the draw unseeded (no module of it on the call stack).
        """
        names, only, entry, methods = self.names, self.only, self.entry, _METHODS
        name, innermost, covered = "", None, only is None
        while frame is not None and frame is not entry:
            code = frame.f_code
            if code is _CHECKPOINT:
                self.checkpointed = True
                break
            method = methods.get(id(code))
            if method is None or method[0] is not code:
                method = methods[id(code)] = (code, _is_method(code))
            if method[1]:
                module = frame.f_locals.get("self")  # a method of one of the model's modules?
                ident = id(module)
                place = names.get(ident)
                if place is not None:
                    if innermost is None:
                        name, innermost = place, module
                    covered = covered or ident in only  # type: ignore[operator]
                    if covered:
                        break
            frame = frame.f_back
        while frame is not None and frame is not entry and not self.checkpointed:
            if frame.f_code is _CHECKPOINT:  # the rest of the stack: only for a checkpoint
                self.checkpointed = True
                break
            frame = frame.f_back
        if not covered:
            return None
        if user is not None:  # draws from a user's generator are counted apart
            name += "#generator"
        count = self.counts.get(name, 0)
        self.counts[name] = count + 1
        value = (self.seed if user is None else user).get()
        base = self._bases.get(value)
        if base is None:  # once per pass and step seed
            base = _mix(_mix(_mix(value) ^ self.microbatch) ^ _hash(self.place))
            self._bases[value] = base
        named = _HASHES.get(name)
        if named is None:
            named = _hash(name)
        return _mix(((base ^ named) + count) & _MASK) >> 1, innermost


_MASK = (1 << 64) - 1
_HASHES: dict[str, int] = {}  # a place's or module's name -> its 64-bit hash (see _hash)


def _hash(text: str) -> int:
    """A 64-bit hash of ``text`` that no process or run changes (unlike ``hash``)."""
    value = _HASHES.get(text)
    if value is None:
        digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
        value = _HASHES[text] = int.from_bytes(digest, "little")
    return value


def _mix(z: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit integers, every output bit depending
    on every input bit (two multiplications: a draw's seed in place of a hash of its key)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


class SeededRandomness:
    """While active in a thread, every random operation it runs draws with the seed
    :class:`DrawContext` gives it.

    Operations tagged ``nondeterministic_seeded`` draw from this thread's
    own generator, seeded (or, lacking a ``generator=`` argument, from their
    device's default generator, seeded under a process-wide lock and
    restored afterwards). Operations given an explicit ``generator=`` draw
    from this thread's own generator too, seeded from the step's seed of
    that generator (see the module), which is left otherwise alone.
    After :func:`prepare`, only the random operations reach Python (see the
    module); before it, or where torch lacks the dispatch key, a
    ``TorchDispatchMode`` sees every operation: the same draws, slower.

    Args:
        context: the stage forward the draws belong to.
    """

    def __init__(self, context: DrawContext) -> None:
        self.context = context
        self._exit: list[Any] = []  # how to undo each __enter__ (a mode, or routing's state)
        # Where a draw's call stack starts, counted from _draw: past draw and the mode's
        # __torch_dispatch__, or, routed, past draw, _handle and compat's kernel (see
        # RandomHandler): frames the walk need not build, each a fresh object per draw.
        self._site = 2

    def __enter__(self) -> SeededRandomness:
        if _routing["on"]:
            fast = seed_here_with(self.fast_seed)
            self._exit.append((_active.seeder, route_random_ops_here(True), fast))
            _active.seeder, self._site = self, 4
        else:
            self._site = 2
            mode = _Mode(self)
            mode.__enter__()  # type: ignore[no-untyped-call]
            self._exit.append(mode)
        return self

    def __exit__(self, *exc: object) -> None:
        undo = self._exit.pop()
        if isinstance(undo, _Mode):
            undo.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        else:
            _active.seeder, was, fast = undo
            route_random_ops_here(was)
            seed_here_with(fast)

    def fast_seed(self) -> int | None:
        """The seed of a draw the C++ kernel makes on the CPU from a default generator (what
        :meth:`draw` gives such a draw); -1 where :meth:`draw` must make it (the step's
        seed not drawn yet, or the pass learns whether the operation drew). Called one
        frame below the operation's caller (``compat.random_routing.SeedCallback``).
        """
        context = self.context
        if context.seed._value is None or context.learns:
            return -1
        seeded_here = context.seed_for(sys._getframe(1))
        if seeded_here is None:  # outside the modules seeded: drawn as is (a tripwire sees it)
            return None
        seed, module = seeded_here
        context.drawn[id(module)] = module
        return seed

    def draw(
        self,
        func: OpOverload,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        run: Callable[..., Any],
    ) -> Any:
        """One random operation ``func``, run by ``run(*args, **kwargs)``, seeded.

        ``kwargs`` is the operation's own dict (a fresh one): ``generator=`` is set in it.
        """
        context = self.context
        given: torch.Generator | None = kwargs.get("generator")
        user = None if given is None else context.seed.of(given)
        step_seed = context.seed if user is None else user
        if step_seed._value is not None:  # drawn (the property, without its call)
            return self._draw(func, args, kwargs, run, given, user, fresh=False)
        with LOCK:  # a seed drawn here is given back atomically
            return self._draw(func, args, kwargs, run, given, user, fresh=True)

    def _draw(
        self,
        func: OpOverload,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        run: Callable[..., Any],
        given: torch.Generator | None,
        user: StepSeed | None,
        *,
        fresh: bool,
    ) -> Any:
        context = self.context
        seeded_here = context.seed_for(sys._getframe(self._site), user)
        if seeded_here is None:  # outside the modules seeded: drawn as is (a tripwire sees it)
            return run(*args, **kwargs)
        seed, module = seeded_here
        if given is not None:
            context.users[generator_key(given)] = given
        if given is not None:
            device = given.device
        elif args and isinstance(args[0], torch.Tensor):  # (what _device finds first)
            device = args[0].device
        else:
            device = _device(args, kwargs)
        if given is not None or _takes_generator(func):
            generator = _generators.by_device.get(device) or _private_generator(device)
            generator.manual_seed(seed)  # (a private generator, seeded)
            kwargs["generator"] = generator
            if not (fresh or context.learns):  # whether anything was drawn matters to no one
                context.drawn[id(module)] = module
                return run(*args, **kwargs)
            before = generator.get_state()
            result = run(*args, **kwargs)
            drew = not same_state(before, generator.get_state())
        else:  # e.g. CUDA's native_dropout: the default generator, seeded under the lock
            generator = generator_of(device)
            with LOCK:
                saved = generator.get_state()
                generator.manual_seed(seed)
                before = generator.get_state()
                try:
                    result = run(*args, **kwargs)
                finally:
                    drew = not same_state(before, generator.get_state())
                    generator.set_state(saved)
        if drew:
            context.drawn[id(module)] = module
            if fresh:
                (context.seed if user is None else user).keep()
        elif fresh:
            (context.seed if user is None else user).undraw()
        return result


class _Mode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Without routing: every operation reaches Python; the random ones are seeded."""

    def __init__(self, seeder: SeededRandomness) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.seeder = seeder

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if _SEEDED not in func.tags:
            return func(*args, **kwargs)
        return self.seeder.draw(func, args, kwargs, func)


class _Active(threading.local):
    def __init__(self) -> None:
        self.seeder: SeededRandomness | None = None  # routing's target in this thread


_active = _Active()
_routing = {"on": False}


def _handle(
    func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], run: Callable[..., Any]
) -> Any:
    """A random operation routed to Python: seeded if its thread seeds (a thread that
    routes but seeds nothing, as the autograd engine's for another device, runs it as is)."""
    seeder = _active.seeder
    if seeder is None:
        return run(*args, **kwargs)
    return seeder.draw(func, args, kwargs, run)


def prepare(*, refresh: bool = False) -> bool:
    """Routes random operations to :class:`SeededRandomness` from now on (main thread only).

    Called where stages are built and where a step starts, while no stage runs;
    operations defined since are routed too (``refresh``: looked for whatever
    torch's registries say, before a rerun). Returns whether routing works here.
    """
    _routing["on"] = route_random_ops(_handle, refresh=refresh)
    return _routing["on"]


class _Generators(threading.local):
    def __init__(self) -> None:
        self.by_device: dict[torch.device, torch.Generator] = {}


_generators = _Generators()
_TAKES_GENERATOR: dict[int, tuple[OpOverload, bool]] = {}  # by id: OpOverload hashes in Python


def _takes_generator(func: OpOverload) -> bool:
    """Whether ``func`` has a ``generator=`` argument."""
    known = _TAKES_GENERATOR.get(id(func))
    if known is None or known[0] is not func:
        takes = any(a.name == "generator" for a in op_schema(func).arguments)
        known = _TAKES_GENERATOR[id(func)] = (func, takes)
    return known[1]


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
