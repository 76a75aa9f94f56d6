"""Random operations inside stages run seeded: each with its key's seed, on its own generator.

Why: stages in threads share torch's generators, so masks would depend on timing
and a recomputation could draw other numbers. Every ``nondeterministic_seeded`` ATen
operation draws with the seed :mod:`~pipesched.runtime.stage.draw_keys` gives it, on
the thread's own generator. Only those operations leave the dispatcher: each has a
kernel at a dispatch key of its own, on only in a thread that seeds
(``compat.random_routing``); a dispatch mode on every operation stays as the
fallback. Draws outside the dispatcher are not covered.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from pipesched.runtime.compat.internals import OpOverload, TorchDispatchMode, op_schema
from pipesched.runtime.compat.random_routing import (
    keys_here,
    native_module,
    route_random_ops,
    route_random_ops_here,
)
from pipesched.runtime.stage.draw_keys import (
    LOCK,
    DrawContext,
    StepSeed,
    generator_key,
    same_state,
)

__all__ = ["SeededRandomness", "generator_of", "prepare"]

_SEEDED = torch.Tag.nondeterministic_seeded


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
        self._context = context
        self._exit: list[Any] = []  # how to undo each __enter__ (a mode, or routing's state)
        # Where a draw's call stack starts, counted from _draw: past draw and the mode's
        # __torch_dispatch__, or, routed, past draw, _handle and compat's kernel (see
        # RandomHandler): frames the walk need not build, each a fresh object per draw.
        self._site = 2

    @property
    def context(self) -> DrawContext:
        """The pass the draws belong to: a recomputation inside a backward swaps its own in
        (seeding's nested pass), and the C++ kernel then keys by its keys."""
        return self._context

    @context.setter
    def context(self, context: DrawContext) -> None:
        self._context = context
        if self._exit and _routing["native"] is not None and not isinstance(self._exit[-1], _Mode):
            keys_here(context.keys)

    def __enter__(self) -> SeededRandomness:
        if _routing["on"]:
            # The C++ kernel keys this thread's CPU draws by the context's keys (none: each
            # goes to draw): set even where None, or an outer pass's keys would key them.
            native = _routing["native"]
            if native is not None:  # routing on and the keys set in one call
                undo = native.seed_here(self.context.keys)
            else:
                undo = (route_random_ops_here(True), None)
            self._exit.append((_active.seeder, undo))
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
            _active.seeder, (was, keys) = undo
            native = _routing["native"]
            if native is not None:
                native.seed_no_more(was, keys)
            else:
                route_random_ops_here(was)

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
                context.drew(module)
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
            context.drew(module)
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
_routing: dict[str, Any] = {"on": False, "native": None}  # routed; the C++ kernel (None: none)


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
    _routing["native"] = native_module()
    return bool(_routing["on"])


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
