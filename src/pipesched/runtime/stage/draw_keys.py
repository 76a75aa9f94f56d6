"""What a random draw inside a stage is keyed by: the step's seed and the draw's place.

A draw's seed is a pure function of (step seed, micro-batch, pass, innermost of the
model's named modules on the call stack, how many draws that module made before), so
it depends on neither timing, cut, schedule nor process. The step's seed is drawn
lazily and given back where nothing drew (:class:`StepSeed`); :class:`DrawContext`
finds a draw's place and mixes its seed, in Python or, where the C++ kernel routes, by
its twin there (``Keys`` in ``compat/rng_kernel.cpp``: the same walk, checked against
this one by a probe: :mod:`~pipesched.runtime.stage.native_keys`). Running the
operation with that seed is :mod:`~pipesched.runtime.stage.rng`'s.
"""

from __future__ import annotations

import hashlib
import inspect
import threading
from collections.abc import Sequence
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.checkpoint
from torch import nn

if TYPE_CHECKING:
    from pipesched.runtime.stage.native_keys import NativeNames

__all__ = [
    "LOCK",
    "RANDOM_MODULES",
    "DrawContext",
    "StepSeed",
    "draw_seed",
    "generator_key",
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


def module_names(model: nn.Module, extra: Sequence[nn.Module] = ()) -> dict[int, str]:
    """``id(module) -> name`` for the modules of ``model``: the places of draws.

    Names are the model's own, so places do not depend on the cut. A module the
    model holds under more than one name (one Dropout at two positions of a
    Sequential, a block reused in two places) is no place: its draws are placed
    by the module that calls it (a Sequential's position by its site,
    :class:`~pipesched.partition.sequential.SequentialStage`), so each use draws
    apart, whichever stages run them. ``extra`` adds modules (a traced model's
    random operations, a Sequential's sites) under their names.
    """
    paths: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if name:
            paths.setdefault(id(module), []).append(name)
    names = {ident: found[0] for ident, found in paths.items() if len(found) == 1}
    for root in extra:
        for name, module in root.named_modules():
            if name:
                names.setdefault(id(module), name)
    return names


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
        table: the stage's names for the C++ kernel
            (:func:`~pipesched.runtime.stage.native_keys.native_table`); None:
            keyed in Python only.
        only: :attr:`only` from the start.
        learns: :attr:`learns` from the start.

    Attributes:
        counts: draws so far per module name (a user's generator's apart): a
            recomputation starts from zero again in a fresh context, so it draws
            what the forward drew. (With a ``table``, its C++ twin :attr:`keys` counts.)
        users: the user's own generators drawn from (``generator=``), by :func:`generator_key`.
        keys: the C++ kernel's ``Keys`` for this pass (None: none): it keys and seeds
            the pass's CPU draws from default generators without calling Python,
            walking the same stack by the same rule, and :meth:`seed_for` asks it.
    """

    def __init__(
        self,
        names: dict[int, str],
        seed: StepSeed,
        microbatch: int,
        place: str = "",
        entry: FrameType | None = None,
        table: NativeNames | None = None,
        *,
        only: frozenset[int] | None = None,
        learns: bool = True,
    ) -> None:
        self.names = names
        self.entry = entry
        self.seed = seed
        self.microbatch = microbatch
        self.place = place
        self.counts: dict[str, int] = {}
        self._bases: dict[int, int] = {}  # step seed -> (step seed, micro-batch, place) mixed
        self._drawn: dict[int, nn.Module | None] = {}
        self._checkpointed = False
        self.users: dict[int, torch.Generator] = {}
        self._only = only
        self._learns = learns
        self.keys: Any = None  # the C++ kernel's twin of this context (see native_table)
        if table is not None:
            self.keys = table.module.Keys(
                table.names, microbatch, _hash(place), entry, only, learns
            )
            if seed._kept:  # (else the first draw that keeps it tells the keys: seed_for)
                self.keys.known = seed._value

    @property
    def drawn(self) -> dict[int, nn.Module | None]:
        """The innermost named module of each operation that drew numbers, by id (None:
        no named module); a dropout of p = 0 draws none."""
        if self.keys is None:
            return self._drawn
        return self._drawn | {id(module): module for module in self.keys.drawn()}

    def drew(self, module: nn.Module | None) -> None:
        """An operation drew numbers in ``module`` (found by :meth:`seed_for`)."""
        self._drawn[id(module)] = module

    @property
    def checkpointed(self) -> bool:
        """A draw ran inside ``torch.utils.checkpoint`` (the model checkpoints itself): its
        backward recomputes, and must be seeded."""
        return self._checkpointed or (self.keys is not None and self.keys.checkpointed)

    @property
    def only(self) -> frozenset[int] | None:
        """Seed only the draws made inside these modules (ids of modules seen drawing); None:
        every draw."""
        return self._only

    @only.setter
    def only(self, only: frozenset[int] | None) -> None:
        self._only = only
        if self.keys is not None:
            self.keys.set_only(only)

    @property
    def learns(self) -> bool:
        """Whether :attr:`drawn` is read after the pass; False: it may list a module whose
        operation drew nothing (telling costs two generator states)."""
        return self._learns

    @learns.setter
    def learns(self, learns: bool) -> None:
        self._learns = learns
        if self.keys is not None:
            self.keys.learns = learns

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
        if self.keys is not None:  # the C++ twin, which counts the C++ kernel's draws too
            step = self.seed if user is None else user
            value = step.get()
            if user is None and step._kept and self.keys.known is None:
                self.keys.known = value  # from now on the C++ kernel seeds draws itself
            return self.keys.seed_for(frame, value, user is not None)  # type: ignore[no-any-return]
        names, only, entry, methods = self.names, self.only, self.entry, _METHODS
        name, innermost, covered = "", None, only is None
        while frame is not None and frame is not entry:
            code = frame.f_code
            if code is _CHECKPOINT:
                self._checkpointed = True
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
        while frame is not None and frame is not entry and not self._checkpointed:
            if frame.f_code is _CHECKPOINT:  # the rest of the stack: only for a checkpoint
                self._checkpointed = True
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
