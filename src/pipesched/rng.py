"""Randomness inside stages: every random draw a pure function of (step seed, micro-batch, place).

Why: torch draws random numbers from one generator per device, shared by
every thread. With one worker thread per stage, two stages on the CPU draw
from it concurrently, so dropout masks depend on thread timing; worse,
activation checkpointing replays the generator's state before recomputing a
stage, and a concurrent draw in between makes the recomputed mask differ from
the forward's: gradients that do not belong to the output, silently.
torchgpipe avoids the race by running all CPU stages on one thread, giving up
parallelism; seeding only ``nn.Dropout`` modules (our first release) misses
functional dropout, attention dropout (``nn.MultiheadAttention``, SDPA),
``torch.rand_like`` masks, drop-path and ``bernoulli_``.

So we seed at the one place every random draw passes: the dispatcher. While a
stage runs a micro-batch's forward (or recomputes it), a ``TorchDispatchMode``
sees each ATen operation; those tagged ``nondeterministic_seeded`` (every
random operation torch has, including ones no list here names) run with
their device's default generator seeded from

    (the step's seed, the micro-batch, the module path that called it, its draw count there)

under a process-wide lock, and the generator's state is restored afterwards.
The module path is the chain of the model's own module names on the call
stack (``"encoder.layers.1" > "encoder.layers.1.self_attn"``), found only
when a random operation runs, so it does not depend on how the model was cut
into stages: masks depend on neither timing, balance, schedule, nor process,
and recomputation reproduces them exactly. The step's seed is drawn from
torch's default CPU generator once per step, when the step first needs it: a
model with no random operations leaves that generator as the plain model
would, and ``torch.manual_seed`` makes runs repeat.

What this cannot cover: random numbers drawn outside torch's dispatcher
(Python's ``random``, NumPy), draws inside a custom autograd Function's
backward, and operations given an explicit ``generator=`` (they draw from the
user's generator, which is left alone). A model's non-random operations pay
one Python dispatch per operation in forward (a few microseconds each).
"""

from __future__ import annotations

import hashlib
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "LOCK",
    "RANDOM_MODULES",
    "DrawContext",
    "SeededRandomness",
    "StepSeed",
    "draw_seed",
    "generator_of",
    "module_names",
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


class StepSeed:
    """A step's seed: given, or drawn from torch's default CPU generator when first asked for.

    Args:
        value: the seed (every rank of a mesh must use one value); None: draw it lazily.
    """

    def __init__(self, value: int | None = None) -> None:
        self._value = value

    def get(self) -> int:
        """The seed, drawing it on the first call (thread-safe)."""
        with LOCK:
            if self._value is None:
                self._value = draw_seed()
            return self._value


def draw_seed() -> int:
    """A 62-bit seed from torch's default CPU generator."""
    return int(torch.randint(0, 2**62, ()).item())


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
        place: the first element of every draw's path (e.g. ``"loss"``).

    Attributes:
        counts: draws so far per module path: a recomputation starts from zero
            again in a fresh context, so it draws what the forward drew.
        drawn: the innermost named module of each operation that drew numbers
            (None: no named module); a dropout of p = 0 draws none.
    """

    def __init__(
        self, names: dict[int, str], seed: StepSeed, microbatch: int, place: str = ""
    ) -> None:
        self.names = names
        self.seed = seed
        self.microbatch = microbatch
        self.place = place
        self.counts: dict[tuple[str, ...], int] = {}
        self.drawn: dict[int, nn.Module | None] = {}

    def seed_for(self, frame: FrameType | None) -> tuple[int, nn.Module | None]:
        """The seed of the next draw made from ``frame``: (step, micro-batch, path, count).

        Returns the seed and the innermost named module on the path (None: none).
        """
        path: list[str] = []
        innermost: nn.Module | None = None
        while frame is not None:
            if frame.f_code is _CALL_IMPL:
                module = frame.f_locals.get("self")
                name = self.names.get(id(module))
                if name is not None:
                    path.append(name)
                    innermost = innermost or module
            frame = frame.f_back
        path.append(self.place)
        key = tuple(reversed(path))
        count = self.counts.get(key, 0)
        self.counts[key] = count + 1
        digest = hashlib.blake2b(
            repr((self.seed.get(), self.microbatch, key, count)).encode(), digest_size=8
        ).digest()
        return int.from_bytes(digest, "little") >> 1, innermost


class SeededRandomness(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """While active, every random operation draws with the seed :class:`DrawContext` gives it.

    Operations tagged ``nondeterministic_seeded`` run with their device's
    default generator seeded, under a process-wide lock, and the generator's
    state restored afterwards. Operations given an explicit ``generator=``
    are left alone.

    Args:
        context: the stage forward the draws belong to.
    """

    def __init__(self, context: DrawContext) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.context = context

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if _SEEDED not in func.tags or kwargs.get("generator") is not None:
            return func(*args, **kwargs)
        seed, module = self.context.seed_for(sys._getframe(1))
        generator = generator_of(_device(args, kwargs))
        with LOCK:
            saved = generator.get_state()
            generator.manual_seed(seed)
            seeded = generator.get_state()
            try:
                return func(*args, **kwargs)
            finally:
                if not torch.equal(seeded, generator.get_state()):  # it drew (p = 0 does not)
                    self.context.drawn[id(module)] = module
                generator.set_state(saved)


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
