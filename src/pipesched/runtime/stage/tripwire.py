"""A stage pass's tripwire: the generators it watches, which of them moved, and what explains it.

Why a C++ snapshot where the kernel is built: the tripwire runs around every pass of a
stage that draws only in some modules, and in a stage thread beside another each call
from Python costs several times its time alone, a tensor's allocation (as ``get_state``
makes) most of all (docs/guide.md gives the figures). The C++ kernel's ``States`` copies
and compares the states in one call each.
"""

from __future__ import annotations

from typing import Any

import torch

from pipesched.runtime.compat.random_routing import native_module
from pipesched.runtime.stage.draw_keys import LOCK, StepSeed, same_state

__all__ = ["Tripwire"]


class Tripwire:
    """The states of ``generators`` when it is made; :meth:`explained` after the pass.

    Args:
        generators: the watched generators: torch's default CPU generator first,
            then the stage's device's (``devices`` of them in all), then users'.
        devices: how many of ``generators`` are default generators.
    """

    __slots__ = ("_devices", "_generators", "_states")

    def __init__(self, generators: list[torch.Generator], devices: int) -> None:
        self._generators, self._devices = generators, devices
        native = native_module()
        with LOCK:  # not mid-way through a seeded draw on the default generator (rng)
            self._states: Any = (
                native.States(generators)
                if native is not None
                else [g.get_state() for g in generators]
            )

    def moved(self) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """The generators whose state moved: (position, state then, state now)."""
        with LOCK:
            if not isinstance(self._states, list):
                return self._states.moved()  # type: ignore[no-any-return]
            now = [g.get_state() for g in self._generators]
        return [
            (i, then, state)
            for i, (then, state) in enumerate(zip(self._states, now, strict=True))
            if not same_state(then, state)
        ]

    def explained(self, seed: StepSeed) -> bool:
        """Whether every watched generator is where it was, or moved only by a draw of the
        step's seed (of torch's default CPU generator, or of a user's generator)."""
        for i, then, now in self.moved():
            if i == 0:
                drawn: StepSeed | None = seed
            elif i < self._devices:  # a device's generator: no step seed is drawn from it
                return False
            else:
                drawn = seed.seen(self._generators[i])
            if drawn is None or not drawn.explains(then, now):
                return False
        return True
