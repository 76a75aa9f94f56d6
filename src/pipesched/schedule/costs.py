"""Costs of each pass per stage, the input of the simulator."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

from pipesched.errors import ConfigError, ConfigTypeError

__all__ = ["Costs"]

Cost = float | Sequence[float]

_LONGEST = 1e100
"""The longest duration taken: sums over any schedule's actions stay finite floats."""


def _number(value: object) -> bool:
    """Whether ``value`` is one real number: an int, a float, numpy's, a 0-dim array or
    tensor; not a bool."""
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")):
        return False
    if isinstance(value, numbers.Real):
        return True
    return getattr(value, "ndim", None) == 0 and hasattr(value, "__float__")


@dataclass(frozen=True)
class Costs:
    """Durations of the passes, in any unit of time, scalars or one value per stage.

    Args:
        forward: F of one micro-batch on a stage.
        backward: the input-gradient part of backward (B in zero-bubble schedules).
        weight: the weight-gradient part of backward (W). A schedule that does
            not split backward spends ``backward + weight`` in one B.
        send: latency of a transfer between two workers (not between two
            stages on the same worker).

    Example:
        >>> Costs(forward=1, backward=2, weight=1).per_stage(2, split_backward=False)["B"]
        (3.0, 3.0)
    """

    forward: Cost = 1.0
    backward: Cost = 1.0
    weight: Cost = 1.0
    send: float = 0.0

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            one = _number(value)
            if field.name == "send" and not one:
                raise ConfigTypeError(f"Costs.send must be one number, got {value!r}")
            listed = (
                not isinstance(value, str | bytes | bool)
                and isinstance(value, Iterable)
                and getattr(value, "ndim", 1) != 0
            )
            values = [value] if one else list(value) if listed else []  # (a generator: once)
            if not (one or listed) or not all(map(_number, values)):
                raise ConfigTypeError(
                    f"Costs.{field.name} must be a number or a list of numbers, got {value!r}"
                    + (" (a string is not read as one)" if isinstance(value, str) else "")
                )
            floats = tuple(float(v) for v in values)
            bad = [v for v in floats if not math.isfinite(v) or v < 0]
            if bad:
                raise ConfigError(
                    f"Costs.{field.name} must be finite and >= 0, got {value!r}; "
                    "costs are durations"
                )
            if not one:
                object.__setattr__(self, field.name, floats)  # a list becomes a tuple
            elif not isinstance(value, int | float):
                object.__setattr__(self, field.name, floats[0])  # a 0-dim array: a float
            if any(v > _LONGEST for v in floats):
                raise ConfigError(
                    f"Costs.{field.name} must be at most {_LONGEST:g}, got {value!r}: a "
                    "step's sum of such durations overflows a float; give them in a larger "
                    "unit (ms rather than ns)"
                )

    def per_stage(self, num_stages: int, *, split_backward: bool) -> dict[str, tuple[float, ...]]:
        """The duration of F, B and W on each stage.

        Raises:
            ConfigError: a per-stage list does not have ``num_stages`` entries.
        """
        resolved: dict[str, tuple[float, ...]] = {}
        for name in ("forward", "backward", "weight"):
            value = getattr(self, name)
            if isinstance(value, int | float):
                resolved[name] = (float(value),) * num_stages
            elif len(value) != num_stages:
                raise ConfigError(
                    f"Costs.{name} has {len(value)} values but the schedule has "
                    f"{num_stages} stages; give one value per stage or a single number"
                )
            else:
                resolved[name] = tuple(float(v) for v in value)
        forward, backward, weight = resolved["forward"], resolved["backward"], resolved["weight"]
        if not split_backward:
            backward = tuple(b + w for b, w in zip(backward, weight, strict=True))
        return {"F": forward, "B": backward, "W": weight}

    def scaled(self, factor: float) -> Costs:
        """These costs with every pass (not ``send``) multiplied by ``factor``."""

        def scale(value: Cost) -> Cost:
            if isinstance(value, int | float):
                return value * factor
            return [v * factor for v in value]

        return Costs(scale(self.forward), scale(self.backward), scale(self.weight), self.send)
