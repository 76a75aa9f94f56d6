"""The unit of a schedule: one stage running one pass over one micro-batch."""

from __future__ import annotations

import re
from typing import Final, NamedTuple

from pipesched.errors import ScheduleError

__all__ = ["BACKWARD", "FORWARD", "KINDS", "WEIGHT", "Action"]

FORWARD: Final = "F"
"""Forward pass of a stage on a micro-batch."""
BACKWARD: Final = "B"
"""Backward pass. In schedules that also have W it computes only the input gradient."""
WEIGHT: Final = "W"
"""Weight-gradient pass (zero-bubble schedules): the half of backward no stage waits for."""
KINDS: Final = (FORWARD, BACKWARD, WEIGHT)

_SHORT_FORM = re.compile(r"\s*(\d+)\s*([FBW])\s*(\d+)\s*")


class Action(NamedTuple):
    """Stage ``stage`` runs pass ``kind`` (F, B or W) on micro-batch ``microbatch``.

    The short form ``"2F0"`` (stage, kind, micro-batch) round-trips through
    ``str`` and :meth:`parse`.

    Why a NamedTuple and not a frozen dataclass: actions are the nodes of the
    schedule graph and are hashed hundreds of thousands of times when a large
    schedule is validated or simulated; a tuple hashes and compares in C.

    Example:
        >>> a = Action(2, "F", 0)
        >>> str(a)
        '2F0'
        >>> Action.parse("2F0") == a
        True
    """

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Reads the short form ``"<stage><F|B|W><micro-batch>"``.

        Raises:
            ScheduleError: ``text`` is not in the short form.
        """
        match = _SHORT_FORM.fullmatch(text)
        if match is None:
            raise ScheduleError(
                f"action {text!r} is not in the short form <stage><F|B|W><micro-batch>; "
                "write e.g. '2F0' for stage 2, forward, micro-batch 0"
            )
        return cls(int(match[1]), match[2], int(match[3]))
