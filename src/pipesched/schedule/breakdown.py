"""Where a predicted step's idle worker-time goes, and what the step was predicted from."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from pipesched.errors import ConfigError

__all__ = ["PARTS", "Breakdown"]

PARTS = ("ideal", "imbalance", "recomputation", "communication", "overhead", "variability")
"""The parts of the bubble, in the order they are added (see :class:`Breakdown`)."""


@dataclass(frozen=True)
class Breakdown:
    """A predicted step's idle worker-time, split by cause, plus what lies outside the actions.

    Each part is what its cause adds to the idle worker-time (summed over
    workers) when the causes are switched on one after another, in this
    order: ``ideal`` the schedule's own bubble with every stage at the mean
    costs; ``imbalance`` the stages' unequal costs; ``recomputation`` the
    checkpointed micro-batches' forwards run again in backward;
    ``communication`` the latency of transfers between workers; ``overhead``
    the runtime's gap before each action; ``variability`` the spread of like
    actions' durations (a step whose passes vary waits longer than one whose
    passes all take their mean: the slowest producer decides). The parts sum to the timeline's
    total idle time exactly; a part can be negative (more work on one stage
    can fill another's wait).

    Args:
        outside: step time before the first action and after the last one
            (scatter, snapshot, thread start, commit): the predicted step is
            the makespan plus this.
        source: what the costs were measured from, in words.
    """

    ideal: float = 0.0
    imbalance: float = 0.0
    recomputation: float = 0.0
    communication: float = 0.0
    overhead: float = 0.0
    variability: float = 0.0
    outside: float = 0.0
    source: str = ""

    @property
    def idle(self) -> float:
        """The parts' sum: the timeline's idle worker-time."""
        return float(sum(getattr(self, name) for name in PARTS))

    def text(self, scale: float = 1.0, unit: str = "") -> str:
        """``"ideal 3 + imbalance 1 + ..."``, each part times ``scale``, then ``unit``."""
        return " + ".join(f"{name} {scale * getattr(self, name):.3g}{unit}" for name in PARTS)

    def to_dict(self) -> dict[str, Any]:
        """The fields, for JSON."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> Breakdown:
        """Reads :meth:`to_dict`'s output.

        Raises:
            ConfigError: a field is missing, unknown or of the wrong type.
        """
        names = [f.name for f in fields(cls)]
        if not isinstance(data, dict) or sorted(data) != sorted(names):
            raise ConfigError(f"timeline JSON breakdown must have the keys {names}, got {data!r}")
        numbers = [data[n] for n in names if n != "source"]
        if not all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            for v in numbers
        ) or not isinstance(data["source"], str):
            raise ConfigError(
                f"timeline JSON breakdown needs finite numbers and a source text, got {data!r}"
            )
        return cls(**data)
